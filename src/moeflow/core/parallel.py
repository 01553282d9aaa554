"""The parallel layout: ONE `torch.distributed.device_mesh.DeviceMesh` of named dimensions, validated
once, from which every process group a component uses is taken (torchtitan's `ParallelDims` style;
`None` = that dimension has size 1).

    world = dp · ep · esp        mesh = init_device_mesh(device, (dp, ep, esp), ("dp", "ep", "esp"))

- `ep`: expert parallelism — the experts of a layer are split over `ep_size` ranks, tokens travel
  between them (the all-to-all). An EP group is `ep_size` ranks with the same dp and esp index.
- `esp`: expert sharding (FSMoE §3, `core.expert_sharding`) — `esp_size` consecutive ranks (a node's
  devices) hold the same experts, each a slice of their hidden dimension.
- `dp`: data parallelism — `dp_size` replicas of each (ep, esp) position: the same experts, other
  tokens. The ranks of a dp group hold the same expert slices ("expert data parallelism").

Row-major numbering, rank = ((dp_rank · ep) + ep_rank) · esp + esp_rank: an ESP group is consecutive
ranks (inside a node when ranks are numbered node by node), an EP group a block of `ep·esp` ranks.

What is sharded where (`dense`, `experts`; docs/parallel.md):

- `dense="replicate"`: dense parameters (attention, norms, embeddings, routers) on every rank,
  gradients averaged over the world after backward (`model_step.all_reduce_gradients`).
  `dense="fsdp"`: FSDP2 `fully_shard` per transformer block over all ranks (`dense_mesh`): each rank
  keeps 1/world of them and of their gradients and AdamW state; gathered per block for its forward
  and backward, gradients reduce-scattered (mean over the world, the same value).
- `experts="replicate"`: each rank keeps its EP rank's experts whole; replicas' gradients are summed
  over the dp group. `experts="fsdp"`: the experts of an EP rank are sharded over its dp group
  (`expert_mesh`, FSDP2 on the MoE layer: gathered for the layer's forward and backward,
  gradients reduce-scattered over dp). It needs `dp_size > 1`.

    layout = ParallelLayout(ep_size=2, dense="fsdp", experts="fsdp")   # after dist.init_process_group
    model = parallelize(model, layout)        # moeflow.training.model (meta-device build: docs/parallel.md)
    loss.backward(); all_reduce_gradients(model, layout); opt.step()   # moeflow.model_step
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor

from moeflow.core.checks import positive_int
from moeflow.core.experts import GroupedExperts

MODES = ("replicate", "fsdp")
"""Values of `dense` and `experts`."""


@dataclass
class ParallelLayout:
    """Validated DP × EP × ESP layout: its mesh and its process groups (built once, in `__post_init__`)."""

    ep_size: int | None = None
    """Ranks in one expert-parallel group; experts of a layer are split across them. None: every
    rank, divided by `esp_size` (no data-parallel replicas of the experts)."""
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
    dense: str = "replicate"
    """`replicate` (all-reduced after backward) or `fsdp` (FSDP2 per block over all ranks)."""
    experts: str = "replicate"
    """`replicate` (whole on every dp replica, summed over dp) or `fsdp` (sharded over the dp group)."""
    device_type: str | None = None
    """The mesh's device type; None: `cuda` under nccl, else `cpu`."""
    mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    """The (dp, ep, esp) mesh; None on one process without torch.distributed."""
    ep_group: dist.ProcessGroup | None = field(default=None, init=False, repr=False)
    expert_dp_group: dist.ProcessGroup | None = field(default=None, init=False, repr=False)
    """The dp group: the ranks holding the same expert slices (replicas)."""
    esp_group: dist.ProcessGroup | None = field(default=None, init=False, repr=False)
    balance_group: dist.ProcessGroup | None = field(default=None, init=False, repr=False)
    """The ranks holding the same experts (dp × esp): balance state is summed over them."""

    def __post_init__(self) -> None:
        initialized = dist.is_available() and dist.is_initialized()
        if self.world_size is None:
            self.world_size = dist.get_world_size() if initialized else 1
        if self.rank is None:
            self.rank = dist.get_rank() if initialized else 0
        for name in ("esp_size", "world_size"):
            self._positive(name)
        if self.ep_size is None:
            self.ep_size = max(1, self.world_size // self.esp_size)
        self._positive("ep_size")
        for name in ("dense", "experts"):
            if getattr(self, name) not in MODES:
                raise ValueError(f"ParallelLayout: {name}={getattr(self, name)!r} must be one of {', '.join(MODES)}")
        if self.world_size % (self.ep_size * self.esp_size):
            raise ValueError(
                f"ParallelLayout: ep_size={self.ep_size} · esp_size={self.esp_size} does not divide "
                f"world_size={self.world_size}"
            )
        if self.node_size is not None and self.esp_size > self.node_size:
            raise ValueError(
                f"ParallelLayout: esp_size={self.esp_size} is larger than a node of {self.node_size} ranks "
                f"(an expert-sharding group all-gathers every dispatched row: it stays inside a node)"
            )
        if self.node_size is not None and self.node_size % self.esp_size:
            raise ValueError(f"ParallelLayout: esp_size={self.esp_size} must divide the node size {self.node_size}")
        if self.d_hidden is not None and self.d_hidden % self.esp_size:
            raise ValueError(f"ParallelLayout: esp_size={self.esp_size} must divide d_hidden={self.d_hidden}")
        if self.experts == "fsdp" and self.dp_size == 1:
            raise ValueError(
                f"ParallelLayout: experts='fsdp' with dp_size=1 (world_size={self.world_size} / ep_size="
                f"{self.ep_size} / esp_size={self.esp_size}): no replicas to shard the experts over"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"ParallelLayout: rank={self.rank} outside [0, world_size={self.world_size})")
        if self.world_size > 1 and not initialized:
            raise ValueError(f"ParallelLayout: world_size={self.world_size} needs torch.distributed to be initialized")
        if self.dense == "fsdp" and not initialized:
            raise ValueError("ParallelLayout: dense='fsdp' needs torch.distributed initialized (one rank will do)")
        if initialized:
            self._build_mesh()

    def _positive(self, name: str) -> None:
        try:
            positive_int(name, getattr(self, name))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"ParallelLayout: {exc}") from None

    def _build_mesh(self) -> None:
        # Every rank builds the same mesh, in the same order (its groups are created collectively).
        if self.device_type is None:
            self.device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        shape = (self.dp_size, self.ep_size, self.esp_size)
        self.mesh = init_device_mesh(self.device_type, shape, mesh_dim_names=("dp", "ep", "esp"))
        self._flat: dict[str, DeviceMesh] = {}
        self.ep_group = self.mesh.get_group("ep") if self.ep_size > 1 else None
        self.expert_dp_group = self.mesh.get_group("dp") if self.dp_size > 1 else None
        self.esp_group = self.mesh.get_group("esp") if self.esp_size > 1 else None
        if self.esp_size > 1 and self.dp_size > 1:
            self.balance_group = self._flatten("dp", "esp").get_group()
        else:
            self.balance_group = self.esp_group if self.esp_size > 1 else self.expert_dp_group

    def _flatten(self, *dims: str) -> DeviceMesh:
        """The mesh of `dims` as one dimension (created once, collectively, on first use)."""
        name = "_".join(dims)
        if name not in self._flat:
            self._flat[name] = self.mesh[dims]._flatten(name)
        return self._flat[name]

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

    @property
    def dense_mesh(self) -> DeviceMesh:
        """All ranks, one dimension: where `dense="fsdp"` shards the dense parameters."""
        return self._flatten("dp", "ep", "esp")

    @property
    def expert_mesh(self) -> DeviceMesh:
        """The dp dimension: where `experts="fsdp"` shards an EP rank's experts (the replicas)."""
        return self.mesh["dp"]

    def owner_group(self) -> dist.ProcessGroup | None:
        """Hecate's FSSDP with `experts="fsdp"` (docs/parallel.md): experts sharded over the whole
        dp × ep mesh, one owner each — the expert-parallel group of such a layer. Collective on
        first use."""
        if self.dp_size * self.ep_size == 1:
            return None
        if self.dp_size == 1:
            return self.ep_group
        if self.ep_size == 1:
            return self.expert_dp_group
        return self._flatten("dp", "ep").get_group()

    def validate_experts(self, num_experts: int, owner_ranks: int | None = None) -> None:
        """Each EP rank must own the same number of experts (`owner_ranks`: the ranks that split
        them, when not `ep_size`)."""
        ranks = self.ep_size if owner_ranks is None else owner_ranks
        if num_experts < ranks or num_experts % ranks:
            what = f"ep_size={self.ep_size}" if owner_ranks is None else f"the {ranks} ranks that own them"
            raise ValueError(
                f"num_experts={num_experts} must be a positive multiple of {what} (world_size={self.world_size})"
            )

    def describe(self) -> str:
        return (
            f"dp {self.dp_size} × ep {self.ep_size} × esp {self.esp_size} (dense={self.dense}, experts={self.experts})"
        )


def local_rows(param: torch.Tensor) -> list[int]:
    """Rows of dim 0 of `param`'s global tensor that this rank holds: all of them for a plain
    tensor, this rank's chunk for an FSDP2 shard (a DTensor sharded on dim 0)."""
    if not isinstance(param, DTensor):
        return list(range(param.shape[0]))
    index = torch.arange(param.shape[0], device=param.to_local().device)
    return distribute_tensor(index, param.device_mesh, param.placements, src_data_rank=None).to_local().tolist()


def _expert_param_ids(model: nn.Module) -> set[int]:
    return {id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}


def expert_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """(name, parameter) of the experts: sharded across EP ranks, never averaged across them."""
    ids = _expert_param_ids(model)
    return ((n, p) for n, p in model.named_parameters() if id(p) in ids)


def dense_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """(name, parameter) of everything else: replicated on every rank, or FSDP-sharded."""
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
