"""Hecate's FSSDP on the network testbed: EP, FasterMoE shadowing, Pro-Prophet with its prefetch, the
EPLB baseline and `fssdp` (without and with the block-wise prefetch, and re-materializing), side by side (Williams
order), on Zipf skews and on the SmartMoE trace replayed iteration by iteration; iteration time and
the expert memory of every rank, counted from the tensors.

    sudo .venv/bin/python benchmarks/hecate_testbed.py --out results/hecate-testbed.json

Each timed model is four blocks (MoE layer + dense residual part; `moeflow bench --blocks 4`): a
layer's copies can be prefetched during the block before it, and re-materialization keeps one
layer's copies at a time instead of four. `fssdp` re-shards every 6 iterations (Algorithm 2; a run
uses 100 optimizer steps) so the timed iterations include re-sharded layouts; each re-sharding's
experts moved and time are in the rows (`reshards`, outside the timed iterations, parameters only:
the benchmark has no optimizer state to move). Memory per rank: the owned experts' parameters,
the AdamW state they carry (2x, counted), and the materialized held weights (built, and still
allocated at the forward/backward boundary).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from testbed_run import bench_on_testbed  # noqa: E402

VARIANTS = [
    "ep:sync",
    "shadow:sync",
    "prophet:sync+prefetch",
    "eplb:sync",
    "fssdp/reshard_interval=6:sync",
    "fssdp/reshard_interval=6:sync+prefetch",
    "fssdp/reshard_interval=6/rematerialize=true:sync+prefetch",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/hecate-testbed.json")
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--bandwidth-mbit", type=float, default=800.0)
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--skews", type=float, nargs="+", default=[0.0, 2.0])
    parser.add_argument("--profile", default=None, help="default: results/profile-testbed[-2x1].json")
    parser.add_argument("--ceiling", action="store_true", help="also plain EP on perfectly even routing")
    parser.add_argument("--variants", nargs="+", default=VARIANTS, help="`moeflow bench` variants")
    args = parser.parse_args()
    result = bench_on_testbed(__file__, args, 4, args.variants, ("--ceiling",) if args.ceiling else ())
    mib = 2.0**20
    print(
        f"{'routing':<18}{'variant':<46}{'ms':>8}{'vs EP':>7}{'copies':>7}{'model ms':>9}"
        f"{'params':>8}{'adam':>7}{'held':>7}{'peak':>7} MiB  reshards (moved, ms)"
    )
    for r in result["rows"]:
        strategy = "/".join([r["strategy"], *(f"{k}={v}" for k, v in r["options"])])
        variant = f"{strategy}:{r['schedule']}" + ("+prefetch" if r["prefetch"] else "")
        variant += " (even routing)" if r.get("ceiling") else ""
        model = r["model_predicted_s"]
        reshards = " ".join(f"({x['moved']}, {1e3 * x['seconds']:.0f})" for x in r["reshards"])
        print(
            f"{r['routing']:<18}{variant:<46}{1e3 * r['median_s']:8.1f}{r['speedup_vs_ep']:7.2f}"
            f"{r['copies_mean']:7.1f}{'' if model is None else f'{1e3 * model:.1f}':>9}"
            f"{r['expert_param_bytes'] / mib:8.1f}{r['expert_adam_bytes'] / mib:7.1f}"
            f"{r['materialized_bytes'] / mib:7.1f}{r['materialized_peak_bytes'] / mib:7.1f}      {reshards}"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
