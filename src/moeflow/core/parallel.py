"""The parallel layout: one object validates the degrees once, builds the process groups once and
hands them down explicitly (torchtitan's `ParallelDims` style; `None` = off).

Ranks form a DP × EP × ESP grid: `world = dp_size · ep_size · esp_size` (ESP, expert sharding,
FSMoE §3: `esp_size` consecutive ranks hold the same experts, each a hidden slice; see
`core.expert_sharding`; with `esp_size=1` the grid is DP × EP). Expert-parallel groups are blocks of
consecutive ranks (`[i·ep, (i+1)·ep)`), so an EP group stays inside a node when ranks are numbered
node by node; the expert data-parallel group of a rank is the ranks with the same EP rank (the
replicas of the same experts). Dense parameters are averaged over the whole world; expert
parameters only over their replicas — never across EP ranks, whose experts differ.

    layout = ParallelLayout(ep_size=4)          # after dist.init_process_group
    model = parallelize(model, layout)          # moeflow.training.model
    loss.backward(); all_reduce_gradients(model, layout); opt.step()   # moeflow.model_step
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from moeflow.core.checks import positive_int
from moeflow.core.experts import GroupedExperts


@dataclass
class ParallelLayout:
    """Validated DP × EP × ESP layout and its process groups (built once, in `__post_init__`)."""

    ep_size: int = 1
    """Ranks in one expert-parallel group; experts of a layer are split across them."""
    esp_size: int = 1
    """Ranks in one expert-sharding group (FSMoE §3, `core.expert_sharding`): consecutive ranks (a
    node's devices) holding the same experts, each a slice of their hidden dimension."""
    node_size: int | None = None
    """Devices per node when known; `esp_size` must divide it."""
    d_hidden: int | None = None
    """The experts' hidden size when known; `esp_size` must divide it."""
    world_size: int | None = None
    """Total ranks; defaults to `dist.get_world_size()` (1 when torch.distributed is not initialized)."""
    rank: int | None = None
    """This rank; defaults to `dist.get_rank()` (0 when not initialized)."""
    ep_group: dist.ProcessGroup | None = field(default=None, init=False, repr=False)
    expert_dp_group: dist.ProcessGroup | None = field(default=None, init=False, repr=False)
    esp_group: dist.ProcessGroup | None = field(default=None, init=False, repr=False)
    balance_group: dist.ProcessGroup | None = field(default=None, init=False, repr=False)
    """The ranks holding the same experts (expert-DP × ESP): balance state is summed over them."""

    def __post_init__(self) -> None:
        initialized = dist.is_available() and dist.is_initialized()
        if self.world_size is None:
            self.world_size = dist.get_world_size() if initialized else 1
        if self.rank is None:
            self.rank = dist.get_rank() if initialized else 0
        for name in ("ep_size", "esp_size", "world_size"):
            try:
                positive_int(name, getattr(self, name))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"ParallelLayout: {exc}") from None
        if self.world_size % (self.ep_size * self.esp_size):
            raise ValueError(
                f"ParallelLayout: world_size={self.world_size} is not divisible by "
                f"ep_size={self.ep_size} · esp_size={self.esp_size}"
            )
        if self.node_size is not None and self.node_size % self.esp_size:
            raise ValueError(f"ParallelLayout: esp_size={self.esp_size} must divide the node size {self.node_size}")
        if self.d_hidden is not None and self.d_hidden % self.esp_size:
            raise ValueError(f"ParallelLayout: esp_size={self.esp_size} must divide d_hidden={self.d_hidden}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"ParallelLayout: rank={self.rank} outside [0, world_size={self.world_size})")
        if self.world_size > 1 and not initialized:
            raise ValueError(f"ParallelLayout: world_size={self.world_size} needs torch.distributed to be initialized")
        if initialized and self.world_size > 1:
            self._build_groups()

    def _build_groups(self) -> None:
        # Every rank must create every group, in the same order (torch.distributed.new_group rule).
        # rank = ((dp_rank · ep_size) + ep_rank) · esp_size + esp_rank; with esp_size 1 as before.
        ep, esp, replica = self.ep_size, self.esp_size, self.ep_size * self.esp_size
        for block in range(self.dp_size):
            for s in range(esp):
                ranks = [block * replica + e * esp + s for e in range(ep)]
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    self.ep_group = group if ep > 1 else None
        for e in range(ep):
            for s in range(esp):
                ranks = [d * replica + e * esp + s for d in range(self.dp_size)]
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    self.expert_dp_group = group if self.dp_size > 1 else None
        if esp > 1:
            for g in range(self.world_size // esp):
                ranks = list(range(g * esp, (g + 1) * esp))
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    self.esp_group = group
            for e in range(ep):
                ranks = [d * replica + e * esp + s for d in range(self.dp_size) for s in range(esp)]
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    self.balance_group = group
        else:
            self.balance_group = self.expert_dp_group

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.ep_size * self.esp_size)

    @property
    def esp_rank(self) -> int:
        return self.rank % self.esp_size

    @property
    def ep_rank(self) -> int:
        return (self.rank // self.esp_size) % self.ep_size

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.ep_size * self.esp_size)

    def validate_experts(self, num_experts: int) -> None:
        """Each EP rank must own the same number of experts."""
        if num_experts < self.ep_size or num_experts % self.ep_size:
            raise ValueError(
                f"num_experts={num_experts} must be a positive multiple of ep_size={self.ep_size} "
                f"(world_size={self.world_size})"
            )


def _expert_param_ids(model: nn.Module) -> set[int]:
    return {id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}


def expert_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """(name, parameter) of the experts: sharded across EP ranks, never averaged across them."""
    ids = _expert_param_ids(model)
    return ((n, p) for n, p in model.named_parameters() if id(p) in ids)


def dense_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """(name, parameter) of everything else: replicated on every rank."""
    ids = _expert_param_ids(model)
    return ((n, p) for n, p in model.named_parameters() if id(p) not in ids)


def _all_reduce_mean(params: list[nn.Parameter], group, world_size: int) -> None:
    """Sum each dtype's gradients in one flat bucket over `group`, divide by the global world size."""
    grads = [p.grad for p in params if p.grad is not None]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for bucket in by_dtype.values():
        flat = _flatten_dense_tensors(bucket)
        if group is not None or world_size > 1:
            dist.all_reduce(flat, group=group)
        flat.div_(world_size)
        for g, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            g.copy_(synced)
