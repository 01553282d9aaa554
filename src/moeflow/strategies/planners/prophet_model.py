"""Pro-Prophet's planner performance model (§IV-B Eq. 1-6, with the scheduler §V-C Eq. 8).

Two forms of one model, both priced by the shared `CostModel`:

- `prophet_layer_times`: Eq. 1-8 exactly as printed — one mean bandwidth B̄ for every pair of
  devices, Trans/Agg spread over all D devices (`s·(D−n)·size/(D·B̄)`). Used by the planner with
  `model="paper"` and as the reference the tests check by hand.
- `price_terms`: the same terms (four all-to-alls, 3× forward expert compute, Trans, Agg) with
  the functions the simulator and the other planners use, for many placements at once
  (`perf.placement_pricing`) — the all-to-all on the busiest link of the topology (Eq. 1 when every
  link has bandwidth B̄) and the copies as the sparse collectives run them (`CostModel.copies_time`:
  the owner's link carries each copy it sends, which Eq. 4's `/D` spreads over every device). The
  planner's default (`model="links"`).

`overlapped_copies` is Eq. 8's `T_PTrans + T_PAgg`: with the block-wise scheduler (§V, Algorithm 2)
Trans hides behind the forward expert and non-MoE compute of the block before, Agg behind their
backward (2×); the simulator prices a planner that plans ahead with the same function.

Shape suffixes: W devices, E experts, Z candidate placements; ``...`` = any leading batch dims.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from moeflow.core.expert_shape import ExpertShape
from moeflow.core.placement import Placement
from moeflow.perf.placement_pricing import PlacementPricer, PlacementTerms

MODELS = ("links", "paper")


@dataclass(frozen=True)
class Pricing:
    """How a placement's copies are priced (`price_placement`)."""

    overlap: bool = False
    """Copies hidden by the block-wise prefetch (Eq. 8), sent as it sends them (`copies_time(tree=False)`)."""
    nonmoe_forward_s: float = 0.0
    """T_FNEC of Eq. 8: forward time of the dense part of a block (backward: twice)."""
    hidden_share: float = 1.0
    """Share of Eq. 8's compute windows that hides copies (1: Eq. 8 as printed)."""
    experts_hide: bool = True
    """Eq. 8's windows hold the experts' compute too; False: the dense part alone (Hecate §3.2 hides
    its sparse collectives behind the attention only; `overlapped_copies`)."""
    model: Literal["links", "paper"] = "links"
    """`links`: the shared cost-model functions; `paper`: Eq. 1-8 as printed (mean bandwidth)."""


def overlapped_copies(
    trans_s: Any, agg_s: Any, fec_s: Any, nonmoe_forward_s: float, hidden_share: Any = 1.0, experts_hide: bool = True
) -> np.ndarray:
    """Eq. 8: ``max(0, T_Trans − T_FEC − T_FNEC) + max(0, T_Agg − T_BEC − T_BNEC)`` with
    ``T_BEC = 2·T_FEC`` (Eq. 3) and the non-MoE backward likewise twice its forward.

    ``hidden_share`` scales the compute windows: 1 is Eq. 8 as printed (communication costs the
    compute nothing, as with a GPU's copy engines); where transfers and compute share cores (gloo
    on CPUs) less of a window hides them, and `strategies.prefetch` measures how much.
    ``experts_hide=False``: the windows are the dense part alone (``T_FEC`` left out), as where the
    copies overlap the attention only (Hecate §3.2, `moeflow simulate --overlap-attention`)."""
    fec = np.asarray(fec_s, dtype=np.float64)
    if not experts_hide:
        fec = np.zeros_like(fec)
    h = np.asarray(hidden_share, dtype=np.float64)
    ptrans = np.maximum(0.0, np.asarray(trans_s, dtype=np.float64) - h * (fec + nonmoe_forward_s))
    pagg = np.maximum(0.0, np.asarray(agg_s, dtype=np.float64) - h * 2 * (fec + nonmoe_forward_s))
    return ptrans + pagg


def prophet_layer_times(
    cost_model: Any,
    recv_tokens_W: Any,
    compute_tokens_W: Any,
    copies: Any,
    shape: ExpertShape,
    nonmoe_forward_s: float = 0.0,
) -> dict[str, np.ndarray]:
    """Pro-Prophet §IV-B Eq. 1-8 for one layer, as printed. Returns every term and both totals:

    ``a2a = max_i R_i·tok_bytes/B̄`` (Eq. 1, B̄ the mean bandwidth between two devices),
    ``fec = max_i`` forward expert time of ``H_i`` tokens (Eq. 2), ``bec = 2·fec`` (Eq. 3),
    ``trans = s·(D−n)·size/(D·B̄)`` (Eq. 4), ``agg`` likewise (Eq. 5),
    ``total = 4·a2a + 3·fec + trans + agg`` (Eq. 6), ``overlapped`` with Eq. 8's
    ``max(0, trans − fec − fnec)`` and ``max(0, agg − bec − bnec)``.

    ``copies`` is Eq. 4's ``s·(D−n)``: s transferred experts, each sent to D−n devices. The planner
    passes the sum over its selected experts, which may be sent to different numbers of devices.
    """
    D = cost_model.topology.num_devices
    bbar = cost_model.mean_bandwidth_bytes_per_s
    tok_bytes = shape.d_model * cost_model.bytes_per_element
    size = shape.param_bytes(cost_model.bytes_per_element)
    a2a = np.asarray(recv_tokens_W, dtype=np.float64).max(axis=-1) * tok_bytes / bbar
    tokens_W = np.asarray(compute_tokens_W, dtype=np.float64)
    fec = cost_model.slowest(
        cost_model.expert_forward_time(tokens_W, shape) + cost_model.elementwise_time(tokens_W, shape)
    )
    bec = 2 * fec
    trans = np.asarray(copies, dtype=np.float64) * size / (D * bbar)
    agg = trans
    total = 4 * a2a + 3 * fec + trans + agg
    return {
        "a2a": a2a,
        "fec": fec,
        "bec": bec,
        "trans": trans,
        "agg": agg,
        "total": total,
        "overlapped": 4 * a2a + 3 * fec + overlapped_copies(trans, agg, fec, nonmoe_forward_s),
    }


def price_terms(terms: PlacementTerms, cost_model: Any, shape: ExpertShape, pricing: Pricing) -> np.ndarray:
    """The predicted time (seconds, forward + backward) of every candidate `[Z]` of
    `perf.placement_pricing`: Eq. 6 (four exchanges, three expert computes, Trans and Agg as the
    sparse collectives run them), Eq. 8 with `pricing.overlap` (copies as the prefetch sends them,
    hidden by the measured window), or Eq. 1-8 as printed with `pricing.model="paper"`."""
    if pricing.model == "paper":
        recv_ZW = terms.tokens_ZW - terms.local_ZW  # tokens from other devices
        t = prophet_layer_times(cost_model, recv_ZW, terms.tokens_ZW, terms.copies_Z, shape, pricing.nonmoe_forward_s)
        return t["overlapped" if pricing.overlap else "total"]
    if pricing.overlap:
        copies = overlapped_copies(
            terms.trans_prefetched_s,
            terms.agg_prefetched_s,
            terms.compute_s,
            pricing.nonmoe_forward_s,
            pricing.hidden_share,
            pricing.experts_hide,
        )
    else:
        copies = terms.trans_s + terms.agg_s
    return 4 * terms.a2a_s + 3 * terms.compute_s + copies


def prune_by_copies(pricing: Pricing) -> tuple[bool, bool]:
    """`(detail, bounded)` of `PlacementPricer.cheapest_prefixes` for `price_terms` under `pricing`:
    Eq. 1's local tokens for the paper model; the copies' bound holds where the copies count in
    full, as the shared cost model prices them (not hidden by Eq. 8, not Eq. 4's mean bandwidth)."""
    return pricing.model == "paper", pricing.model == "links" and not pricing.overlap


def price_placement(
    flow_WE: np.ndarray, placement: Placement, cost_model, shape: ExpertShape, pricing: Pricing, node_of=None
) -> float:
    """The predicted time (seconds, forward + backward) of one layer running `flow_WE` (rounded to
    whole assignments) on `placement`: Eq. 6, or Eq. 8 with `pricing.overlap` (`price_terms`)."""
    pricer = PlacementPricer(np.rint(flow_WE), placement.owner_E, cost_model, shape, node_of, whole=True)
    terms = pricer.placements([placement.holders_EW], detail=pricing.model == "paper")
    return float(price_terms(terms, cost_model, shape, pricing)[0])
