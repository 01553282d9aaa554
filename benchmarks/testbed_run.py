"""Run a moeflow command on the network testbed (scripts/testbed.py), for the benchmark drivers.

Needs root (network namespaces, tc). The testbed tears its namespaces down even on failure.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MOEFLOW = str(Path(sys.executable).with_name("moeflow"))


def on_testbed(
    args: list[str],
    nodes: int = 2,
    ranks_per_node: int = 2,
    bandwidth_mbit: float = 800.0,
    latency_ms: float = 0.0,
    timeout_s: float = 1800.0,
) -> None:
    """`moeflow ARGS...` on every rank of an emulated `nodes` × `ranks_per_node` cluster."""
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "testbed.py"),
        "--nodes",
        str(nodes),
        "--ranks-per-node",
        str(ranks_per_node),
        "--bandwidth-mbit",
        str(bandwidth_mbit),
        "--latency-ms",
        str(latency_ms),
        "--timeout-s",
        str(timeout_s),
        "--",
        MOEFLOW,
        *args,
    ]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def ensure_profile(path: Path, bandwidth_mbit: float, nodes: int = 2, ranks_per_node: int = 2) -> Path:
    """The testbed's own α-β profile (measured once, reused): planners and losses price with it."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        on_testbed(["profile", "--out", str(path)], nodes, ranks_per_node, bandwidth_mbit)
    return path
