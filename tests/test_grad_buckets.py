"""train.grad_sync: DDP buckets and FSMoE §5 partition buckets (docs/training.md) give the
gradients of the after-backward all-reduce; the bucket plans are partitions in backward order."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from moeflow.training.config import TrainConfig
from moeflow.training.grad_buckets import ddp_buckets, partition_buckets

from .multirank_train import runs, train_all
from .test_train import TINY


def _params(sizes):
    return [nn.Parameter(torch.zeros(n)) for n in sizes]


def test_ddp_buckets_are_an_ordered_partition_within_the_size():
    params = _params([100, 200, 50, 300, 10])
    buckets = ddp_buckets(params, 1200 / 2**20)  # 1200 bytes = 300 fp32 elements
    assert [p for b in buckets for p in b] == params
    assert all(sum(p.numel() for p in b) * 4 <= 1200 for b in buckets)
    assert [len(b) for b in buckets] == [2, 1, 1, 1]


def test_partition_buckets_follow_the_element_counts_at_parameter_boundaries():
    params = _params([10] * 12)
    buckets = partition_buckets(params, [40, 0, 80])
    assert [p for b in buckets for p in b] == params
    assert [sum(p.numel() for p in b) for b in buckets] == [40, 80]


@pytest.mark.parametrize("key,value", [("grad_sync", "eager"), ("grad_bucket_mb", 0), ("grad_bucket_mb", -1.0)])
def test_bad_config_names_key_and_value(key, value):
    with pytest.raises(ValueError, match=f"train.{key}.*{value!r}"):
        TrainConfig(**{key: value})


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _train_grad_sync_runs(rank, world, tmp):
    """The three runs of `moeflow train --nproc N --steps 3 --cost-model fsmoe_a --set ...`."""
    common = [*TINY, "train.checkpoint_every=100", "train.eval_every=100"]
    modes = {
        "after": ["train.grad_sync=after_backward"],
        "ddp": ["train.grad_sync=ddp", "train.grad_bucket_mb=0.01"],
        "fsmoe": ["train.grad_sync=fsmoe", "train.grad_bucket_mb=0.01"],
    }
    configs = {m: [*common, *sets, "train.steps=3", "moe.cost_model=fsmoe_a"] for m, sets in modes.items()}
    train_all(rank, world, runs(tmp, configs))


@pytest.mark.multirank
@pytest.mark.spawned(body=_train_grad_sync_runs, folder=True)
@pytest.mark.parametrize("world", [2, 4])
def test_bucketed_sync_trains_as_after_backward(world, shared_spawns):
    tmp = shared_spawns.run(_train_grad_sync_runs, world)  # in the session's spawn of `world` ranks
    base = _metrics(tmp / "after")
    assert [a["step"] for a in base] == [1, 2, 3]
    for mode in ("ddp", "fsmoe"):
        got = _metrics(tmp / mode)
        for a, b in zip(base, got, strict=True):
            for key in ("loss", "grad_norm", "val_loss"):
                assert (a.get(key) is None) == (b.get(key) is None), (mode, key)
                if a.get(key) is not None:
                    assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-7), (mode, a["step"], key)
