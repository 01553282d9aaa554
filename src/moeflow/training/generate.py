"""Sample text from a trained run, in one process (all experts are loaded, whatever the training
world size was: checkpoints key experts by global id).

    model, step = load_model("runs/default")                       # newest complete checkpoint
    text = generate(model, b"def ", length=200, temperature=0.8, top_k=40, seed=0)   # a byte-level run
    for token in sample(model, prompt_ids, length=200): ...          # any tokenizer, one token at a time

Shape suffixes: B batch (1), T time, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from moeflow.perf.costmodel import CostModel
from moeflow.training import checkpoint
from moeflow.training.config_files import load_config
from moeflow.training.cost_model_setup import relocate_measured
from moeflow.training.model import MoEGPT, build_full_model
from moeflow.training.tokenizer import Tokenizer, load_tokenizer


def load_model(
    run_dir: str | Path, checkpoint_dir: str | Path | None = None, device: torch.device | None = None
) -> tuple[MoEGPT, int]:
    """The run's model (config.toml of the run) with the weights of a checkpoint; returns (model, step)."""
    run_dir = Path(run_dir)
    config_path = run_dir / "config.toml"
    if not config_path.is_file():
        raise FileNotFoundError(f"--run {str(run_dir)!r} has no config.toml (not a moeflow run folder?)")
    cfg = load_config(config_path)
    path = Path(checkpoint_dir) if checkpoint_dir is not None else checkpoint.latest_checkpoint(run_dir / "checkpoints")
    if path is None:
        raise ValueError(f"--run {str(run_dir)!r} has no complete checkpoint in checkpoints/")
    # The run's cluster, if it had one: the layers say once that it has another size and run without it.
    relocate_measured(cfg, run_dir)
    cost_model = CostModel.resolve(cfg.moe.cost_model) if cfg.moe.cost_model else None
    model = build_full_model(cfg, cost_model)
    checkpoint.load_checkpoint(path, model, optimizer=None, extra={})
    step = int(path.name.rsplit("_", 1)[-1]) if path.name.startswith("step_") else -1
    return model.to(device or torch.device("cpu")).eval(), step


def run_tokenizer(run_dir: str | Path) -> Tokenizer:
    """The tokenizer the run trained with (`data.tokenizer`: bytes, a file, or the run's BPE)."""
    cfg = load_config(Path(run_dir) / "config.toml")
    return load_tokenizer(cfg.data.tokenizer, run_dir)


@torch.no_grad()
def generate(
    model: MoEGPT, prompt: bytes, length: int, temperature: float = 1.0, top_k: int | None = None, seed: int = 0
) -> bytes:
    """Append `length` sampled bytes to `prompt` (a byte-level model); temperature 0 is greedy decoding."""
    # An empty prompt starts from a newline: the corpus is line-oriented text.
    ids = list(prompt or b"\n")
    return bytes(ids + list(sample(model, ids, length, temperature, top_k, seed)))


@torch.no_grad()
def sample(
    model: MoEGPT,
    prompt_ids: list[int],
    length: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int = 0,
) -> Iterator[int]:
    """Yield `length` token ids sampled after `prompt_ids`, one at a time (for streaming)."""
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and not 1 <= top_k <= model.cfg.vocab_size:
        raise ValueError(f"top_k must be in [1, {model.cfg.vocab_size}], got {top_k}")
    if not prompt_ids:
        raise ValueError("the prompt has no tokens")
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    idx_BT = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    for _ in range(length):
        logits_BV = model(idx_BT[:, -model.cfg.seq_len :])[:, -1, :].float()
        if temperature == 0:
            next_B1 = logits_BV.argmax(-1, keepdim=True)
        else:
            logits_BV = logits_BV / temperature
            if top_k is not None:
                kth_B1 = torch.topk(logits_BV, top_k, dim=-1).values[:, -1:]
                logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
            next_B1 = torch.multinomial(torch.softmax(logits_BV, -1), 1, generator=generator)
        idx_BT = torch.cat([idx_BT, next_B1], dim=1)
        yield int(next_B1.item())
