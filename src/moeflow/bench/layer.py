"""Layer benchmark: forward+backward time of `MoELayer` next to its lower bound and Hugging Face's
`MixtralSparseMoeBlock` with identical weights.

The bound is the same expert FFN computed as perfectly balanced batched matmuls (`bmm` over
`[E, T·k/E, d]`): what the experts would cost if routing, permutation and combining were free and
the load were even. Timings use `torch.utils.benchmark.Timer` (warm-up, blocked autorange, median).

Shape suffixes: T tokens, D d_model, H d_hidden, E experts, C tokens per expert (T·k/E).
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch.utils import benchmark

from moeflow.core.layer import MoELayer


@dataclass(frozen=True)
class LayerBenchConfig:
    tokens: int = 4096
    """T: tokens in one forward (batch × sequence) on this device."""
    d_model: int = 512
    d_hidden: int = 1024
    num_experts: int = 8
    top_k: int = 2
    dtype: str = "float32"
    """`float32` or `bfloat16` (parameters and activations)."""
    expert: str = "swiglu"
    """`swiglu` compares with Mixtral's block; `ffn` has no Hugging Face counterpart."""
    min_run_time_s: float = 2.0
    """Per measurement, for torch.utils.benchmark's blocked_autorange."""

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype={self.dtype!r} must be 'float32' or 'bfloat16'")
        for name in ("tokens", "d_model", "d_hidden", "num_experts", "top_k"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be <= num_experts={self.num_experts}")
        if self.expert not in ("ffn", "swiglu"):
            raise ValueError(f"expert={self.expert!r} must be 'ffn' or 'swiglu'")


def _time_fwd_bwd(fn, x: torch.Tensor, min_run_time_s: float) -> dict:
    def step():
        x.grad = None
        fn(x).float().square().mean().backward()

    timer = benchmark.Timer(stmt="step()", globals={"step": step}, num_threads=torch.get_num_threads())
    m = timer.blocked_autorange(min_run_time=min_run_time_s)
    return {"median_s": m.median, "iqr_s": m.iqr, "runs": len(m.times)}


def _balanced_bound(layer: MoELayer, cfg: LayerBenchConfig):
    """The experts' FFN on perfectly balanced `[E, C, D]` groups with the layer's own weights."""
    w = layer.experts.weights()
    per_expert = max(1, cfg.tokens * cfg.top_k // cfg.num_experts)

    def fn(x_TD):
        x_ECD = x_TD.repeat(cfg.top_k, 1)[: per_expert * cfg.num_experts].view(cfg.num_experts, per_expert, -1)
        if cfg.expert == "swiglu":
            hidden = F.silu(torch.bmm(x_ECD, w["w1"])) * torch.bmm(x_ECD, w["w3"])
            return torch.bmm(hidden, w["w2"])
        hidden = F.gelu(torch.baddbmm(w["b1"][:, None], x_ECD, w["w1"]))
        return torch.baddbmm(w["b2"][:, None], hidden, w["w2"])

    return fn


def mixtral_block_from(layer: MoELayer):
    """Hugging Face's `MixtralSparseMoeBlock` holding exactly `layer`'s gate and swiglu experts."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(
        hidden_size=layer.d_model,
        intermediate_size=layer.d_hidden,
        num_local_experts=layer.num_experts,
        num_experts_per_tok=layer.top_k,
        router_jitter_noise=0.0,
    )
    block = MixtralSparseMoeBlock(config)
    w = layer.experts.weights()
    with torch.no_grad():
        block.gate.weight.copy_(layer.gate.weight)
        # Mixtral stores [gate; up] rows as (out, in): gate_up_proj[e] = [w1[e]ᵀ; w3[e]ᵀ].
        block.experts.gate_up_proj.copy_(torch.cat([w["w1"], w["w3"]], dim=2).transpose(1, 2))
        block.experts.down_proj.copy_(w["w2"].transpose(1, 2))
    return block, getattr(config, "_experts_implementation", None) or "eager"


def run_layer_bench(cfg: LayerBenchConfig, compare_hf: bool = True, seed: int = 0) -> dict:
    """One configuration: moeflow, the balanced bound, and (if installed) Hugging Face."""
    dtype = getattr(torch, cfg.dtype)
    torch.manual_seed(seed)
    layer = MoELayer(cfg.d_model, cfg.d_hidden, cfg.num_experts, top_k=cfg.top_k, expert=cfg.expert).to(dtype)
    x = torch.randn(cfg.tokens, cfg.d_model, dtype=dtype, requires_grad=True)
    result = {"config": asdict(cfg), "threads": torch.get_num_threads(), "torch": torch.__version__}
    result["moeflow"] = _time_fwd_bwd(layer, x, cfg.min_run_time_s)
    result["load_imbalance"] = layer.stats.load_imbalance
    result["bound"] = _time_fwd_bwd(_balanced_bound(layer, cfg), x, cfg.min_run_time_s)
    result["moeflow_over_bound"] = result["moeflow"]["median_s"] / result["bound"]["median_s"]
    if compare_hf and cfg.expert == "swiglu":
        try:
            block, impl = mixtral_block_from(layer)
        except ImportError:
            result["hf"] = None
        else:
            block = block.to(dtype)
            with torch.no_grad():
                ours, theirs = layer(x), block(x[None])[0]
            result["hf_max_abs_diff"] = float((ours.float() - theirs.float()).abs().max())
            result["hf"] = _time_fwd_bwd(lambda t: block(t[None]), x, cfg.min_run_time_s)
            result["hf"]["experts_implementation"] = impl
            result["hf_over_moeflow"] = result["hf"]["median_s"] / result["moeflow"]["median_s"]
    return result


def machine_info() -> dict:
    return {
        "machine": platform.machine(),
        "processor": platform.processor(),
        "python": platform.python_version(),
    }
