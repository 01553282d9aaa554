"""Layer benchmark: forward+backward time and peak step memory of `MoELayer` next to its lower
bound and, where installed, Hugging Face's `MixtralSparseMoeBlock` or `DeepseekV3MoE` (swiglu
experts) and Tutel's `moe_layer` (ffn experts), all holding identical weights so that every token
is routed alike. `block="deepseek_v3"` is the fine-grained block (DeepSeek-V3 §2.1.2): moeflow's
`gate="sigmoid"` with group-limited routing, normalised and scaled weights, and one shared expert,
beside `transformers`' `DeepseekV3MoE` with the same router, experts and shared MLP. Hugging Face's
experts run with the implementation a model gets by default (`grouped_mm`, where `torch` has it)
or the one asked for (`hf_impl`: `eager`, its loop over the experts hit).

The bound is the same expert FFN computed as perfectly balanced batched matmuls (`bmm` over
`[E, T·k/E, d]`): what the experts would cost if routing, permutation and combining were free and
the load were even. Contenders are timed interleaved, round by round in a balanced order
(`bench.interleave`), each round a `torch.utils.benchmark` blocked autorange; a contender's time
is the median of its round medians, and every ratio is taken within a round (spread = min..max
over rounds), so drift on a shared machine cancels; `best` is the ratio of the fastest rounds.

Tutel runs dropless (`capacity_factor=0`: capacity = the largest expert's count), fp32 gate,
exact-erf GELU; it computes `E · capacity − T · k` padding rows, reported as `padded_rows`.
A `baseline` contender is `MoELayer` imported from another moeflow source tree (an older
revision, `git archive <rev> src | tar -x -C DIR`), for before/after ratios measured in one run.

Peak step memory: bytes allocated above the step's start (activations, gradients, temporaries)
from the profiler's allocation events on CPU, `torch.cuda.max_memory_allocated` on CUDA.

Shape suffixes: T tokens, D d_model, H d_hidden, E experts, C tokens per expert (T·k/E).
"""

from __future__ import annotations

import importlib
import platform
import statistics
import sys
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch.utils import benchmark

from moeflow.bench.interleave import balanced_order
from moeflow.bench.quiet import native_output_silenced
from moeflow.hf.weights import LAYOUTS
from moeflow.layer import MoELayer


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
    """`swiglu` compares with Mixtral's block; `ffn` with Tutel's."""
    min_run_time_s: float = 2.0
    """Per measurement (one contender, one round), for torch.utils.benchmark's blocked_autorange."""
    rounds: int = 1
    """Interleaved rounds: every contender is measured once per round."""
    block: str = "mixtral"
    """`mixtral` (top-k softmax, no shared expert) or `deepseek_v3` (group-limited sigmoid routing
    with `min(8, E)` groups of which half are kept, weights normalised and × 2.5, one shared expert
    of the experts' width): the Hugging Face block compared, and moeflow configured as it."""
    hf_impl: str = "grouped_mm"
    """The Hugging Face experts implementation timed (`grouped_mm`: a model's default; `eager`)."""
    device: str = "cpu"
    """Where every contender runs (`cpu`, `cuda`); the timer synchronises the device around each run."""

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype={self.dtype!r} must be 'float32' or 'bfloat16'")
        for name in ("tokens", "d_model", "d_hidden", "num_experts", "top_k", "rounds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be <= num_experts={self.num_experts}")
        if self.expert not in ("ffn", "swiglu"):
            raise ValueError(f"expert={self.expert!r} must be 'ffn' or 'swiglu'")
        if self.block not in ("mixtral", "deepseek_v3"):
            raise ValueError(f"block={self.block!r} must be 'mixtral' or 'deepseek_v3'")
        if self.block == "deepseek_v3" and self.expert != "swiglu":
            raise ValueError(f"block='deepseek_v3' has swiglu experts, got expert={self.expert!r}")
        if self.hf_impl not in ("grouped_mm", "eager", "batched_mm"):
            raise ValueError(f"hf_impl={self.hf_impl!r} must be 'grouped_mm', 'batched_mm' or 'eager'")
        kind = self.device.split(":")[0]
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r} must be 'cpu', 'cuda' or 'cuda:N'")
        if kind == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r}: no CUDA device is available here")

    @property
    def groups(self) -> int:
        """`n_group` of the deepseek_v3 block (the largest of 8, 4, 2, 1 dividing E)."""
        return next(g for g in (8, 4, 2, 1) if self.num_experts % g == 0)

    def layer_kwargs(self) -> dict:
        """`MoELayer` arguments of the block."""
        if self.block == "mixtral":
            return {"expert": self.expert}
        n_group = self.groups
        topk_group = max(1, n_group // 2)
        while topk_group * (self.num_experts // n_group) < self.top_k:
            topk_group += 1
        options = {"n_group": n_group, "topk_group": topk_group, "normalize": True, "scaling_factor": 2.5}
        return {"expert": "swiglu", "gate": "sigmoid", "gate_options": options, "num_shared_experts": 1}


class _Step:
    """One training step of `fn` on `x`: gradients of `x` and `params` cleared, forward, backward."""

    def __init__(self, fn, x: torch.Tensor, params: list[torch.Tensor]) -> None:
        self.fn, self.x, self.params = fn, x, params

    def clear_grads(self) -> None:
        self.x.grad = None
        for p in self.params:
            p.grad = None

    def run(self) -> None:
        self.fn(self.x).float().square().mean().backward()

    def __call__(self) -> None:
        self.clear_grads()
        self.run()


def _time(step: _Step, min_run_time_s: float) -> float:
    timer = benchmark.Timer(stmt="step()", globals={"step": step}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time_s).median


def peak_step_bytes(step: _Step, device: torch.device) -> int:
    """Most bytes allocated at once during one step (gradients cleared before it) above what was
    allocated at its start: activations, gradients, temporaries."""
    step.clear_grads()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step.run()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    from torch.profiler import ProfilerActivity, profile

    with native_output_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step.run()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    current = peak = 0
    for _, nbytes in events:
        current += nbytes
        peak = max(peak, current)
    return peak


def _balanced_bound(layer: MoELayer, cfg: LayerBenchConfig):
    """The experts' FFN on perfectly balanced `[E, C, D]` groups with the layer's own weights."""
    w = layer.experts.weights()
    per_expert = max(1, cfg.tokens * cfg.top_k // cfg.num_experts)

    def fn(x_TD):
        x_ECD = x_TD.repeat(cfg.top_k, 1)[: per_expert * cfg.num_experts].view(cfg.num_experts, per_expert, -1)
        if cfg.expert == "swiglu":
            gate, up = torch.bmm(x_ECD, w["w13"].flatten(2)).unflatten(-1, (2, -1)).unbind(-2)
            hidden = F.silu(gate) * up
            return torch.bmm(hidden, w["w2"])
        hidden = F.gelu(torch.baddbmm(w["b1"][:, None], x_ECD, w["w1"]))
        return torch.baddbmm(w["b2"][:, None], hidden, w["w2"])

    return fn


def mixtral_block_from(layer: MoELayer, impl: str = "grouped_mm"):
    """Hugging Face's `MixtralSparseMoeBlock` holding exactly `layer`'s gate and swiglu experts,
    its experts run by `impl` (transformers' `ExpertsInterface`; `grouped_mm` is what a model gets)."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(
        hidden_size=layer.d_model,
        intermediate_size=layer.d_hidden,
        num_local_experts=layer.num_experts,
        num_experts_per_tok=layer.top_k,
        router_jitter_noise=0.0,
    )
    config._experts_implementation = impl
    block = MixtralSparseMoeBlock(config)
    w = layer.experts.weights()
    with torch.no_grad():
        block.gate.weight.copy_(layer.gate.weight)
        # Mixtral stores [gate; up] rows as (out, in): the `fused` layout of `moeflow.hf.weights`.
        for name, tensor in LAYOUTS["fused"].to_hf(w).items():
            getattr(block.experts, name).copy_(tensor)
    return block, impl


def deepseek_block_from(layer: MoELayer, impl: str = "grouped_mm"):
    """`transformers`' `DeepseekV3MoE` holding exactly `layer`'s router (group limits, scaling),
    swiglu experts and shared expert, its experts run by `impl`."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    gate, shared = layer.gate, layer.shared_experts
    config = DeepseekV3Config(
        hidden_size=layer.d_model,
        moe_intermediate_size=layer.d_hidden,
        n_routed_experts=layer.num_experts,
        num_experts_per_tok=layer.top_k,
        n_group=gate.group_limit.n_group,
        topk_group=gate.group_limit.topk_group,
        norm_topk_prob=gate.normalize,
        routed_scaling_factor=gate.scaling_factor,
        n_shared_experts=shared.d_hidden // layer.d_hidden,
    )
    config._experts_implementation = impl
    block = DeepseekV3MoE(config)
    w = layer.experts.weights()
    with torch.no_grad():
        block.gate.weight.copy_(gate.weight)
        block.gate.e_score_correction_bias.zero_()
        for name, tensor in LAYOUTS["fused"].to_hf(w).items():
            getattr(block.experts, name).copy_(tensor)
        block.shared_experts.gate_proj.weight.copy_(shared.w13[:, 0].t())
        block.shared_experts.up_proj.weight.copy_(shared.w13[:, 1].t())
        block.shared_experts.down_proj.weight.copy_(shared.w2.t())
    return block, impl


def tutel_layer_from(layer: MoELayer):
    """Tutel's `moe_layer` (dropless: `capacity_factor=0`; fp32 gate; erf GELU) holding exactly
    `layer`'s gate and ffn experts. Tutel's top-k gate renormalises like `gate="topk"`."""
    from tutel import moe as tutel_moe

    tutel = tutel_moe.moe_layer(
        gate_type={"type": "top", "k": layer.top_k, "capacity_factor": 0, "fp32_gate": True},
        model_dim=layer.d_model,
        experts={
            "type": "ffn",
            "count_per_node": layer.num_experts,
            "hidden_size_per_expert": layer.d_hidden,
            "activation_fn": F.gelu,
        },
    )
    w = layer.experts.weights()
    with torch.no_grad():
        tutel.gates[0].wg.weight.copy_(layer.gate.weight)
        # Tutel stores fc1 as (out, in) per expert and fc2 as (in, out): w1ᵀ and w2.
        tutel.experts.batched_fc1_w.copy_(w["w1"].transpose(1, 2))
        tutel.experts.batched_fc1_bias.copy_(w["b1"])
        tutel.experts.batched_fc2_w.copy_(w["w2"])
        tutel.experts.batched_fc2_bias.copy_(w["b2"])
    return tutel


def load_moeflow_layer_class(src_dir: str) -> type:
    """`MoELayer` imported from the moeflow source tree `src_dir` (the folder holding `moeflow/`),
    next to the one in use: the modules are imported under their own names, kept alive by the class
    that references them, and the current `moeflow` modules are put back afterwards."""
    current = {name: mod for name, mod in sys.modules.items() if name == "moeflow" or name.startswith("moeflow.")}
    for name in current:
        del sys.modules[name]
    sys.path.insert(0, src_dir)
    try:
        cls = importlib.import_module("moeflow.layer").MoELayer
        if not cls.__module__ or not sys.modules[cls.__module__].__file__.startswith(src_dir):
            raise ImportError(f"moeflow under {src_dir!r} did not load (got {sys.modules[cls.__module__].__file__})")
    finally:
        sys.path.remove(src_dir)
        for name in [n for n in sys.modules if n == "moeflow" or n.startswith("moeflow.")]:
            del sys.modules[name]
        sys.modules.update(current)
    return cls


def _state_for(module, state: dict) -> dict:
    """`state` in `module`'s parameter names: a revision that kept the gate and up projections apart
    (`w1`, `w3`) gets them from `w13` (and `b13`), `[..., 2, H]`."""
    want = module.state_dict()
    out = {}
    for name, value in state.items():
        stem, leaf = name.rsplit(".", 1) if "." in name else ("", name)
        prefix = f"{stem}." if stem else ""
        if leaf in ("w13", "b13") and name not in want:
            first, up = ("w1", "w3") if leaf == "w13" else ("b1", "b3")
            out[prefix + first], out[prefix + up] = value[..., 0, :].contiguous(), value[..., 1, :].contiguous()
        else:
            out[name] = value
    return out


def _summary(times: list[float]) -> dict:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "rounds_s": times}


def _ratio(num: list[float], den: list[float]) -> dict:
    """Per-round ratios: their median and spread; and the ratio of the two fastest rounds (`best`:
    other processes only ever add time, so on a busy machine the fastest round is the cleanest)."""
    ratios = [a / b for a, b in zip(num, den, strict=True)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "best": min(num) / min(den)}


def run_layer_bench(
    cfg: LayerBenchConfig,
    compare_hf: bool = True,
    compare_tutel: bool = True,
    baseline_src: str | None = None,
    seed: int = 0,
    progress: bool = False,
) -> dict:
    """One configuration: moeflow, the balanced bound, and (where installed) Hugging Face (swiglu),
    Tutel (ffn) and a baseline moeflow source tree, measured interleaved (module docstring).
    `progress`: a progress bar over the timed runs (tqdm, on stderr)."""
    dtype = getattr(torch, cfg.dtype)
    torch.manual_seed(seed)
    device = torch.device(cfg.device)
    layer = MoELayer(cfg.d_model, cfg.d_hidden, cfg.num_experts, top_k=cfg.top_k, **cfg.layer_kwargs())
    layer = layer.to(device=device, dtype=dtype)
    x = torch.randn(cfg.tokens, cfg.d_model, dtype=dtype, device=device, requires_grad=True)
    result = {"config": asdict(cfg), "threads": torch.get_num_threads(), "torch": torch.__version__}
    params = list(layer.parameters())
    steps = {"moeflow": _Step(layer, x, params), "bound": _Step(_balanced_bound(layer, cfg), x, params)}
    with torch.no_grad():
        ours = layer(x)
    result["load_imbalance"] = layer.stats.load_imbalance

    if compare_hf and cfg.expert == "swiglu":
        try:
            build = deepseek_block_from if cfg.block == "deepseek_v3" else mixtral_block_from
            block, impl = build(layer, cfg.hf_impl)
        except ImportError:
            result["hf"] = None
        else:
            block = block.to(device=device, dtype=dtype)
            with torch.no_grad():
                result["hf_max_abs_diff"] = float((ours.float() - block(x[None])[0].float()).abs().max())
            steps["hf"] = _Step(lambda t: block(t[None]), x, list(block.parameters()))
            result["hf_experts_implementation"] = impl
    if compare_tutel and cfg.expert == "ffn":
        try:
            tutel = tutel_layer_from(layer)
        except ImportError:
            result["tutel"] = None
        else:
            tutel = tutel.to(device=device, dtype=dtype)
            with torch.no_grad():
                result["tutel_max_abs_diff"] = float((ours.float() - tutel(x).float()).abs().max())
            counts_E = tutel.dispatch_count.to(torch.int64).cpu()
            # The same experts for every token (at k = 1 the outputs still differ: `gate="topk"`
            # renormalises the one weight to 1, Tutel keeps the probability).
            result["tutel_same_counts"] = bool(torch.equal(counts_E, layer.stats.flow[0]))
            result["tutel_padded_rows"] = int(counts_E.max()) * cfg.num_experts - int(counts_E.sum())
            steps["tutel"] = _Step(tutel, x, list(tutel.parameters()))
    if baseline_src:
        torch.manual_seed(seed)
        base = load_moeflow_layer_class(baseline_src)(
            cfg.d_model, cfg.d_hidden, cfg.num_experts, top_k=cfg.top_k, **cfg.layer_kwargs()
        ).to(device=device, dtype=dtype)
        base.load_state_dict(_state_for(base, layer.state_dict()))
        with torch.no_grad():
            result["baseline_max_abs_diff"] = float((ours.float() - base(x).float()).abs().max())
        steps["baseline"] = _Step(base, x, list(base.parameters()))

    for step in steps.values():  # warm-up (and lazy initialisation) outside the measurements
        step()
    names = list(steps)
    times = {name: [] for name in names}
    from tqdm import tqdm

    with tqdm(total=cfg.rounds * len(names), desc="bench", unit="run", disable=not progress, leave=False) as bar:
        for r in range(cfg.rounds):
            for name in balanced_order(names, r):
                times[name].append(_time(steps[name], cfg.min_run_time_s))
                bar.update(1)
    for name in names:
        result[name] = _summary(times[name]) | {"peak_step_bytes": peak_step_bytes(steps[name], x.device)}
    result["moeflow_over_bound"] = result["moeflow"]["median_s"] / result["bound"]["median_s"]
    result["ratios"] = {f"{name}/moeflow": _ratio(times[name], times["moeflow"]) for name in names[1:]}
    if "hf" in steps:
        result["hf"]["experts_implementation"] = result.pop("hf_experts_implementation")
        result["hf_over_moeflow"] = result["hf"]["median_s"] / result["moeflow"]["median_s"]
    if "tutel" in steps:
        result["tutel"]["padded_rows"] = result.pop("tutel_padded_rows")
        result["tutel_over_moeflow"] = result["tutel"]["median_s"] / result["moeflow"]["median_s"]
    return result


def machine_info() -> dict:
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    return {
        "machine": platform.machine(),
        "processor": platform.processor(),
        "python": platform.python_version(),
        "cpu_amx": "amx_tile" in flags.split(),
        "cpu_avx512_bf16": "avx512_bf16" in flags.split(),
        "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
