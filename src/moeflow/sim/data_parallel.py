"""The data-parallel dimension of `moeflow simulate`: experts replicated over dp groups, or sharded.

Hecate (§3 Eq. 2, §4.1) measures its baselines in the setting of expert parallelism inside each
expert-parallel (EP) group — typically a node — with one replica of the experts per group: every
replica runs the strategy on its own tokens, and the experts' gradients are all-reduced over the
replicas. FSSDP instead owns every expert once over all ranks and its sparse collectives (spAG /
spRS) replace that all-reduce. `MeshLayout` names the layout as training does (`parallel.ep_size`,
`parallel.experts`; `core.parallel.ParallelLayout`, docs/parallel.md), and this module prices what
moeflow runs on it:

- EP groups are consecutive blocks of `ep_size` ranks (`restricted_models`: the cost model on each
  group's ranks, `CostModel.restricted`); replica z holds the cluster's ranks z·W .. z·W + W − 1.
- `replicate`: a planner that reads the flow plans on the MEAN of the replicas' flows, in whole
  tokens as the layer rounds it (one ring
  all-reduce of a `[W, E]` float64 matrix over every dp group per layer, `flow_mean_time`), so every
  replica runs the same placement on its own rows; plain EP reads no flow and plans nothing.
  The all-reduce of the flow is a synchronisation point, so each layer waits for its slowest replica;
  plain EP's replicas meet only at the gradient all-reduce, so its iteration waits for the slowest
  replica (`slowest_replica`). Then the experts' gradients: each rank's E/W experts' parameter
  bytes, ring all-reduce over its dp group, all dp rings at once on the cluster's links (FasterMoE
  Eq. 2 link model, `ring_collectives_time`), once per layer.
- `fsdp`: `fssdp` owns each expert once over all ranks (the flattened dp × ep mesh,
  `ParallelLayout.owner_group`: the single-group replay of the whole cluster, no all-reduce); any
  other strategy runs as FSDP2 shards its experts over each dp group (`training.model.parallelize`,
  default `reshard_after_forward`): an all-gather of the layer's E/W experts before its forward, again
  before its backward, and a reduce-scatter of their gradients.

The gradient collectives are exposed, or with `overlap_allreduce` hidden as DDP hides them
(`hidden_behind_backward`): the collective of layer l starts when layer l's backward is done and
runs, after those of the layers behind it, during the rest of the backward (its own block's
attention backward and the blocks before it); what runs past the end of the backward is exposed. A
layer's MoE backward is taken as 2/3 of its MoE time (the simulator's expert backward: 2× the
forward's compute), the attention's as 2× `nonmoe_forward_s`. FSDP2's all-gathers stay exposed.

Shape suffixes: Z data-parallel replicas, I iterations, L layers, W ranks of one EP group
(`ep_size`; the cluster has Z·W), E experts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from moeflow.perf.costmodel import CostModel

EXPERT_LAYOUTS = ("replicate", "fsdp")
RING_SHARE = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n}
RING_SHARE["reduce_scatter"] = RING_SHARE["all_gather"]
RING_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1, "reduce_scatter": lambda n: n - 1}
BACKWARD_SHARE = 2.0 / 3.0
"""Share of a layer's time that is its backward (expert and dense compute: 2× the forward)."""


@dataclass(frozen=True)
class MeshLayout:
    """The ranks' layout the trace is replayed on (`simulate(..., layout=)`; module docstring)."""

    ep_size: int | None = None
    """Ranks of one expert-parallel group (`parallel.ep_size`); None: every rank (no replicas)."""
    experts: Literal["replicate", "fsdp"] = "replicate"
    """`parallel.experts`: each EP group holds the experts whole, or FSDP2 / FSSDP shards them."""
    overlap_allreduce: bool = False
    """Hide the experts' gradient collectives behind the backward as DDP does (module docstring)."""

    def __post_init__(self) -> None:
        if self.ep_size is not None and (
            isinstance(self.ep_size, bool) or not isinstance(self.ep_size, int) or self.ep_size < 1
        ):
            raise ValueError(f"ep_size={self.ep_size!r} (--ep-size): must be a positive integer")
        if self.experts not in EXPERT_LAYOUTS:
            raise ValueError(f"experts={self.experts!r} (--parallel-experts): expected one of {list(EXPERT_LAYOUTS)}")

    def group_size(self, world: int, num_experts: int) -> int:
        """The EP group's ranks on a cluster of `world` ranks, checked against the experts."""
        ep = world if self.ep_size is None else self.ep_size
        if world % ep:
            raise ValueError(f"ep_size={ep} (--ep-size): must divide the cluster's {world} ranks")
        if num_experts % ep:
            raise ValueError(f"ep_size={ep} (--ep-size): the {num_experts} experts must split evenly over it")
        return ep

    def whole_cluster(self, strategy: str, world: int, num_experts: int) -> bool:
        """Whether `strategy` runs as one group of every rank: no replicas, or FSSDP owning each expert
        once over the dp × ep mesh (`experts="fsdp"`)."""
        return self.group_size(world, num_experts) == world or (self.experts == "fsdp" and strategy == "fssdp")


def ep_groups(world: int, ep: int) -> list[list[int]]:
    """The EP groups: consecutive blocks of `ep` ranks (`core.parallel`)."""
    return [list(range(z * ep, (z + 1) * ep)) for z in range(world // ep)]


def dp_groups(world: int, ep: int) -> list[list[int]]:
    """The dp groups: the ranks with the same place in their EP group (r, r + ep, r + 2·ep, ...)."""
    return [list(range(r, world, ep)) for r in range(ep)]


def restricted_models(cost_model: CostModel, ep: int) -> list[CostModel]:
    """The cost model on each EP group's ranks (`CostModel.restricted`)."""
    return [cost_model.restricted(g) for g in ep_groups(cost_model.topology.num_devices, ep)]


def ring_collectives_time(cost_model: CostModel, kind: str, nbytes: float, groups: Sequence[Sequence[int]]) -> float:
    """One ring collective of a buffer of `nbytes` per rank in every group at once, on the cluster's
    links (FasterMoE Eq. 2): `2·(n−1)/n·S` (all-reduce) or `(n−1)/n·S` (all-gather, reduce-scatter)
    on every hop of every ring, the busiest link's time, plus the slowest hop's latency per ring step."""
    n = len(groups[0])
    if n == 1 or nbytes == 0:
        return 0.0
    topo = cost_model.topology
    flow_WW = np.zeros((topo.num_devices, topo.num_devices))
    hops = [(g[k], g[(k + 1) % n]) for g in groups for k in range(n)]
    for a, b in hops:
        flow_WW[a, b] += RING_SHARE[kind](n) * nbytes
    latency = max(float(topo.path_latency_WW[a, b]) for a, b in hops)
    return float(cost_model.link_time(flow_WW)) + RING_STEPS[kind](n) * latency


def flow_mean_time(cost_model: CostModel, ep: int, num_experts: int) -> float:
    """The all-reduce of every EP rank's `[W, E]` float64 flow over its dp group, per layer (the layer
    plans on the replicas' mean: `MoELayer._replicas_flow`)."""
    world = cost_model.topology.num_devices
    return ring_collectives_time(cost_model, "all_reduce", 8.0 * ep * num_experts, dp_groups(world, ep))


def expert_collectives_time(cost_model: CostModel, ep: int, expert_bytes: float, experts: str) -> dict[str, float]:
    """Per layer, seconds: `replicate`: {"grad": the gradient all-reduce}; `fsdp`: {"gather": FSDP2's
    two all-gathers, "grad": its reduce-scatter}; `expert_bytes` = the E/W experts of one EP rank."""
    world = cost_model.topology.num_devices
    groups = dp_groups(world, ep)
    if experts == "replicate":
        return {"gather": 0.0, "grad": ring_collectives_time(cost_model, "all_reduce", expert_bytes, groups)}
    return {
        "gather": 2 * ring_collectives_time(cost_model, "all_gather", expert_bytes, groups),
        "grad": ring_collectives_time(cost_model, "reduce_scatter", expert_bytes, groups),
    }


def hidden_behind_backward(layer_total_IL: np.ndarray, nonmoe_forward_s: float, grad_s: float) -> np.ndarray:
    """The exposed part `[I]` of one gradient collective of `grad_s` per layer, as DDP overlaps it:
    the layers' backwards run from the last; layer l's expert gradients are ready when its MoE
    backward ends (`BACKWARD_SHARE` of its MoE time), before its block's attention backward
    (2·`nonmoe_forward_s`); the collectives run one after another from then on, and what runs past
    the end of the whole backward is exposed."""
    moe_IL = np.asarray(layer_total_IL, dtype=np.float64) - 3.0 * nonmoe_forward_s
    I, L = moe_IL.shape
    ready = np.zeros(I)  # time since the backward began
    finish = np.zeros(I)
    for li in reversed(range(L)):
        ready = ready + BACKWARD_SHARE * moe_IL[:, li]
        finish = np.maximum(finish, ready) + grad_s
        ready = ready + 2.0 * nonmoe_forward_s
    return np.maximum(finish - ready, 0.0)


def slowest_replica(total_ZIL: np.ndarray, per_layer: bool) -> np.ndarray:
    """Which replica each (iteration, layer) waits for `[I, L]`: the slowest in each layer (replicas
    meet at every layer's flow all-reduce), or, `per_layer=False`, the one slowest over the whole
    iteration (they meet only at the gradient all-reduce)."""
    total_ZIL = np.asarray(total_ZIL)
    if per_layer:
        return total_ZIL.argmax(axis=0)
    return np.broadcast_to(total_ZIL.sum(-1).argmax(axis=0)[:, None], total_ZIL.shape[1:])


def replica_flows(flow_ILWE: np.ndarray, ep: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """The flow every replica plans on (the mean of theirs in whole tokens, as `MoELayer` hands it
    to its planner; the flow itself without replicas) and each replica's own rows `[I, L, W, E]`
    (replica z: the cluster's ranks z·W .. z·W + W − 1)."""
    I, L, world, E = flow_ILWE.shape
    if ep == world:
        return flow_ILWE, [flow_ILWE]
    flow_ILZWE = flow_ILWE.reshape(I, L, world // ep, ep, E)
    return np.rint(flow_ILZWE.mean(axis=2)), [flow_ILZWE[:, :, z] for z in range(world // ep)]
