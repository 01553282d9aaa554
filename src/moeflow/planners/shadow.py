"""FasterMoE dynamic shadowing (PPoPP'22 §4.1, Algorithm 1; SPEC.md §1.2).

Every iteration and layer, from the global flow matrix that the count exchange already gave every
rank, pick experts to replicate on *all* ranks: their parameters travel (owner → every rank in
forward, gradients back to the owner in backward) instead of their tokens.

Cost of a shadow set S, priced by the shared `CostModel` (so profiled constants are used when
present):

    T(S) = 3 · max_w comp(B'_w)  +  4 · a2a(tokens still sent)  +  copy(S)

- `3 · comp` and `4 · a2a`: FasterMoE Eq. 7 (forward + 2× backward compute; dispatch and combine
  in forward and backward), with B'_w the tokens rank w computes once S is shadowed.
- `copy(S)`: Eq. 8's parameter term `2·r·(2αH²)/W_net`: a broadcast of the shadowed parameters in
  forward and a reduce of their gradients in backward, one of each per owner, as the sparse
  collectives run them (`CostModel.copies_time`: pipelined ring, each link carries them once).
- Eq. 8 as printed drops the token all-to-all altogether, which would make shadowing look free
  under a uniform load; the public FastMoE policy keeps the token term at the new maximum load, as
  we do here. Eq. 9 / 10 are this comparison solved for one expert.

Greedy (Algorithm 1, generalised as SPEC §1.2 says): walk *experts* in descending received load —
the column sums of the flow, i.e. tokens received from all senders (summing rows instead, as the
public FastMoE v1 code did, gives per-sender counts that are equal under equal batches, so nothing
is ever shadowed) — accept while the predicted time drops, stop at the first that does not help.

Shape suffixes: W ranks, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeflow.placement import Placement


def expert_param_count(d_model: int, d_hidden: int, expert: str) -> int:
    """Parameters of one expert: ffn = w1, b1, w2, b2; swiglu = w1, w3, w2."""
    if expert == "ffn":
        return 2 * d_model * d_hidden + d_hidden + d_model
    if expert == "swiglu":
        return 3 * d_model * d_hidden
    raise ValueError(f"unknown expert={expert!r}; valid: ['ffn', 'swiglu']")


@dataclass
class ShadowDecision:
    """What the greedy saw: the chosen experts and the predicted time of each accepted prefix."""

    shadowed: list[int]
    predicted_s: list[float]
    """predicted_s[0] = no shadowing; predicted_s[i] = after the i-th accepted expert."""


class ShadowPlanner:
    """`strategy="shadow"`: a pure function of (flow, owners, cost model) → Placement."""

    needs_cost_model = True

    def __init__(self, d_model: int, d_hidden: int, expert: str = "ffn", max_shadowed: int | None = None):
        self.d_model, self.d_hidden, self.expert = d_model, d_hidden, expert
        self.param_count = expert_param_count(d_model, d_hidden, expert)
        if max_shadowed is not None and max_shadowed < 0:
            raise ValueError(f"max_shadowed={max_shadowed} must be >= 0 or None")
        self.max_shadowed = max_shadowed
        self.last: ShadowDecision | None = None
        self._copies_memo: dict[tuple, float] = {}

    def __call__(self, flow_WE: np.ndarray, placement: Placement, cost_model=None) -> Placement:
        if cost_model is None:
            raise ValueError("strategy='shadow' needs cost_model= (a moeflow.perf.costmodel.CostModel)")
        self.last = self.decide(np.asarray(flow_WE, dtype=np.float64), placement, cost_model)
        extra = np.zeros_like(placement.holders_EW)
        extra[self.last.shadowed] = True
        return Placement.owners_only(placement.owner_E, placement.world_size).with_holders(extra)

    def cost(self, flow_WE, owner_E, shadowed_E, cost_model) -> float:
        """T(S) for a boolean shadow mask (see the module docstring); used by `decide` and tests."""
        world = flow_WE.shape[0]
        owner_onehot_EW = np.eye(world, dtype=bool)[owner_E]
        # Tokens for a shadowed expert stay on their source; the rest go to the owner.
        to_owner_WE = np.where(shadowed_E[None, :], 0.0, flow_WE)
        received_E = to_owner_WE.sum(0)  # tokens each expert's owner receives from all senders
        computed_W = received_E @ owner_onehot_EW + np.where(shadowed_E[None, :], flow_WE, 0.0).sum(1)
        sent_WW = to_owner_WE @ owner_onehot_EW.astype(np.float64)
        np.fill_diagonal(sent_WW, 0.0)
        token_bytes = self.d_model * cost_model.bytes_per_element
        param_bytes = self.param_count * cost_model.bytes_per_element
        comp = cost_model.layer_compute_time(computed_W, self.d_model, self.d_hidden, self.expert)
        comm = cost_model.a2a_time(sent_WW * token_bytes)
        return float(3 * comp + 4 * comm + self._copies(owner_E, shadowed_E, owner_onehot_EW, param_bytes, cost_model))

    def _copies(self, owner_E, shadowed_E, owner_onehot_EW, param_bytes, cost_model) -> float:
        """Parameters out in forward, gradients back in backward, as the sparse collectives run
        them. It depends only on how many experts each owner shadows: memoised per cost model."""
        key = (
            id(cost_model),
            param_bytes,
            np.bincount(owner_E[shadowed_E], minlength=len(owner_onehot_EW[0])).tobytes(),
        )
        if key not in self._copies_memo:
            holders_EW = owner_onehot_EW | shadowed_E[:, None]
            self._copies_memo[key] = cost_model.copies_time(
                param_bytes, holders_EW, owner_E, "materialize"
            ) + cost_model.copies_time(param_bytes, holders_EW, owner_E, "reduce")
        return self._copies_memo[key]

    def decide(self, flow_WE: np.ndarray, placement: Placement, cost_model) -> ShadowDecision:
        owner_E = placement.owner_E
        if cost_model.topology.num_devices != placement.world_size:
            raise ValueError(
                f"cost model has {cost_model.topology.num_devices} devices, the expert-parallel group "
                f"{placement.world_size}"
            )
        received_E = flow_WE.sum(0)  # column sums: tokens each expert receives from all senders
        shadowed = np.zeros(flow_WE.shape[1], dtype=bool)
        best = self.cost(flow_WE, owner_E, shadowed, cost_model)
        decision = ShadowDecision([], [best])
        limit = flow_WE.shape[1] if self.max_shadowed is None else self.max_shadowed
        for e in np.argsort(-received_E, kind="stable")[:limit]:
            if received_E[e] == 0:
                break
            shadowed[e] = True
            cost = self.cost(flow_WE, owner_E, shadowed, cost_model)
            if cost >= best:
                break
            best = cost
            decision.shadowed.append(int(e))
            decision.predicted_s.append(cost)
        return decision
