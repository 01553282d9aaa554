"""A multi-node-like cluster on one Linux machine: network namespaces, veth links, ``tc`` shaping.

Every "node" is a network namespace holding its ranks (they talk over the namespace's loopback,
the fast intra-node path). Every node has one veth pair to a Linux bridge that lives in a switch
namespace of its own; ``tc netem`` shapes both directions of every node's link (bandwidth and
latency), so inter-node traffic crosses two shaped hops: node -> switch -> node. Nothing is
created in the host's own namespace, and the addresses (``10.77.0.0/24``) exist only inside the
namespaces this module creates. Everything is torn down on exit, on failure and on SIGINT/SIGTERM.

The command is started once per rank with the environment torchrun gives its workers (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT), plus
``GLOO_SOCKET_IFNAME=eth0`` so gloo binds the node's link. Needs root and iproute2.

    sudo python scripts/testbed.py --nodes 2 --ranks-per-node 2 --bandwidth-mbit 800 --latency-ms 0.2 -- \\
        .venv/bin/moeflow profile --out results/profile-testbed.json
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

SUBNET = "10.77.0"
"""Private /24 used only inside the testbed's own namespaces."""


@dataclass
class TestbedConfig:
    """Shape of the emulated cluster."""

    nodes: int = 2
    """Number of nodes (network namespaces)."""
    ranks_per_node: int = 2
    """Processes per node; they share the node's namespace."""
    bandwidth_mbit: float | None = 800.0
    """Inter-node link bandwidth in Mbit/s per direction (None: unshaped veth)."""
    latency_ms: float = 0.0
    """One-way inter-node latency in ms (split over the two shaped hops)."""
    master_port: int = 29500
    """Port of the rendezvous store on rank 0."""
    log_dir: str | None = None
    """Directory for per-rank logs (default: a temporary directory, printed on failure)."""
    timeout_s: float | None = None
    """Kill the job after this many seconds (None: no limit)."""

    def __post_init__(self) -> None:
        for name in ("nodes", "ranks_per_node"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r}: must be a positive int")
        if self.nodes > 200:
            raise ValueError(f"nodes={self.nodes!r}: at most 200 nodes fit the testbed's /24")
        if self.bandwidth_mbit is not None and not self.bandwidth_mbit > 0:
            raise ValueError(f"bandwidth_mbit={self.bandwidth_mbit!r}: must be > 0 (or None for unshaped)")
        if self.latency_ms < 0:
            raise ValueError(f"latency_ms={self.latency_ms!r}: must be >= 0")
        if not 1024 <= self.master_port <= 65535:
            raise ValueError(f"master_port={self.master_port!r}: expected 1024..65535")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


class _Interrupted(Exception):
    pass


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Testbed:
    """Context manager: builds the namespaces on enter, removes them on exit."""

    def __init__(self, config: TestbedConfig) -> None:
        self.config = config
        # Short unique prefix: interface names are limited to 15 characters.
        self.prefix = f"mf{os.getpid() % 100000}"
        self.switch_ns = f"{self.prefix}sw"
        self.node_ns = [f"{self.prefix}n{n}" for n in range(config.nodes)]
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def __enter__(self) -> Testbed:
        if os.geteuid() != 0:
            raise PermissionError("the testbed creates network namespaces: run it as root")
        if shutil.which("ip") is None or shutil.which("tc") is None:
            raise FileNotFoundError("the testbed needs iproute2 (`ip`, `tc`): apt-get install iproute2")
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def _shape(self, ns: str, dev: str) -> None:
        """Shape the egress of ``dev``: netem (delay, optionally rate) when latency is asked for,
        else a token bucket (tbf). Both ends of every node link are shaped, so each direction
        crosses two shaped hops: each carries half the one-way latency, the rate is the link's."""
        cfg = self.config
        tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root"]
        if cfg.latency_ms > 0:
            cmd = [*tc, "netem", "delay", f"{cfg.latency_ms / 2:.4f}ms", "limit", "100000"]
            if cfg.bandwidth_mbit is not None:
                cmd += ["rate", f"{cfg.bandwidth_mbit:g}mbit"]
        elif cfg.bandwidth_mbit is not None:
            # burst >= one timer tick of traffic at the rate (tc-tbf(8)); 50 ms of queue.
            burst = max(64 * 1024, int(cfg.bandwidth_mbit * 1e6 / 8 / 250))
            cmd = [*tc, "tbf", "rate", f"{cfg.bandwidth_mbit:g}mbit", "burst", str(burst), "latency", "50ms"]
        else:
            return
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            hint = " (this kernel has no sch_netem: use latency_ms=0)" if cfg.latency_ms > 0 else ""
            raise RuntimeError(f"tc failed{hint}: {' '.join(cmd[4:])}: {res.stderr.strip()}")

    def _build(self) -> None:
        _ip("netns", "add", self.switch_ns)
        self._created.append(self.switch_ns)
        _ip("-n", self.switch_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch_ns, "link", "set", "br0", "up")
        _ip("-n", self.switch_ns, "link", "set", "lo", "up")
        for n, ns in enumerate(self.node_ns):
            _ip("netns", "add", ns)
            self._created.append(ns)
            port = f"p{n}"
            _ip(
                "link",
                "add",
                "eth0",
                "netns",
                ns,
                "type",
                "veth",
                "peer",
                "name",
                port,
                "netns",
                self.switch_ns,
            )
            _ip("-n", ns, "addr", "add", f"{self.address(n)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", self.switch_ns, "link", "set", port, "master", "br0")
            _ip("-n", self.switch_ns, "link", "set", port, "up")
            self._shape(ns, "eth0")
            self._shape(self.switch_ns, port)

    def teardown(self) -> None:
        """Stop every started process group, then delete the namespaces (and with them the links)."""
        self._stop_processes()
        for ns in reversed(self._created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._created.clear()

    def _stop_processes(self) -> None:
        """SIGTERM every rank's process group (they run in their own sessions), SIGKILL after 5 s."""
        for p in self._procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for p in self._procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self._procs.clear()

    def run(self, command: Sequence[str], env: dict[str, str] | None = None) -> int:
        """Start ``command`` once per rank, wait for all; first failure stops the others.
        Returns the first non-zero exit status (0 if all succeeded). Rank 0 streams to stdout."""
        cfg = self.config
        if not command:
            raise ValueError("command=[]: give the command to run on every rank")
        log_dir = Path(cfg.log_dir or tempfile.mkdtemp(prefix="moeflow-testbed-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        logs = []
        for n, ns in enumerate(self.node_ns):
            for local in range(cfg.ranks_per_node):
                rank = n * cfg.ranks_per_node + local
                rank_env = {
                    **os.environ,
                    **(env or {}),
                    "RANK": str(rank),
                    "WORLD_SIZE": str(cfg.world_size),
                    "LOCAL_RANK": str(local),
                    "LOCAL_WORLD_SIZE": str(cfg.ranks_per_node),
                    "GROUP_RANK": str(n),
                    "NODE_RANK": str(n),
                    "MASTER_ADDR": self.address(0),
                    "MASTER_PORT": str(cfg.master_port),
                    "GLOO_SOCKET_IFNAME": "eth0",
                }
                # Every emulated node shares this host's cores: each rank gets its share of all of
                # them (LOCAL_WORLD_SIZE alone would hand each node's ranks the whole host).
                rank_env.setdefault("MOEFLOW_CPU_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.world_size)))
                log = open(log_dir / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
                logs.append(log)
                streams = {} if rank == 0 else {"stdout": log, "stderr": subprocess.STDOUT}
                self._procs.append(
                    subprocess.Popen(
                        ["ip", "netns", "exec", ns, *command], env=rank_env, start_new_session=True, **streams
                    )
                )
        start = time.monotonic()
        rc = 0
        try:
            while True:
                codes = [p.poll() for p in self._procs]
                failed = [c for c in codes if c not in (None, 0)]
                if failed:
                    rc = failed[0]
                    break
                if all(c == 0 for c in codes):
                    break
                if cfg.timeout_s is not None and time.monotonic() - start > cfg.timeout_s:
                    rc = 124
                    break
                time.sleep(0.05)
        finally:
            for log in logs:
                log.close()
        if rc:
            print(f"testbed: a rank failed (exit {rc}); logs in {log_dir}", file=sys.stderr)
            for r in range(1, cfg.world_size):
                text = (log_dir / f"rank{r}.log").read_text()[-1500:]
                if text.strip():
                    print(f"--- rank {r} (tail) ---\n{text}", file=sys.stderr)
        self._stop_processes()
        return rc


def run_on_testbed(config: TestbedConfig, command: Sequence[str], env: dict[str, str] | None = None) -> int:
    """Build, run, tear down — also on SIGINT/SIGTERM (turned into an exception so ``finally`` runs)."""

    def on_signal(signum: int, frame: object) -> None:
        raise _Interrupted(signal.Signals(signum).name)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with Testbed(config) as tb:
            return tb.run(command, env)
    except _Interrupted as exc:
        print(f"testbed: interrupted by {exc}; torn down", file=sys.stderr)
        return 130
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Run a command on an emulated N-node cluster (netns + veth + tc).")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--bandwidth-mbit", type=float, default=800.0, help="inter-node Mbit/s; 0 = unshaped")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="one-way inter-node latency")
    parser.add_argument("--master-port", type=int, default=29500)
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--timeout-s", type=float, default=None)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        config = TestbedConfig(
            args.nodes,
            args.ranks_per_node,
            args.bandwidth_mbit or None,
            args.latency_ms,
            args.master_port,
            args.log_dir,
            args.timeout_s,
        )
        return run_on_testbed(config, command)
    except (ValueError, PermissionError, FileNotFoundError, RuntimeError) as exc:
        print(f"testbed: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
