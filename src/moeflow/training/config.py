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
from moeflow.core.experts import expert_options
from moeflow.core.hooks import WIRE_DTYPES
from moeflow.layer import AXES
from moeflow.routing import check_balance_fits_gate, default_balance, routing_kind
from moeflow.training.config_checks import check_choice, check_int_at_least, check_positive, toml_value
from moeflow.training.tokenizer import parse_tokenizer
from moeflow.training.train_config import OptimConfig, TrainConfig

__all__ = ["DataConfig", "ModelConfig", "MoEConfig", "OptimConfig", "ParallelConfig", "RunConfig", "TrainConfig"]

PARALLEL_MODES = ("replicate", "fsdp")


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
    moe_first_dense: int = 0
    """The first this many blocks have a dense FFN whatever `moe_every` says (DeepSeek-V3's
    `first_k_dense_replace`: the first 3 of its 61 blocks are dense)."""
    vocab_size: int = 256
    """Vocabulary size: follows `data.tokenizer` (256 for bytes; set from the tokenizer when the run starts)."""
    hf_architecture: str | None = None
    """Train a Hugging Face model instead of MoE-GPT: a `transformers` *ForCausalLM class name
    (`DeepseekV3ForCausalLM`, ...), randomly initialised from `hf_config` (docs/architectures.md);
    its MoE blocks run on `MoELayer` with the `[moe]` table's strategy, schedule and balance. The
    shape keys above (but `seq_len`) are then unused."""
    hf_config: dict[str, Any] = field(default_factory=dict)
    """The configuration of `hf_architecture` (its config class's keyword arguments)."""
    hf_pretrained: str | None = None
    """Train a Hugging Face model from a local `save_pretrained` directory (nothing is downloaded)."""

    def __post_init__(self) -> None:
        check_positive(
            "model",
            n_layers=self.n_layers,
            d_model=self.d_model,
            n_heads=self.n_heads,
            seq_len=self.seq_len,
            d_ff=self.d_ff,
            moe_every=self.moe_every,
        )
        if isinstance(self.moe_first_dense, bool) or not isinstance(self.moe_first_dense, int):
            raise ValueError(f"model.moe_first_dense must be an int >= 0, got {self.moe_first_dense!r}")
        if not 0 <= self.moe_first_dense < self.n_layers:
            raise ValueError(
                f"model.moe_first_dense={self.moe_first_dense} must be in [0, model.n_layers={self.n_layers}): "
                f"at least one block must be a MoE block"
            )
        if self.d_model % self.n_heads:
            raise ValueError(f"model.n_heads={self.n_heads} must divide model.d_model={self.d_model}")
        if self.vocab_size < 2:
            raise ValueError(f"model.vocab_size must be >= 2, got {self.vocab_size!r}")
        if self.hf_architecture is not None and self.hf_pretrained is not None:
            raise ValueError(
                f"model.hf_architecture={self.hf_architecture!r} and model.hf_pretrained={self.hf_pretrained!r}: "
                f"set one (a random model of an architecture, or a saved one)"
            )
        # `--set model.hf_config.KEY=VALUE` gives text: read it as a TOML value (64, 1e-5, true, [1, 2]).
        self.hf_config = {key: toml_value(value) for key, value in self.hf_config.items()}
        if self.hf_config and self.hf_architecture is None:
            raise ValueError(
                "model.hf_config needs model.hf_architecture (a hf_pretrained directory has its own config)"
            )

    @property
    def is_hf(self) -> bool:
        """Whether the model is a Hugging Face one (`hf_architecture` or `hf_pretrained`)."""
        return self.hf_architecture is not None or self.hf_pretrained is not None


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
    """Expert kind: `ffn` (GELU, biases), `swiglu` or `clamped_swiglu` (GPT-OSS's, biases)."""
    expert_options: dict[str, Any] = field(default_factory=dict)
    """Options of the expert kind (`alpha`, `limit` of `clamped_swiglu`)."""
    num_shared_experts: int = 0
    """Shared experts (DeepSeek-MoE): a dense MLP of the experts' kind on every token, added to the
    routed output; never planned, copied or dispatched."""
    shared_d_hidden: int | None = None
    """Hidden width of the shared MLP; None: `num_shared_experts · d_hidden`."""
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
    copy_chunks: int = 1
    """Column pieces of every message in the copy trees of expert copies (Hecate §4.1's chunk pipeline, `MoELayer`'s
    `copy_chunks`: a relay forwards piece j while it receives piece j + 1); planners and `moeflow simulate
    --copy-chunks` price the trees with it. Same numbers for every value; 1: each stage sent whole."""
    dispatch_dtype: str | None = None
    """Send dispatched rows and expert outputs in this precision (`bfloat16`, `float16`;
    `float8_e4m3fn` on nccl), restoring the compute dtype on arrival; None: the compute dtype."""
    cost_model: str | None = None
    """Topology preset name or profile JSON (`moeflow profile --out`) pricing the network and GEMMs; needed by
    `strategy="shadow"`, `gate="hierarchical"` and `balance="ta_moe"`. It describes the cluster of a run: used
    where its device count equals the EP size, ignored with a notice elsewhere (sampling, another process count)."""

    def __post_init__(self) -> None:
        check_positive("moe", num_experts=self.num_experts, top_k=self.top_k, d_hidden=self.d_hidden)
        if self.top_k > self.num_experts:
            raise ValueError(f"moe.top_k={self.top_k} exceeds moe.num_experts={self.num_experts}")
        if self.capacity_factor is not None:
            check_positive("moe", capacity_factor=self.capacity_factor)
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
        typed = dataclasses.asdict(expert_options(self.expert, self.expert_options, where="moe.expert_options"))
        self.expert_options = {key: typed[key] for key in self.expert_options}
        shared = self.num_shared_experts
        if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
            raise ValueError(f"moe.num_shared_experts must be an int >= 0, got {shared!r}")
        if self.shared_d_hidden is not None:
            check_positive("moe", shared_d_hidden=self.shared_d_hidden)
            if not shared:
                raise ValueError(f"moe.shared_d_hidden={self.shared_d_hidden} needs moe.num_shared_experts >= 1")
        check_int_at_least("moe.copy_chunks", self.copy_chunks)
        if self.dispatch_dtype is not None and self.dispatch_dtype not in WIRE_DTYPES:
            raise ValueError(f"moe.dispatch_dtype={self.dispatch_dtype!r}: expected one of {sorted(WIRE_DTYPES)}")
        if self.capacity_factor is not None and routing_kind(self.gate) == "soft":
            raise ValueError(f"moe.capacity_factor={self.capacity_factor} with moe.gate='soft': slots never drop")

    def layer_options(self) -> dict[str, dict[str, Any]]:
        """`MoELayer`'s `*_options` keyword arguments."""
        return {f"{axis}_options": dict(getattr(self, f"{axis}_options")) for axis in AXES}

    def run_kwargs(self, cost_model: Any) -> dict[str, Any]:
        """`MoELayer`'s arguments of how the layer runs — strategy, schedule, dispatch, balance, the
        wire and the copies, every axis's options but the gate's — which MoE-GPT's layers and a
        converted Hugging Face block (whose gate is the checkpoint's) take alike."""
        options = self.layer_options()
        return dict(
            strategy=self.strategy,
            schedule=self.schedule,
            dispatch=self.dispatch,
            balance=self.balance,
            balance_weight=self.balance_weight,
            z_loss_weight=self.z_loss_weight,
            capacity_factor=self.capacity_factor,
            dispatch_dtype=self.dispatch_dtype,
            copy_chunks=self.copy_chunks,
            cost_model=cost_model,
            **{k: v for k, v in options.items() if k != "gate_options"},
        )


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
            check_int_at_least("parallel.ep_size", self.ep_size)
        check_int_at_least("parallel.esp_size", self.esp_size)
        check_choice("parallel", "dense", self.dense, PARALLEL_MODES)
        check_choice("parallel", "experts", self.experts, PARALLEL_MODES)

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
        check_positive("data", max_bytes=self.max_bytes)
        parse_tokenizer(self.tokenizer)
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in (0, 1), got {self.val_fraction!r}")


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
        if self.model.is_hf:
            self._check_hf()
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

    def _check_hf(self) -> None:
        """What a Hugging Face model (`model.hf_architecture` / `hf_pretrained`) trains with: its own
        blocks, built whole and then parallelized (FSDP2 units of its decoder layers, its MoE
        layers'), recomputed whole (`transformers`' gradient checkpointing) — not MoE-GPT's selective
        split of a block nor FSMoE's gradient partition of MoE-GPT's blocks."""
        source = (
            f"model.hf_architecture={self.model.hf_architecture!r}"
            if self.model.hf_architecture
            else (f"model.hf_pretrained={self.model.hf_pretrained!r}")
        )
        if self.train.activation_checkpointing == "selective":
            raise ValueError(
                f"train.activation_checkpointing='selective' with {source}: a Hugging Face model recomputes "
                "'full' decoder layers (transformers' gradient checkpointing) or 'none'"
            )
        if self.train.grad_sync == "fsmoe":
            raise ValueError(
                "train.grad_sync='fsmoe' prices MoE-GPT's own blocks; with a Hugging Face model use "
                "'after_backward' or 'ddp'"
            )

    def validate_world_size(
        self, world_size: int, node_size: int | None = None, num_experts: int | None = None
    ) -> None:
        """Cross-field checks that depend on how many processes run: the mesh dp × ep × esp, the
        experts over the EP ranks, the batch over the ranks and micro-steps. `node_size`: processes
        per node when known (the launcher's `LOCAL_WORLD_SIZE`); `num_experts`: the model's experts
        per layer when not `moe.num_experts` (a Hugging Face model)."""
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
        experts = self.moe.num_experts if num_experts is None else num_experts
        if experts % owners:
            if self.parallel.ep_size is None and esp == 1:
                raise ValueError(
                    f"{world_size} processes cannot share moe.num_experts={experts} experts "
                    f"evenly (expert parallelism needs world size dividing num_experts)"
                )
            who = f"{owners} expert-parallel ranks ({world_size} processes as dp {dp} × ep {ep} × esp {esp})"
            if owners != ep:
                who = (
                    f"{owners} owner ranks (moe.strategy='fssdp' with parallel.experts='fsdp': one owner per expert "
                    f"over dp {dp} × ep {ep})"
                )
            raise ValueError(f"{who} cannot share moe.num_experts={experts} experts evenly")
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
