"""Several `moeflow train` runs in one spawned gloo group (tests/multirank.py), each on the path the
command's ranks take: the command's pre-flight (validation, cost-model checks, tokenizer, corpus), the
config's round trip to the ranks, the cost model provided collectively, then `training.loop.run`,
which writes the run folder (config.toml, metrics.jsonl, checkpoints) as `moeflow train --nproc N`
does. What this leaves out is the launcher itself (torch's elastic agent): the tests that use this
keep a real `moeflow train --nproc N` launch of their own for that.

A spawn costs 5-15 s on a 2-core machine and a tiny run about a second, so a test file trains all
its configs in a body of the session's shared spawn (tests/multirank.py, `SharedSpawns`):

    def _train_mine(rank, world, tmp):
        train_all(rank, world, runs(tmp, {"ep": [...], "shadow": [...]}))

    @pytest.mark.spawned(body=_train_mine, world=2, folder=True)
    def test_...(shared_spawns):
        tmp = shared_spawns.run(_train_mine, 2)   # tmp/ep, tmp/shadow: run folders; summary(tmp / "ep")
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist


def _as_launched(rank: int, world: int) -> None:
    """The environment torch's elastic launcher gives each rank (one node of `world` ranks)."""
    for key, value in dict(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world, LOCAL_WORLD_SIZE=world).items():
        os.environ[key] = str(value)


def train_all(rank: int, world: int, runs: list[tuple[str, list[str], dict[str, str]]]) -> None:
    """On every rank: train each run (its folder, its `--set` overrides with `train.steps` and
    `moe.cost_model` among them, environment variables for it alone) from scratch, in turn."""
    from moeflow.training.config_files import config_from_dict, config_to_dict, load_config
    from moeflow.training.cost_model_setup import provide_cost_model
    from moeflow.training.entry import preflight, quiet_notices
    from moeflow.training.loop import run

    _as_launched(rank, world)
    quiet_notices()
    device = torch.device("cpu")
    for out_dir, overrides, env in runs:
        out = Path(out_dir)
        cfg = load_config(None, overrides)
        corpus = preflight(cfg, out, False, world, in_process=True)  # every rank: the same corpus
        dist.barrier()  # every rank checked the folder before rank 0 writes to it
        cfg = config_from_dict(config_to_dict(cfg))  # what the launcher hands each rank
        os.environ.update(env)
        try:
            provide_cost_model(cfg, out, device, say=rank == 0)
            summary = run(cfg, out, resume=False, device=device, corpus=corpus)
        finally:
            for key in env:
                del os.environ[key]
        assert "error" not in summary, (out_dir, summary)
        if rank == 0:  # what `moeflow train --json` prints
            _summary_file(out).write_text(json.dumps(summary))


def _summary_file(out: Path) -> Path:
    return out.parent / f"{out.name}.summary.json"


def runs(tmp: str | Path, configs: dict[str, list[str]], env: dict[str, dict[str, str]] | None = None) -> list:
    """`train_all`'s runs: folder `tmp/<name>` for each named config; `env`: by name."""
    return [(str(Path(tmp) / name), list(sets), dict((env or {}).get(name, {}))) for name, sets in configs.items()]


def summary(run: Path) -> dict:
    """The summary of a run `train_all` trained."""
    return json.loads(_summary_file(run).read_text())
