"""Routing: which experts a token picks (`gate`) and what shapes that choice (`balance`).

The two registries of this package are the `gate` and `balance` axes of a MoE layer: every name
here works unchanged in `MoELayer(gate=..., balance=...)`, the config (`moe.gate`, `moe.balance`,
`moe.gate_options`, `moe.balance_options`), `moeflow train | bench | simulate` and the docs.
What a gate or balance does to a recorded trace in a simulation is in `effects.py`.
"""

from __future__ import annotations

from torch import nn

from moeflow.core.registry import Component, Registry
from moeflow.routing.balance import AuxFreeBalance, AuxFreeOptions, GShardBalance, NoBalance
from moeflow.routing.gates import (
    HierarchicalOptions,
    NoisyTopKGate,
    Routing,
    RoutingLayout,
    SwitchGate,
    TopKGate,
    TopKOptions,
    build_hierarchical,
)
from moeflow.routing.ta_moe import TAMoEBalance, TAMoEOptions

GATES = Registry(
    "gate",
    [
        Component(
            "topk",
            lambda ctx, o: TopKGate(ctx.d_model, ctx.num_experts, ctx.top_k, o.normalize),
            TopKOptions,
            "softmax over fp32 logits, the k largest, weights renormalised (GShard, Mixtral)",
        ),
        Component(
            "switch",
            lambda ctx, o: SwitchGate(ctx.d_model, ctx.num_experts, ctx.top_k),
            summary="top-1, weight = its probability (Switch Transformer)",
        ),
        Component(
            "noisy_topk",
            lambda ctx, o: NoisyTopKGate(ctx.d_model, ctx.num_experts, ctx.top_k, o.normalize),
            TopKOptions,
            "top-k over logits with learned Gaussian noise while training (Shazeer et al., GShard)",
        ),
        Component(
            "hierarchical",
            build_hierarchical,
            HierarchicalOptions,
            "FasterMoE §4.3 topology-aware gate: at most W_net/(M·W_local) of the tokens cross nodes",
        ),
    ],
    is_object=lambda value: isinstance(value, nn.Module),
)
"""The `gate` axis: routers by name (`MoELayer(gate=...)`, `moe.gate`, `--gate`)."""

BALANCES = Registry(
    "balance",
    [
        Component("gshard", lambda ctx, o: GShardBalance(ctx.num_experts), summary="GShard/Switch loss E·Σ f_e·P_e"),
        Component(
            "aux_free",
            lambda ctx, o: AuxFreeBalance(ctx.num_experts, o.update_rate),
            AuxFreeOptions,
            "DeepSeek-V3 auxiliary-loss-free selection bias, updated once per step",
        ),
        Component("none", lambda ctx, o: NoBalance(ctx.num_experts), summary="no balance term"),
        Component(
            "ta_moe",
            lambda ctx, o: TAMoEBalance(ctx.num_experts, ctx.top_k, ctx.d_model, cost_model=ctx.cost_model, options=o),
            TAMoEOptions,
            "TA-MoE topology-aware loss towards the LP target pattern, with bounded per-rank steering",
            needs_cost_model=True,
        ),
    ],
    is_object=lambda value: isinstance(value, nn.Module),
)
"""The `balance` axis: balance terms by name (`MoELayer(balance=...)`, `moe.balance`)."""

__all__ = ["BALANCES", "GATES", "Routing", "RoutingLayout"]
