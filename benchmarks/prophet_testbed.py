"""Pro-Prophet on the network testbed: EP, FasterMoE shadowing, `prophet` without and with the
block-wise prefetch, side by side (Williams order), on Zipf skews and on the SmartMoE trace
replayed iteration by iteration (consecutive recorded iterations, so the locality is the trace's).

    sudo .venv/bin/python benchmarks/prophet_testbed.py --out results/prophet-testbed.json
    sudo .venv/bin/python benchmarks/prophet_testbed.py --ranks-per-node 1 --out results/prophet-testbed-2x1.json

Each timed model is two blocks (MoE layer + dense residual part; `moeflow bench --blocks 2`), so
the second layer's copies can be prefetched during the first block (Pro-Prophet §V). The planners
price with the testbed's own profile (measured first if missing). Every row carries the cost
model's predicted time of the layers it ran (Eq. 6 over the shared model) next to the measurement.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from testbed_run import bench_on_testbed  # noqa: E402

VARIANTS = ["ep:sync", "shadow:sync", "prophet:sync", "prophet:sync+prefetch"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/prophet-testbed.json")
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--bandwidth-mbit", type=float, default=800.0)
    parser.add_argument("--iterations", type=int, default=16)
    parser.add_argument("--skews", type=float, nargs="+", default=[0.0, 1.2, 2.0])
    parser.add_argument("--profile", default=None, help="default: results/profile-testbed[-2x1].json")
    args = parser.parse_args()
    result = bench_on_testbed(__file__, args, 2, VARIANTS)
    print(
        f"{'routing':<18}{'variant':<24}{'ms':>8}{'vs EP':>7}{'copies':>8}{'load std':>9}{'model ms':>9}{'hidden':>8}"
    )
    for r in result["rows"]:
        variant = f"{r['strategy']}:{r['schedule']}" + ("+prefetch" if r["prefetch"] else "")
        model = r["model_predicted_s"]
        print(
            f"{r['routing']:<18}{variant:<24}{1e3 * r['median_s']:8.1f}{r['speedup_vs_ep']:7.2f}"
            f"{r['copies_mean']:8.1f}{r['load_std_mean']:9.1f}{'' if model is None else f'{1e3 * model:.1f}':>9}"
            f"{' '.join(f'{h:.2f}' for h in r.get('prefetch_hidden_share', [])):>8}"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
