"""MoE-GPT: a byte-level GPT decoder whose FFNs are `moeflow.MoELayer`s (all, or every n-th block).

Single-device code; the parallel layout is applied afterwards, the torchtitan way, on the meta
device so that no rank allocates what it does not keep (docs/parallel.md):

    with torch.device("meta"):
        model = MoEGPT(cfg.model, cfg.moe)
    parallelize(model, layout)                 # EP (+ESP) experts, FSDP2 units: shapes only
    model.to_empty(device=device)
    init_weights(model, seed, model.init_module)   # moeflow.training.init: a function of the seed
    logits_BTV = model(x_BT)
    loss = F.cross_entropy(logits_BTV.flatten(0, 1), y_BT.flatten()) + model.aux_loss()

Pre-norm blocks (LayerNorm → causal self-attention → residual, LayerNorm → FFN → residual), learned
absolute position embeddings, untied output head. Dense parameters are replicated on every rank
and averaged by `moeflow.model_step.all_reduce_gradients`, or sharded by FSDP2 per block
(`dense="fsdp"`); expert parameters live on their owner (and its data-parallel replicas, whole or
FSDP-sharded). Activation checkpointing is a per-block mode (`set_recompute`).

Shape suffixes: B batch, T time (sequence), D d_model, V vocabulary (256); `q_heads`, `k_heads`, `v_heads`,
`y_heads` are `[B, heads, T, head dim]` (no letters).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import checkpoint

from moeflow import MoELayer
from moeflow.core.expert_sharding import to_expert_sharding
from moeflow.core.parallel import ParallelLayout, expert_parameters
from moeflow.core.replay import RECOMPUTE_MODES, Tape
from moeflow.perf.costmodel import CostModel
from moeflow.routing import routing_kind
from moeflow.strategies.prefetch import BlockPrefetch
from moeflow.training.config import ModelConfig, MoEConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        q_BTD, k_BTD, v_BTD = self.qkv(x_BTD).split(D, dim=-1)
        # (B, T, D) -> (B, H, T, K): the layout scaled_dot_product_attention expects.
        q_heads, k_heads, v_heads = (
            t.view(B, T, self.n_heads, D // self.n_heads).transpose(1, 2) for t in (q_BTD, k_BTD, v_BTD)
        )
        y_heads = F.scaled_dot_product_attention(q_heads, k_heads, v_heads, is_causal=True)
        return self.proj(y_heads.transpose(1, 2).reshape(B, T, D))


class DenseFFN(nn.Module):
    """The FFN of blocks without experts (same GELU as the `ffn` expert)."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, d_ff)
        self.proj = nn.Linear(d_ff, d_model)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x_BTD)))


def build_moe_layer(d_model: int, moe: MoEConfig, cost_model: CostModel | None = None) -> MoELayer:
    """One `MoELayer` from the `[moe]` config: every axis by name, with its options table."""
    return MoELayer(
        d_model,
        moe.d_hidden,
        moe.num_experts,
        top_k=moe.top_k,
        gate=moe.gate,
        expert=moe.expert,
        expert_options=moe.expert_options,
        num_shared_experts=moe.num_shared_experts,
        shared_d_hidden=moe.shared_d_hidden,
        gate_options=dict(moe.gate_options),
        **moe.run_kwargs(cost_model),
    )


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, moe: MoEConfig | None, cost_model: CostModel | None = None) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.n_heads)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        if moe is None:
            self.ffn: nn.Module = DenseFFN(cfg.d_model, cfg.d_ff)
        else:
            self.ffn = build_moe_layer(cfg.d_model, moe, cost_model)
        self.recompute = "none"
        """Activation checkpointing (`MoEGPT.set_recompute`)."""

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        if self.recompute == "full" and torch.is_grad_enabled():
            # The whole block again in backward; its MoE layer replays its first pass's decisions.
            return checkpoint(self._forward, x_BTD, use_reentrant=False, context_fn=lambda: Tape().contexts())
        return self._forward(x_BTD)

    def _forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        if self.recompute == "selective" and torch.is_grad_enabled():
            x_BTD = x_BTD + checkpoint(self._attend, x_BTD, use_reentrant=False)
            if isinstance(self.ffn, DenseFFN):  # a dense block's FFN like an MoE layer's experts
                return x_BTD + checkpoint(self.ffn, self.ln2(x_BTD), use_reentrant=False)
            return x_BTD + self.ffn(self.ln2(x_BTD))
        x_BTD = x_BTD + self._attend(x_BTD)
        return x_BTD + self.ffn(self.ln2(x_BTD))

    def _attend(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.attn(self.ln1(x_BTD))


def is_moe_block(index: int, moe_every: int, first_dense: int = 0) -> bool:
    """Blocks moe_every-1, 2*moe_every-1, ... are MoE blocks (all of them when moe_every = 1),
    except the first `first_dense` blocks (DeepSeek-V3's dense first blocks)."""
    return index >= first_dense and (index + 1) % moe_every == 0


class MoEGPT(nn.Module):
    """The model of `cfg` whose MoE blocks are built from `moe`; `cost_model` (the run's cluster,
    read once) is handed to every MoE layer."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig, cost_model: CostModel | None = None) -> None:
        super().__init__()
        if not any(is_moe_block(i, cfg.moe_every, cfg.moe_first_dense) for i in range(cfg.n_layers)):
            raise ValueError(
                f"model.moe_every={cfg.moe_every} with model.moe_first_dense={cfg.moe_first_dense} leaves no MoE "
                f"block among model.n_layers={cfg.n_layers}"
            )
        if routing_kind(moe.gate) != "token_choice":
            # Expert choice ranks a batch's tokens per expert and SoftMoE mixes them into slots: a
            # token's output depends on later tokens of the batch (both papers' limitations
            # sections: Zhou et al. 2022, Puigcerver et al. 2024), so a causal LM's loss is
            # optimistic and decoding differs from training.
            warnings.warn(
                f"moe.gate={moe.gate!r} is not causal: a token's experts or slots depend on later tokens "
                "of the batch, so this decoder's loss is optimistic and generation sees other routing",
                stacklevel=2,
            )
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(
            Block(cfg, moe if is_moe_block(i, cfg.moe_every, cfg.moe_first_dense) else None, cost_model)
            for i in range(cfg.n_layers)
        )
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._init_dense()
        # A hook on every MoE layer (not a module: it holds no parameters); all_reduce_gradients lands it.
        self.prefetch = BlockPrefetch([layer for _, layer in self.moe_layers()]) if moe.prefetch else None

    def _init_dense(self) -> None:
        # GPT-2 initialisation for the dense parts (normal, std 0.02); MoELayer initialises its own.
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)) and self._dense(module):
                self.init_module(module)

    def _dense(self, module: nn.Module) -> bool:
        inside_moe = {id(m) for _, layer in self.moe_layers() for m in layer.modules()}
        return id(module) not in inside_moe

    def init_module(self, module: nn.Module) -> None:
        """Initialise `module`'s own parameters and buffers in place as this model defines it:
        GPT-2's normal(0, 0.02) for the dense linear and embedding layers (zero biases), each other
        module's `reset_parameters()` (norms; routers and balance state inside the MoE layers).
        `moeflow.training.init.init_weights` calls it after a meta-device build."""
        if isinstance(module, (nn.Linear, nn.Embedding)) and self._dense(module):
            nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            return
        module.reset_parameters()

    def set_recompute(self, mode: str) -> None:
        """Activation checkpointing of every block (`train.activation_checkpointing`,
        docs/parallel.md): `none`, `selective` (attention and the FFN / experts' FFN recomputed; the
        exchanged rows, routing and plan kept) or `full` (the whole block recomputed; its MoE layer
        replays its routing and plan and exchanges again — `core.replay`)."""
        if mode not in RECOMPUTE_MODES:
            raise ValueError(f"train.activation_checkpointing={mode!r} must be one of {', '.join(RECOMPUTE_MODES)}")
        for block in self.blocks:
            if isinstance(block.ffn, MoELayer):
                block.ffn.set_recompute(mode)
            block.recompute = mode

    def moe_layers(self) -> list[tuple[int, MoELayer]]:
        """(block index, layer) of every MoE layer, in depth order."""
        return [(i, b.ffn) for i, b in enumerate(self.blocks) if isinstance(b.ffn, MoELayer)]

    def decoder_blocks(self) -> list[nn.Module]:
        """The blocks, in depth order (the FSDP2 units of `parallel.dense="fsdp"`)."""
        return list(self.blocks)

    def aux_loss(self) -> torch.Tensor:
        """Sum of the MoE layers' aux losses of the last forward (balance × weight, z-loss)."""
        return torch.stack([layer.aux_loss.float() for _, layer in self.moe_layers()]).sum()

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        length = idx_BT.shape[1]
        if length > self.cfg.seq_len:
            raise ValueError(f"sequence length {length} exceeds model.seq_len={self.cfg.seq_len}")
        pos_T = torch.arange(length, device=idx_BT.device)
        x_BTD = self.tok_emb(idx_BT) + self.pos_emb(pos_T)
        for block in self.blocks:
            x_BTD = block(x_BTD)
        return self.head(self.ln_f(x_BTD))


def build_full_model(cfg, cost_model: CostModel | None = None) -> nn.Module:
    """The whole model of a run's config (`RunConfig`), every expert on this process: MoE-GPT, or a
    Hugging Face causal LM on `MoELayer` when `[model]` names one (`training.hf_model.HFCausalLM`).
    Seed first: the same seed on every rank builds the same full model (`moeflow generate`, and the
    trainer's path for Hugging Face models; MoE-GPT trains from the meta device:
    `training.trainer.build_model`)."""
    if cfg.model.is_hf:
        from moeflow.training.hf_model import HFCausalLM  # imports transformers: only when asked for

        return HFCausalLM(cfg.model, cfg.moe, cost_model)
    return MoEGPT(cfg.model, cfg.moe, cost_model)


def owners_over_mesh(model: MoEGPT, layout: ParallelLayout) -> bool:
    """Hecate's FSSDP with `experts="fsdp"`: each expert has ONE owner over the whole dp × ep mesh
    (its parameters and AdamW state, Hecate §3), materialized where the load needs it — the planner
    re-shards owners, so FSDP2 cannot hold them (docs/parallel.md)."""
    return layout.experts == "fsdp" and model.moe_layers()[0][1].planner.reshards_owners


def parallelize(model: MoEGPT, layout: ParallelLayout) -> MoEGPT:
    """Apply the layout in place (on the meta device, or on a model built with the same seed on
    every rank): every MoE layer keeps this rank's experts (with `layout.esp_size > 1`, FSMoE §3,
    only this ESP member's hidden slice of them) and knows its data-parallel replicas; then the
    FSDP2 units of `layout.dense` / `layout.experts` (`apply_fsdp`).

    Gradients after backward: `moeflow.model_step.all_reduce_gradients(model, layout)`.
    """
    flat = owners_over_mesh(model, layout)
    group = layout.owner_group() if flat else layout.ep_group
    owners = layout.dp_size * layout.ep_size if flat else None
    layout.validate_experts(model.moe_layers()[0][1].num_experts, owners)
    for _, layer in model.moe_layers():
        if flat:  # one owner per expert over dp × ep: no replicas (Hecate §3)
            layer.to_expert_parallel(group)
        else:
            layer.to_expert_parallel(group, layout.expert_dp_group, layout.balance_group)
        to_expert_sharding(layer, layout.esp_group)  # FSMoE ESP: hidden slices
    apply_fsdp(model, layout, experts=layout.experts == "fsdp" and not flat)
    return model


def apply_fsdp(model: MoEGPT, layout: ParallelLayout, experts: bool) -> None:
    """FSDP2 units (`torch.distributed.fsdp.fully_shard`):

    - `experts`: each MoE layer is a unit over `layout.expert_mesh` (the dp replicas of its EP
      rank) holding its experts only — the layer reads them outside `GroupedExperts.forward`
      (sparse collectives, copies), so it is the layer that FSDP gathers for its forward and
      backward; its routers stay plain (replicated) parameters. Gradients are reduce-scattered as a
      sum over the replicas divided by the world size (`set_gradient_divide_factor`): an expert's
      gradient already sums its EP group's tokens.
    - `layout.dense == "fsdp"`: each block, then the root (embeddings, final norm, head), over all
      ranks (`layout.dense_mesh`); expert parameters not sharded by the layer's unit are left out
      (`ignored_params`), kept whole and summed over their replicas as before, and so are scalar
      parameters (FSDP2 shards none), replicated and all-reduced like `replicate`'s.
    """
    if experts:
        # The layer's output is a reshaped view; FSDP2 warns for in-place ops on it, which Block never does.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPMoELayer\) returned a view tensor")
        for _, layer in model.moe_layers():
            routers = {p for n, p in layer.named_parameters() if not n.startswith("experts.")}
            fully_shard(layer, mesh=layout.expert_mesh, ignored_params=routers)
            layer.set_gradient_divide_factor(float(layout.world_size))
            layer.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
    if layout.dense == "fsdp":
        # FSDP2 shards no scalar parameter (xmoe's temperature): those stay replicated.
        ignored = {p for p in model.parameters() if p.dim() == 0}
        if not experts:
            ignored |= {p for _, p in expert_parameters(model)}
        for block in model.decoder_blocks():
            fully_shard(block, mesh=layout.dense_mesh, ignored_params=ignored)
        fully_shard(model, mesh=layout.dense_mesh, ignored_params=ignored)
