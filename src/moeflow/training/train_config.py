"""The `[optim]` and `[train]` tables of the run configuration (`training.config.RunConfig`): AdamW
and its schedule, and how the run steps, checks, checkpoints and recovers (docs/training.md)."""

from __future__ import annotations

from dataclasses import dataclass

from moeflow.training.config_checks import check_choice, check_int_at_least, check_positive

PRECISIONS = ("fp32", "bf16")
NONFINITE_POLICIES = ("stop", "skip")
GRAD_SYNC_MODES = ("after_backward", "ddp", "fsmoe")
DEVICES = ("auto", "cpu", "cuda")
CHECKPOINTING = ("none", "selective", "full")


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
        check_positive("optim", lr=self.lr, eps=self.eps)
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
        check_positive(
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
        check_choice("train", "precision", self.precision, PRECISIONS)
        check_choice("train", "on_nonfinite", self.on_nonfinite, NONFINITE_POLICIES)
        check_choice("train", "grad_sync", self.grad_sync, GRAD_SYNC_MODES)
        mb = self.grad_bucket_mb
        if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not 0 < mb < 1e9:
            raise ValueError(f"train.grad_bucket_mb must be a finite number of MB > 0, got {mb!r}")
        check_choice("train", "device", self.device, DEVICES)
        if self.micro_batch_size is not None:
            check_int_at_least("train.micro_batch_size", self.micro_batch_size)
        check_choice("train", "activation_checkpointing", self.activation_checkpointing, CHECKPOINTING)
