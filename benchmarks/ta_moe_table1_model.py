"""TA-MoE Table 1 through the cost model (a sanity check against a published figure; docs/performance.md).

TA-MoE §3.3 dispatches 128 MB per device on [[0,1],[0̂,1̂]]: *even* (1/4 to each device) took
14019 µs, *uneven* (1/4 self, 1/2 neighbour, 1/8 to each remote device) 10765 µs: 1.30× faster.
The link model (FasterMoE Eq. 2) prices an all-to-all by its busiest directed link. Per device
the uplink carries 96 MB in both patterns; the node's uplink carries 4 × 32 MB (even) or
4 × 16 MB (uneven). So uneven wins whenever the inter-node link is the bottleneck, by
``128 / max(64, 96·B_net/B_dev)`` — between 1× (fast network) and 2× (slow network). The
published 1.30× sits inside that range and corresponds to a network about as fast as the device
link: 100 Gb/s InfiniBand (12.5 GB/s) behind PCIe 3.0 x16 devices at the ~12 GB/s they achieve in
practice (15.75 GB/s is the spec figure) gives 1.28×. TA-MoE's own hardware is not in the text we
have (it stops in §4.2), so the rows below sweep the plausible range.

    .venv/bin/python benchmarks/ta_moe_table1_model.py [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

from moeflow.perf.costmodel import CostModel
from moeflow.perf.topology import GBIT, Topology
from moeflow.routing.topology_aware import TABLE1_EVEN as EVEN
from moeflow.routing.topology_aware import TABLE1_UNEVEN as UNEVEN

MB = 2**20


def table1(inter_bytes_per_s: float, intra_bytes_per_s: float, total_bytes: float = 128 * MB) -> dict:
    """Predicted even/uneven all-to-all times (seconds) and the speedup."""
    topo = Topology.from_spec([[0, 1], [2, 3]], [inter_bytes_per_s, intra_bytes_per_s])
    model = CostModel(topo, gemm_flops_per_s=1e12)
    even = float(model.a2a_time(EVEN * total_bytes))
    uneven = float(model.a2a_time(UNEVEN * total_bytes))
    return {
        "inter_bytes_per_s": inter_bytes_per_s,
        "intra_bytes_per_s": intra_bytes_per_s,
        "even_s": even,
        "uneven_s": uneven,
        "speedup": even / uneven,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="TA-MoE Table 1 through the cost model")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = [
        table1(100 * GBIT, 12e9),
        table1(100 * GBIT, 15.75e9),
        table1(50 * GBIT, 15.75e9),
        table1(200 * GBIT, 15.75e9),
    ]
    published = {"even_us": 14019, "uneven_us": 10765, "speedup": 14019 / 10765}
    if args.json:
        print(json.dumps({"published": published, "predicted": rows}, indent=2))
        return 0
    print(
        f"TA-MoE Table 1 (published): even {published['even_us']} us, uneven {published['uneven_us']} us, "
        f"{published['speedup']:.2f}x"
    )
    print(f"{'inter-node':>12}{'device link':>13}{'even (us)':>12}{'uneven (us)':>13}{'speedup':>9}")
    for r in rows:
        print(
            f"{r['inter_bytes_per_s'] * 8 / 1e9:>8.0f} Gb/s{r['intra_bytes_per_s'] / 1e9:>8.2f} GB/s"
            f"{1e6 * r['even_s']:>12.0f}{1e6 * r['uneven_s']:>13.0f}{r['speedup']:>8.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
