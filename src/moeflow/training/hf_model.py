"""A Hugging Face causal LM as the model of `moeflow train` (docs/architectures.md, "Training").

`[model]` names a `transformers` architecture and its configuration (random initialisation by
`transformers`' own `_init_weights`), or a local `from_pretrained` directory; nothing is downloaded:

    [model]
    hf_architecture = "DeepseekV3ForCausalLM"
    seq_len = 128
    [model.hf_config]
    hidden_size = 128
    ...

The model's sparse-MoE blocks are converted (`moeflow.hf.convert_moe_blocks`) with the `[moe]`
table's strategy, schedule, dispatch, balance and their options, and `HFCausalLM` gives it
MoE-GPT's interface (`forward(idx) -> logits`, `moe_layers()`, `aux_loss()`, `cfg`), so the
trainer, checkpoints (experts by global id), metrics, traces and `moeflow generate` work
unchanged. The model's vocabulary must hold `data.tokenizer`'s tokens (256 for bytes).

On the mesh it trains as MoE-GPT does: its decoder layers are the FSDP2 units of
`parallel.dense="fsdp"` (`decoder_blocks`), its MoE layers those of `parallel.experts="fsdp"`, and
`train.activation_checkpointing="full"` is `transformers`' own gradient checkpointing of the decoder
layers, non-reentrant, with the MoE layers replaying their first pass's routing and plan
(`core.replay`). `selective` is MoE-GPT's split of a block and is refused.

Shape suffixes: B batch, T sequence, V vocabulary.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from moeflow.core.replay import Tape
from moeflow.hf import SUPPORTED, convert_moe_blocks
from moeflow.hf.archs import find_blocks
from moeflow.hf.weights import LAYOUTS, hf_tensors
from moeflow.layer import MoELayer
from moeflow.strategies.prefetch import BlockPrefetch
from moeflow.training.config import ModelConfig, MoEConfig

FROM_THE_MODEL = (
    "num_experts",
    "top_k",
    "d_hidden",
    "gate",
    "gate_options",
    "expert",
    "expert_options",
    "num_shared_experts",
    "shared_d_hidden",
)
"""`[moe]` keys a Hugging Face model's blocks determine: refused when set to anything but the default."""


def _source(cfg: ModelConfig) -> str:
    if cfg.hf_architecture:
        return f"model.hf_architecture={cfg.hf_architecture!r}"
    return f"model.hf_pretrained={cfg.hf_pretrained!r}"


def hf_config(cfg: ModelConfig):
    """The `transformers` configuration `cfg` describes (read from the directory, or built from
    `model.hf_config` for `model.hf_architecture`), checked against byte tokens and `seq_len`."""
    import transformers

    if cfg.hf_pretrained:
        path = Path(cfg.hf_pretrained)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model.hf_pretrained={cfg.hf_pretrained!r} has no config.json (expected a save_pretrained directory)"
            )
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    else:
        cls = getattr(transformers, cfg.hf_architecture, None)
        if not (isinstance(cls, type) and cfg.hf_architecture.endswith("ForCausalLM")):
            raise ValueError(f"model.hf_architecture={cfg.hf_architecture!r}: not a transformers *ForCausalLM class")
        try:
            config = cls.config_class(**cfg.hf_config)
        except (TypeError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"model.hf_config for {cfg.hf_architecture}: {first}") from None
    vocab = getattr(config, "vocab_size", None)
    if vocab is None or vocab < cfg.vocab_size:
        raise ValueError(
            f"{_source(cfg)}: vocab_size={vocab} cannot hold the {cfg.vocab_size} tokens of data.tokenizer"
        )
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and positions < cfg.seq_len:
        raise ValueError(f"model.seq_len={cfg.seq_len} exceeds max_position_embeddings={positions} of {_source(cfg)}")
    return config


def _instantiate(cfg: ModelConfig, config) -> nn.Module:
    import transformers

    if cfg.hf_pretrained:
        auto = transformers.AutoModelForCausalLM
        return auto.from_pretrained(cfg.hf_pretrained, local_files_only=True, dtype=torch.float32)
    return getattr(transformers, cfg.hf_architecture)(config).float()


def hf_experts(cfg: ModelConfig) -> tuple[int, int]:
    """(experts per layer, expert hidden size) of the model, from its blocks built on the meta
    device (no weights read or allocated); refuses a model without a supported block."""
    import transformers

    config = hf_config(cfg)
    with torch.device("meta"):
        arch = cfg.hf_architecture or (config.architectures or [None])[0]
        cls = getattr(transformers, arch, None) if arch else None
        model = cls(config) if isinstance(cls, type) else transformers.AutoModelForCausalLM.from_config(config)
    blocks = find_blocks(model, SUPPORTED)
    if not blocks:
        found = sorted({type(m).__name__ for m in model.modules() if "moe" in type(m).__name__.lower()})
        raise ValueError(
            f"{_source(cfg)} has no supported sparse-MoE block (supported: {list(SUPPORTED)}; found {found})"
        )
    block = blocks[0][3]
    layout = LAYOUTS[SUPPORTED[type(block).__name__].experts]
    num_experts, _, d_hidden = layout.shapes(hf_tensors(block.experts, layout))
    return num_experts, d_hidden


def check_moe_keys(moe: MoEConfig, cfg: ModelConfig) -> None:
    """Refuse `[moe]` keys that a Hugging Face model's blocks determine, when set."""
    defaults = MoEConfig()
    for key in FROM_THE_MODEL:
        if getattr(moe, key) != getattr(defaults, key):
            raise ValueError(f"moe.{key}={getattr(moe, key)!r}: {_source(cfg)} takes it from its own MoE blocks")


def _replay_contexts():
    """A recomputed decoder layer's MoE layers replay their first pass (`core.replay.Tape`)."""
    return Tape().contexts()


class HFCausalLM(nn.Module):
    """A `transformers` causal LM with its sparse-MoE blocks on `MoELayer`, behind MoE-GPT's interface
    (module docstring). `cfg` is the run's `[model]` table (`seq_len`, `vocab_size` of the tokenizer)."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig, cost_model=None) -> None:
        super().__init__()
        check_moe_keys(moe, cfg)
        config = hf_config(cfg)
        self.cfg = cfg
        self.hf = _instantiate(cfg, config)
        convert_moe_blocks(self.hf, **moe.run_kwargs(cost_model))
        self.aux_coef = float(getattr(self.hf.config, "router_aux_loss_coef", 0.0) or 0.0)
        self.own_aux = bool(getattr(self.hf.config, "output_router_logits", False)) and self.aux_coef > 0
        self._hf_aux: torch.Tensor | None = None
        self.prefetch = BlockPrefetch([layer for _, layer in self.moe_layers()]) if moe.prefetch else None

    def moe_layers(self) -> list[tuple[int, MoELayer]]:
        """(decoder block index, layer) of every MoE layer, in depth order."""
        out = []
        for name, module in self.hf.named_modules():
            if isinstance(module, MoELayer):
                found = re.search(r"layers\.(\d+)\.", name)
                out.append((int(found.group(1)) if found else len(out), module))
        return out

    def decoder_blocks(self) -> list[nn.Module]:
        """The decoder layers, in depth order (the FSDP2 units of `parallel.dense="fsdp"`)."""
        return list(self.hf.get_decoder().layers)

    def set_recompute(self, mode: str) -> None:
        """`train.activation_checkpointing` (module docstring): `none` or `full`."""
        if mode not in ("none", "full"):
            raise ValueError(
                f"train.activation_checkpointing={mode!r}: a Hugging Face model recomputes 'none' or 'full'"
            )
        for _, layer in self.moe_layers():
            layer.set_recompute(mode)
        if mode == "full":
            kwargs = {"use_reentrant": False, "context_fn": _replay_contexts}
            self.hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            self.hf.activation_checkpointing_disable()

    def aux_loss(self) -> torch.Tensor:
        """The MoE layers' aux losses of the last forward, plus the model's own load-balancing loss
        (`router_aux_loss_coef ×`) where its config asks for it (`output_router_logits`)."""
        aux = torch.stack([layer.aux_loss.float() for _, layer in self.moe_layers()]).sum()
        if self._hf_aux is not None:
            aux = aux + self.aux_coef * self._hf_aux.float().to(aux.device)
        return aux

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        if idx_BT.shape[1] > self.cfg.seq_len:
            raise ValueError(f"sequence length {idx_BT.shape[1]} exceeds model.seq_len={self.cfg.seq_len}")
        out = self.hf(input_ids=idx_BT, output_router_logits=self.own_aux, use_cache=False)
        self._hf_aux = out.aux_loss if self.own_aux else None
        return out.logits
