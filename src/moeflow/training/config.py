"""Run configuration: one small dataclass per component (`RunConfig`); reading TOML files and
`--set` overrides into it is `training.config_files`:

    cfg = load_config("configs/tiny.toml", overrides=["moe.top_k=1", "train.steps=50"])
    write_config(cfg, "runs/demo/config.toml")      # the resolved config, loadable again

A TOML file has one table per component (`[model]`, `[moe]`, `[data]`, `[optim]`, `[train]`); every
key is optional and falls back to the field's default. Unknown tables or keys are an error that
names the dotted key. `--set` values are parsed by the type of the field they set (`int`, `float`,
`bool`, `str`, optionally `None` with the value `none`). Runtime handles (process groups, devices)
are never config fields: they are arguments of the functions that need them.

The MoE layer's axes (`moe.gate`, `moe.balance`, `moe.strategy`, `moe.schedule`, `moe.dispatch`) are
names from the layer's own registries, and each has an options table validated against the chosen
component's options dataclass (`[moe.balance_options]` / `--set moe.balance_options.smoothing=0.3`):
one mechanism for every component, errors naming the key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from moeflow.core.checks import did_you_mean
from moeflow.core.hooks import WIRE_DTYPES
from moeflow.layer import AXES
from moeflow.routing import check_balance_fits_gate, default_balance, routing_kind
from moeflow.training.tokenizer import parse_tokenizer

PRECISIONS = ("fp32", "bf16")
NONFINITE_POLICIES = ("stop", "skip")
GRAD_SYNC_MODES = ("after_backward", "ddp", "fsmoe")
DEVICES = ("auto", "cpu", "cuda")
PARALLEL_MODES = ("replicate", "fsdp")
CHECKPOINTING = ("none", "selective", "full")


def _positive(section: str, **values: float) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{section}.{name} must be > 0, got {value!r}")


def _choice(section: str, name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(
            f"{section}.{name} must be one of {', '.join(allowed)}; got {value!r}{did_you_mean(value, allowed)}"
        )


@dataclass
class ModelConfig:
    """Shape of the MoE-GPT decoder (`moeflow.training.model.MoEGPT`)."""

    n_layers: int = 4
    """Number of transformer blocks."""
    d_model: int = 128
    """Width of the residual stream."""
    n_heads: int = 4
    """Attention heads; must divide `d_model`."""
    seq_len: int = 128
    """Context length in tokens (bytes); also the length of every training sequence."""
    d_ff: int = 512
    """Hidden width of the dense FFN in blocks that are not MoE blocks (see `moe_every`)."""
    moe_every: int = 1
    """Every n-th block has an MoE FFN (1 = all; 2 = blocks 1, 3, 5, ...); the others are dense."""
    vocab_size: int = 256
    """Vocabulary size: follows `data.tokenizer` (256 for bytes; set from the tokenizer when the run starts)."""

    def __post_init__(self) -> None:
        _positive(
            "model",
            n_layers=self.n_layers,
            d_model=self.d_model,
            n_heads=self.n_heads,
            seq_len=self.seq_len,
            d_ff=self.d_ff,
            moe_every=self.moe_every,
        )
        if self.d_model % self.n_heads:
            raise ValueError(f"model.n_heads={self.n_heads} must divide model.d_model={self.d_model}")
        if self.vocab_size < 2:
            raise ValueError(f"model.vocab_size must be >= 2, got {self.vocab_size!r}")


# Keys of earlier releases, and where their value lives now.
RENAMED_KEYS = {
    "moe.group_size": "moe.schedule_options.group_size",
    "moe.ta_moe_smoothing": "moe.balance_options.smoothing",
    "moe.ta_moe_steer_rate": "moe.balance_options.steer_rate",
    "moe.esp_size": "parallel.esp_size",
}


@dataclass
class MoEConfig:
    """Arguments of every `moeflow.MoELayer` in the model (docs/architecture.md)."""

    num_experts: int = 4
    """Experts per MoE layer (global); `--nproc` must divide it under expert parallelism."""
    top_k: int = 2
    """Experts chosen per token."""
    d_hidden: int = 256
    """Hidden width of each expert."""
    gate: str = "topk"
    """Router: a name of `moeflow.routing.GATES`."""
    expert: str = "ffn"
    """Expert kind: `ffn` (GELU, biases) or `swiglu`."""
    capacity_factor: float | None = None
    """Per-expert capacity factor; `None` is dropless."""
    balance: str | None = None
    """Balance term: a name of `moeflow.routing.BALANCES`; none given: the gate's default (`gshard` for
    token-choice gates, `none` for `expert_choice` and `soft`), written into the resolved config."""
    balance_weight: float = 0.01
    """Weight of the balance loss added to the training loss (0 turns the term off)."""
    z_loss_weight: float = 0.0
    """Weight of the router z-loss (0 = off)."""
    strategy: str = "ep"
    """Expert placement: a name of `moeflow.strategies.PLANNERS` (`ep` = plain expert parallelism)."""
    schedule: str = "sync"
    """Order and overlap of the layer's block: a name of `moeflow.strategies.SCHEDULES`."""
    dispatch: str = "a2a"
    """Token transport: a name of `moeflow.strategies.DISPATCHERS`."""
    gate_options: dict[str, Any] = field(default_factory=dict)
    """Options of the chosen gate (e.g. `cross_node_ratio` of `hierarchical`)."""
    balance_options: dict[str, Any] = field(default_factory=dict)
    """Options of the chosen balance term (e.g. `smoothing`, `steer_rate`, `steer_limit` of `ta_moe`)."""
    strategy_options: dict[str, Any] = field(default_factory=dict)
    """Options of the chosen planner (e.g. `min_gain`, `search`, `max_shadowed` of `shadow`)."""
    schedule_options: dict[str, Any] = field(default_factory=dict)
    """Options of the chosen schedule (e.g. `group_size` of `pairwise`)."""
    dispatch_options: dict[str, Any] = field(default_factory=dict)
    """Options of the chosen dispatcher."""
    prefetch: bool = False
    """Pro-Prophet §V block-wise prefetch (`moeflow.strategies.prefetch.BlockPrefetch`): copies of the experts of a
    planner that plans ahead (`prophet`) travel during the block before, their gradient sums during its backward."""
    dispatch_dtype: str | None = None
    """Send dispatched rows and expert outputs in this precision (`bfloat16`, `float16`;
    `float8_e4m3fn` on nccl), restoring the compute dtype on arrival; None: the compute dtype."""
    cost_model: str | None = None
    """Topology preset name or profile JSON (`moeflow profile --out`) pricing the network and GEMMs; needed by
    `strategy="shadow"`, `gate="hierarchical"` and `balance="ta_moe"`. It describes the cluster of a run: used
    where its device count equals the EP size, ignored with a notice elsewhere (sampling, another process count)."""

    def __post_init__(self) -> None:
        _positive("moe", num_experts=self.num_experts, top_k=self.top_k, d_hidden=self.d_hidden)
        if self.top_k > self.num_experts:
            raise ValueError(f"moe.top_k={self.top_k} exceeds moe.num_experts={self.num_experts}")
        if self.capacity_factor is not None:
            _positive("moe", capacity_factor=self.capacity_factor)
        if self.balance_weight < 0 or self.z_loss_weight < 0:
            raise ValueError(
                f"moe.balance_weight={self.balance_weight!r} and moe.z_loss_weight={self.z_loss_weight!r} must be >= 0"
            )
        if self.gate in AXES["gate"] and self.balance is None:
            self.balance = default_balance(self.gate)
        for axis, registry in AXES.items():
            name = getattr(self, axis)
            if name not in registry:
                hint = did_you_mean(name, registry.names())
                raise ValueError(f"moe.{axis}={name!r}: unknown{hint}; valid: {registry.names()}")
            raw = getattr(self, f"{axis}_options")
            typed = dataclasses.asdict(registry.options(name, raw, where=f"moe.{axis}_options"))
            setattr(self, f"{axis}_options", {key: typed[key] for key in raw})  # the keys given, typed
        check_balance_fits_gate(self.balance, self.gate)
        if self.dispatch_dtype is not None and self.dispatch_dtype not in WIRE_DTYPES:
            raise ValueError(f"moe.dispatch_dtype={self.dispatch_dtype!r}: expected one of {sorted(WIRE_DTYPES)}")
        if self.capacity_factor is not None and routing_kind(self.gate) == "soft":
            raise ValueError(f"moe.capacity_factor={self.capacity_factor} with moe.gate='soft': slots never drop")

    def layer_options(self) -> dict[str, dict[str, Any]]:
        """`MoELayer`'s `*_options` keyword arguments."""
        return {f"{axis}_options": dict(getattr(self, f"{axis}_options")) for axis in AXES}


def _int_at_least(where: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where} must be an integer >= {minimum}, got {value!r}")


@dataclass
class ParallelConfig:
    """How the ranks are laid out (`moeflow.core.parallel.ParallelLayout`, docs/parallel.md): one
    device mesh dp × ep × esp = the process count."""

    ep_size: int | None = None
    """Ranks that split the experts of a layer (expert parallelism); none given: every process,
    divided by `esp_size`. Smaller than that: the experts are replicated over the `world / (ep_size ·
    esp_size)` data-parallel groups (`experts` says how they are stored)."""
    esp_size: int = 1
    """Expert sharding (FSMoE §3, `moeflow.core.expert_sharding`): this many consecutive ranks hold the
    same experts, each a slice `d_hidden / esp_size` of their hidden dimension. Must divide `d_hidden`,
    the process count and the processes per node; `moe.strategy="ep"` only. Checkpoints keep full-size
    experts: a run resumes under any other `esp_size`."""
    dense: str = "replicate"
    """Dense parameters (attention, norms, embeddings, head): `replicate` on every rank, gradients
    all-reduced; `fsdp`: FSDP2 `fully_shard` per block over all ranks (1/world of the parameters,
    gradients and AdamW state per rank, gathered per block when used)."""
    experts: str = "replicate"
    """Expert parameters over the ranks holding the same experts (world / ep_size / esp_size of them):
    `replicate` (gradients summed over them) or `fsdp` (sharded over them: FSDP2 on each MoE layer; with
    `moe.strategy="fssdp"`, Hecate's one owner per expert over the whole dp × ep mesh)."""

    def __post_init__(self) -> None:
        if self.ep_size is not None:
            _int_at_least("parallel.ep_size", self.ep_size)
        _int_at_least("parallel.esp_size", self.esp_size)
        _choice("parallel", "dense", self.dense, PARALLEL_MODES)
        _choice("parallel", "experts", self.experts, PARALLEL_MODES)

    def layout_sizes(self, world_size: int) -> tuple[int, int, int]:
        """(dp, ep, esp) for `world_size` processes; raises naming the sizes when they do not fit."""
        esp = self.esp_size
        if world_size % esp:
            raise ValueError(f"parallel.esp_size={esp} must divide the number of processes, {world_size}")
        ep = self.ep_size if self.ep_size is not None else world_size // esp
        if world_size % (ep * esp):
            raise ValueError(
                f"parallel.ep_size={ep} · parallel.esp_size={esp} = {ep * esp} does not divide the "
                f"{world_size} processes"
            )
        return world_size // (ep * esp), ep, esp


@dataclass
class DataConfig:
    """Where training text comes from and how it is split (`moeflow.training.data`)."""

    path: str | None = None
    """A text file or folder; `None` = the embedded corpus (this Python's stdlib `.py` sources)."""
    max_bytes: int = 8_000_000
    """Read at most this many bytes of text (files in sorted order until the cap)."""
    val_fraction: float = 0.05
    """Share of the tokens (the tail of the corpus) held out for validation."""
    tokenizer: str = "bytes"
    """`bytes`, a `tokenizers` JSON file, or `bpe:N` (a BPE of N tokens trained on the corpus, saved in the
    run folder; `training.tokenizer`)."""

    def __post_init__(self) -> None:
        _positive("data", max_bytes=self.max_bytes)
        parse_tokenizer(self.tokenizer)
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in (0, 1), got {self.val_fraction!r}")


@dataclass
class OptimConfig:
    """AdamW with linear warmup and cosine decay, global-norm gradient clipping."""

    lr: float = 3e-3
    """Peak learning rate, reached at the end of warmup."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 20
    """Steps of linear warmup from 0 to `lr`."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not to biases, norms)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 = no clipping."""

    def __post_init__(self) -> None:
        _positive("optim", lr=self.lr, eps=self.eps)
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"optim.min_lr={self.min_lr!r} must be in [0, optim.lr={self.lr!r}]")
        for name in ("warmup_steps", "weight_decay", "grad_clip"):
            if getattr(self, name) < 0:
                raise ValueError(f"optim.{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"optim.{name} must be in [0, 1), got {getattr(self, name)!r}")


@dataclass
class TrainConfig:
    """The training run: length, batch, logging, evaluation, checkpoints, numerics."""

    steps: int = 200
    """Optimizer steps in total (a resumed run continues up to this step)."""
    global_batch_size: int = 16
    """Sequences per step summed over all ranks; each rank takes global_batch_size / world_size."""
    seed: int = 0
    """Seeds model initialisation (same on every rank) and the data order."""
    log_every: int = 1
    """Write a metrics.jsonl record every this many steps."""
    eval_every: int = 50
    """Compute the validation loss every this many steps (and at the last step); 0 = never."""
    eval_batches: int = 4
    """Global batches of held-out data per validation."""
    checkpoint_every: int = 50
    """Save a checkpoint every this many steps (and at the last step); 0 = only at the end."""
    keep_checkpoints: int = 2
    """Keep the newest this many complete checkpoints."""
    precision: str = "fp32"
    """`fp32`, or `bf16` for bfloat16 autocast of the forward pass."""
    on_nonfinite: str = "stop"
    """Non-finite loss or gradient norm (the same value on every rank): `stop` the run naming the
    step, or `skip` that step's update on all ranks together (counted in metrics.jsonl)."""
    device: str = "auto"
    """`auto` (CUDA when available, else CPU), `cpu` or `cuda`."""
    deterministic: bool = True
    """Use torch's deterministic kernels so that a resumed run repeats the uninterrupted one bit
    for bit (some multi-threaded CPU kernels otherwise sum in a thread-dependent order)."""
    record_routing: bool = False
    """Write every step's routing flow matrices to routing.npz (docs/traces.md)."""
    max_restarts: int = 0
    """When a worker dies (or a collective times out), restart the group with torch's elastic agent up
    to this many times, also for one process; each restart resumes from the newest complete
    checkpoint (`moeflow train --max-restarts N`). Under an outer torchrun: torchrun's own flag."""
    grad_sync: str = "after_backward"
    """Dense gradient all-reduce: `after_backward` (one flat bucket per dtype), `ddp` (buckets of
    grad_bucket_mb launched as their gradients are ready) or `fsmoe` (FSMoE §5 partition, needs
    moe.cost_model); docs/training.md."""
    grad_bucket_mb: float = 25.0
    """Bucket size of grad_sync=ddp, in MB (PyTorch DDP's default)."""
    micro_batch_size: int | None = None
    """Gradient accumulation: sequences per rank per micro-step (forward + backward); the optimizer steps
    once per `global_batch_size / world / micro_batch_size` micro-steps, on the gradient of the whole
    batch. None: the whole local batch in one micro-step. Must divide the local batch. Balance state,
    planners and statistics see each micro-step as a forward (docs/parallel.md)."""
    activation_checkpointing: str = "none"
    """Recompute activations in backward instead of keeping them, per block: `none`; `selective`
    (attention and the experts' FFN; the exchanged rows, routing and plan are kept); `full` (the whole
    block; its MoE layers replay their routing and plan and exchange again). docs/parallel.md."""
    tensorboard: bool = False
    """Also write the metrics as TensorBoard scalars to DIR/tensorboard/ (needs `pip install
    'moeflow[tensorboard]'`; `training.tensorboard_log`)."""
    collective_timeout_s: float = 300.0
    """A collective that waits longer than this fails the run with an error naming the operation, the
    rank it timed out on and the ranks that did not answer (a stalled or dead peer), instead of
    hanging for torch's 30-minute default (`init_process_group(timeout=...)`)."""

    def __post_init__(self) -> None:
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"train.max_restarts must be an integer >= 0, got {self.max_restarts!r}")
        timeout = self.collective_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < 1e9:
            raise ValueError(f"train.collective_timeout_s must be a finite number of seconds > 0, got {timeout!r}")
        _positive(
            "train",
            steps=self.steps,
            global_batch_size=self.global_batch_size,
            log_every=self.log_every,
            eval_batches=self.eval_batches,
            keep_checkpoints=self.keep_checkpoints,
        )
        for name in ("eval_every", "checkpoint_every", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name} must be >= 0, got {getattr(self, name)!r}")
        _choice("train", "precision", self.precision, PRECISIONS)
        _choice("train", "on_nonfinite", self.on_nonfinite, NONFINITE_POLICIES)
        _choice("train", "grad_sync", self.grad_sync, GRAD_SYNC_MODES)
        mb = self.grad_bucket_mb
        if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not 0 < mb < 1e9:
            raise ValueError(f"train.grad_bucket_mb must be a finite number of MB > 0, got {mb!r}")
        _choice("train", "device", self.device, DEVICES)
        if self.micro_batch_size is not None:
            _int_at_least("train.micro_batch_size", self.micro_batch_size)
        _choice("train", "activation_checkpointing", self.activation_checkpointing, CHECKPOINTING)


@dataclass
class RunConfig:
    """Everything a training run needs; `config.toml` in a run folder is this, resolved."""

    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        """Checks across tables that do not depend on the process count."""
        esp = self.parallel.esp_size
        if self.moe.d_hidden % esp:
            raise ValueError(f"parallel.esp_size={esp} must divide moe.d_hidden={self.moe.d_hidden}")
        if esp > 1 and self.moe.strategy != "ep":
            # Other planners move or copy whole experts (core.expert_sharding.to_expert_sharding).
            raise ValueError(
                f"parallel.esp_size={esp} supports moe.strategy='ep' only, got moe.strategy={self.moe.strategy!r}"
            )
        if self.parallel.experts == "fsdp" and self.moe.prefetch:
            raise ValueError(
                "moe.prefetch=true with parallel.experts='fsdp': the prefetch reads a layer's experts during the "
                "block before, when FSDP holds only their shards; use parallel.experts='replicate'"
            )
        if self.train.activation_checkpointing == "full" and self.moe.prefetch:
            raise ValueError(
                "train.activation_checkpointing='full' with moe.prefetch=true: the prefetched copies travel once per "
                "forward and a recomputed block would need them again; use 'selective'"
            )
        if self.parallel.dense == "fsdp" and self.train.grad_sync != "after_backward":
            raise ValueError(
                f"train.grad_sync={self.train.grad_sync!r} buckets replicated dense gradients; with "
                f"parallel.dense='fsdp' FSDP reduce-scatters them itself: use 'after_backward'"
            )

    def owner_ranks(self, dp: int, ep: int) -> int:
        """Ranks that split a layer's experts: the EP size, or under Hecate's FSSDP with
        `parallel.experts="fsdp"` the whole dp × ep mesh (one owner per expert)."""
        return dp * ep if self.parallel.experts == "fsdp" and self.moe.strategy == "fssdp" else ep

    def validate_world_size(self, world_size: int, node_size: int | None = None) -> None:
        """Cross-field checks that depend on how many processes run: the mesh dp × ep × esp, the
        experts over the EP ranks, the batch over the ranks and micro-steps. `node_size`: processes
        per node when known (the launcher's `LOCAL_WORLD_SIZE`)."""
        dp, ep, esp = self.parallel.layout_sizes(world_size)
        if node_size is not None and esp > node_size:
            raise ValueError(
                f"parallel.esp_size={esp} is larger than a node of {node_size} processes: an expert-sharding "
                f"group all-gathers every dispatched row, so it stays inside a node"
            )
        if node_size is not None and node_size % esp:
            raise ValueError(
                f"parallel.esp_size={esp} must divide the processes per node, {node_size}: an expert-sharding group "
                f"stays inside a node"
            )
        if self.parallel.experts == "fsdp" and dp == 1:
            raise ValueError(
                f"parallel.experts='fsdp' with {world_size} processes as ep {ep} × esp {esp}: no data-parallel "
                f"replicas to shard the experts over (set parallel.ep_size below {world_size // esp}, or "
                f"parallel.experts='replicate')"
            )
        owners = self.owner_ranks(dp, ep)
        if self.moe.num_experts % owners:
            if self.parallel.ep_size is None and esp == 1:
                raise ValueError(
                    f"{world_size} processes cannot share moe.num_experts={self.moe.num_experts} experts "
                    f"evenly (expert parallelism needs world size dividing num_experts)"
                )
            who = f"{owners} expert-parallel ranks ({world_size} processes as dp {dp} × ep {ep} × esp {esp})"
            if owners != ep:
                who = (
                    f"{owners} owner ranks (moe.strategy='fssdp' with parallel.experts='fsdp': one owner per expert "
                    f"over dp {dp} × ep {ep})"
                )
            raise ValueError(f"{who} cannot share moe.num_experts={self.moe.num_experts} experts evenly")
        if self.train.global_batch_size % world_size:
            raise ValueError(
                f"train.global_batch_size={self.train.global_batch_size} is not divisible by the {world_size} processes"
            )
        local = self.train.global_batch_size // world_size
        micro = self.train.micro_batch_size
        if micro is not None and local % micro:
            raise ValueError(
                f"train.micro_batch_size={micro} does not divide the {local} sequences per process "
                f"(train.global_batch_size={self.train.global_batch_size} / {world_size} processes)"
            )
