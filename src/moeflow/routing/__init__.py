"""Routing: which experts a token picks (`gate`) and what shapes that choice (`balance`).

The two registries of this package are the `gate` and `balance` axes of a MoE layer: every name
here works unchanged in `MoELayer(gate=..., balance=...)`, the config (`moe.gate`, `moe.balance`,
`moe.gate_options`, `moe.balance_options`), `moeflow train | bench | simulate` and the docs.
What a gate or balance does to a recorded trace in a simulation is in `effects.py`.
"""

from __future__ import annotations

from torch import nn

from moeflow.core.registry import Component, Registry
from moeflow.routing.balance import (
    AuxFreeBalance,
    AuxFreeOptions,
    GShardBalance,
    GShardOptions,
    NoBalance,
    SequenceBalance,
)
from moeflow.routing.expert_choice import ExpertChoiceGate
from moeflow.routing.gates import (
    NoisyTopKGate,
    SigmoidGate,
    SigmoidOptions,
    SwitchGate,
    TopKGate,
    TopKOptions,
    XMoEGate,
    XMoEOptions,
)
from moeflow.routing.hierarchical import HierarchicalOptions, build_hierarchical
from moeflow.routing.routing import Routing, RoutingLayout
from moeflow.routing.soft import SoftGate, SoftOptions
from moeflow.routing.ta_moe import TAMoEBalance, TAMoEOptions

GATES = Registry(
    "gate",
    [
        Component(
            "topk",
            lambda ctx, o: TopKGate(ctx.d_model, ctx.num_experts, ctx.top_k, options=o),
            TopKOptions,
            "softmax over fp32 logits, the k largest, weights renormalised (GShard, Mixtral); group-limited, "
            "softmax after top-k (GPT-OSS), router bias, scaling: options",
        ),
        Component(
            "switch",
            lambda ctx, o: SwitchGate(ctx.d_model, ctx.num_experts, ctx.top_k),
            summary="top-1, weight = its probability (Switch Transformer)",
        ),
        Component(
            "noisy_topk",
            lambda ctx, o: NoisyTopKGate(ctx.d_model, ctx.num_experts, ctx.top_k, options=o),
            TopKOptions,
            "top-k over logits with learned Gaussian noise while training (Shazeer et al., GShard)",
        ),
        Component(
            "hierarchical",
            build_hierarchical,
            HierarchicalOptions,
            "FasterMoE §4.3 topology-aware gate: at most W_net/(M·W_local) of the tokens cross nodes",
        ),
        Component(
            "sigmoid",
            lambda ctx, o: SigmoidGate(ctx.d_model, ctx.num_experts, ctx.top_k, options=o),
            SigmoidOptions,
            "sigmoid scores, the k largest, each expert scaled by its own score (BASE, StableMoE); group- or "
            "node-limited, scaled (DeepSeek-V3), scaled inputs (Llama 4): options",
        ),
        Component(
            "xmoe",
            lambda ctx, o: XMoEGate(ctx.d_model, ctx.num_experts, ctx.top_k, o),
            XMoEOptions,
            "X-MoE: cosine similarity in a low-rank space over a learned, clamped temperature",
        ),
        Component(
            "expert_choice",
            lambda ctx, o: ExpertChoiceGate(ctx.d_model, ctx.num_experts, ctx.top_k, ctx.capacity_factor),
            summary="each expert takes its top-C tokens, C = ceil(c·k·T/E): balanced by construction",
            kind="expert_choice",
        ),
        Component(
            "soft",
            lambda ctx, o: SoftGate(ctx.d_model, ctx.num_experts, o),
            SoftOptions,
            "SoftMoE: slots mix all tokens, outputs mix all slots; nothing discrete, nothing dropped",
            kind="soft",
        ),
    ],
    is_object=lambda value: isinstance(value, nn.Module),
)
"""The `gate` axis: routers by name (`MoELayer(gate=...)`, `moe.gate`, `--gate`)."""

BALANCES = Registry(
    "balance",
    [
        Component(
            "gshard",
            lambda ctx, o: GShardBalance(ctx.num_experts, o),
            GShardOptions,
            "GShard/Switch loss E·Σ f_e·P_e; global_batch: f_e over every data-parallel rank (Qwen)",
            kind="token_choice",
        ),
        Component(
            "sequence",
            lambda ctx, o: SequenceBalance(ctx.num_experts),
            summary="DeepSeek-V3 complementary sequence-wise loss Σ f_e·P_e per sequence",
            kind="token_choice",
        ),
        Component(
            "aux_free",
            lambda ctx, o: AuxFreeBalance(ctx.num_experts, o.update_rate),
            AuxFreeOptions,
            "DeepSeek-V3 auxiliary-loss-free selection bias, updated once per step",
            kind="token_choice",
        ),
        Component("none", lambda ctx, o: NoBalance(ctx.num_experts), summary="no balance term"),
        Component(
            "ta_moe",
            lambda ctx, o: TAMoEBalance(ctx.num_experts, ctx.top_k, ctx.d_model, cost_model=ctx.cost_model, options=o),
            TAMoEOptions,
            "TA-MoE topology-aware loss towards the LP target pattern, with bounded per-rank steering",
            needs_cost_model=True,
            kind="token_choice",
        ),
    ],
    is_object=lambda value: isinstance(value, nn.Module),
)
"""The `balance` axis: balance terms by name (`MoELayer(balance=...)`, `moe.balance`)."""


def routing_kind(gate: object) -> str:
    """`token_choice`, `expert_choice` or `soft`, for a gate name or object."""
    if isinstance(gate, str):
        return GATES.get(gate).kind or "token_choice"
    return getattr(gate, "routing_kind", "token_choice")


def default_balance(gate: object) -> str:
    """The balance term a gate gets when none is named: GShard's loss for token choice, none for
    expert choice and slots (their load is balanced by construction)."""
    return "gshard" if routing_kind(gate) == "token_choice" else "none"


def check_balance_fits_gate(balance: object, gate: object) -> None:
    """Token-choice balance terms (GShard, aux-free, TA-MoE) steer each token's choice: refused with a
    gate whose rows are not a token's own choices."""
    kind = routing_kind(gate)
    name = balance if isinstance(balance, str) else type(balance).__name__
    if isinstance(balance, str):
        token_only = BALANCES.get(balance).kind == "token_choice"
    else:
        token_only = getattr(balance, "token_choice_only", True)
    if kind != "token_choice" and token_only:
        gate_name = gate if isinstance(gate, str) else type(gate).__name__
        how = "by expert choice" if kind == "expert_choice" else "through slots"
        raise ValueError(
            f"balance={name!r} shapes a token's choice of experts; gate={gate_name!r} routes {how} "
            f"(balanced by construction): use balance='none'"
        )


__all__ = [
    "BALANCES",
    "GATES",
    "Routing",
    "RoutingLayout",
    "check_balance_fits_gate",
    "default_balance",
    "routing_kind",
]
