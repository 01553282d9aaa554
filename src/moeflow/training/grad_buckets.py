"""Dense gradient all-reduce overlapped with the backward: DDP-style buckets, or the buckets of
FSMoE's adaptive gradient partitioning (FSMoE §5, ``moeflow.perf.grad_partition``).

The dense parameters are taken in backward order (reverse of registration order, which is the
model's layer order) and cut into buckets. Each bucket's ``dist.all_reduce(async_op=True)`` is
launched from ``register_post_accumulate_grad_hook`` once every gradient it holds exists (asserted);
``finish`` waits all handles, unflattens, divides by the world size, then hands expert gradients and
MoE balance state to ``model_step.all_reduce_gradients(dense=False)``, so the final gradients are
those of ``all_reduce_gradients``.

Deviations, recorded:
* FSMoE §5 partitions gradient *elements*; here a bucket holds whole parameters: the cut between
  two buckets is the parameter boundary nearest the partition's cumulative element count.
* A bucket launches when its last gradient is accumulated (the point the partition assigns it in
  backward order), not from a hook inside the MoE layer's pipelined backward.
* The partition's ``others_ms`` (dense backward time of a generalized layer) is taken as 0: the
  dense part hides nothing, every element is placed by the MoE layers' overlappable time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from moeflow.core.parallel import ParallelLayout, dense_parameters
from moeflow.model_step import all_reduce_gradients


def backward_order(model: nn.Module) -> list[nn.Parameter]:
    """Dense parameters in the order autograd produces their gradients (reverse layer order)."""
    return [p for _, p in dense_parameters(model) if p.requires_grad][::-1]


def ddp_buckets(params: list[nn.Parameter], bucket_mb: float) -> list[list[nn.Parameter]]:
    """Consecutive parameters, each bucket at most ``bucket_mb`` MB (a larger parameter alone)."""
    if not (bucket_mb > 0):
        raise ValueError(f"train.grad_bucket_mb must be > 0, got {bucket_mb!r}")
    limit = bucket_mb * 1024 * 1024
    buckets: list[list[nn.Parameter]] = []
    size = 0.0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if not buckets or size + nbytes > limit:
            buckets.append([])
            size = 0.0
        buckets[-1].append(p)
        size += nbytes
    return buckets


def partition_buckets(params: list[nn.Parameter], layer_elements: list[int]) -> list[list[nn.Parameter]]:
    """Cut ``params`` (backward order) into buckets of ``layer_elements`` (backward order, scaled
    to the parameters' total), at the nearest parameter boundary; empty buckets are dropped."""
    total = sum(p.numel() for p in params)
    want = sum(layer_elements)
    if want <= 0:
        raise ValueError(f"layer_elements={layer_elements!r} must sum to > 0")
    targets, acc = [], 0
    for n in layer_elements:
        acc += n
        targets.append(round(acc * total / want))
    buckets: list[list[nn.Parameter]] = [[] for _ in layer_elements]
    done, k = 0, 0
    for p in params:
        # the bucket whose target is nearest this parameter's middle
        while k < len(targets) - 1 and done + p.numel() / 2 > targets[k]:
            k += 1
        buckets[k].append(p)
        done += p.numel()
    return [b for b in buckets if b]


def solve_partition(model: nn.Module, cfg, cost_model, local_batch: int):
    """The FSMoE §5 partition of this run, solved once (workload built as ``moeflow tune``'s)."""
    from moeflow.perf.grad_partition import partition_gradients
    from moeflow.perf.pipeline_inputs import PipelineFits, PipelineWorkload

    if cost_model is None:
        raise ValueError("train.grad_sync='fsmoe' needs a cost model: set moe.cost_model")
    layers = max(1, len(list(model.moe_layers())))
    dense = sum(p.numel() for p in backward_order(model))
    workload = PipelineWorkload(
        local_batch,
        cfg.model.seq_len,
        cfg.model.d_model,
        cfg.moe.d_hidden,
        2 if cfg.moe.expert == "ffn" else 3,
        float(cfg.moe.top_k * (cfg.moe.capacity_factor or 1.0)),
        1,
        layers,
        0.0,
        max(1, dense // layers),
    )
    return partition_gradients(workload, PipelineFits.from_cost_model(cost_model, workload))


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    ready: int = 0
    handles: list = field(default_factory=list)
    flats: list = field(default_factory=list)
    groups: list = field(default_factory=list)


class GradBuckets:
    """Backward hooks launching each bucket's asynchronous all-reduce; ``finish`` after backward."""

    def __init__(self, model: nn.Module, layout: ParallelLayout, buckets: list[list[nn.Parameter]]):
        self.model, self.layout = model, layout
        self.buckets = [_Bucket(b) for b in buckets]
        self.armed = False
        self.waited_s = 0.0
        self._hooks = []
        for bucket in self.buckets:
            for p in bucket.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._ready_hook(bucket)))

    @property
    def bucket_bytes(self) -> list[int]:
        return [sum(p.numel() * p.element_size() for p in b.params) for b in self.buckets]

    def _ready_hook(self, bucket: _Bucket):
        def hook(_p: torch.Tensor) -> None:
            if not self.armed:
                return
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                assert all(p.grad is not None for p in bucket.params), "bucket launched before its gradients"
                self._launch(bucket)

        return hook

    def _launch(self, bucket: _Bucket) -> None:
        grads = [p.grad for p in bucket.params if p.grad is not None]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for group in by_dtype.values():
            flat = _flatten_dense_tensors(group)
            bucket.flats.append(flat)
            bucket.groups.append(group)
            bucket.handles.append(dist.all_reduce(flat, async_op=True) if self.layout.world_size > 1 else None)
        bucket.ready = -1  # launched

    def arm(self) -> None:
        """Call before the backward whose gradients are to be synchronized (the last micro-batch)."""
        for b in self.buckets:
            b.ready, b.handles, b.flats, b.groups = 0, [], [], []
        self.armed = True

    def finish(self) -> None:
        """Wait all outstanding reduces (timed), write back averaged gradients, then experts/balance."""
        self.armed = False
        for b in self.buckets:
            if b.ready != -1:  # some gradient never arrived (unused parameter): launch what exists
                self._launch(b)
        t0 = time.perf_counter()
        for b in self.buckets:
            for h in b.handles:
                if h is not None:
                    h.wait()
        self.waited_s = time.perf_counter() - t0
        for b in self.buckets:
            for flat, group in zip(b.flats, b.groups):
                flat.div_(self.layout.world_size)
                for g, synced in zip(group, _unflatten_dense_tensors(flat, group)):
                    g.copy_(synced)
            b.flats, b.groups, b.handles = [], [], []
        all_reduce_gradients(self.model, self.layout, dense=False)
