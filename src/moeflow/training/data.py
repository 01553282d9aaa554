"""Training text: the embedded corpus (this Python's stdlib sources) or the user's files, as bytes.

    corpus = load_corpus(DataConfig())                  # stdlib .py files, nothing downloaded
    sampler = BatchSampler(corpus.train, seq_len=128, global_batch_size=16, rank=r, world_size=W, seed=0)
    x_BT, y_BT = sampler.batch(step)                     # this rank's rows of the global batch

Tokens are raw bytes (vocabulary 256) unless `data.tokenizer` names another tokenizer
(`training.tokenizer`). The validation split is the tail `val_fraction` of the
corpus, so no training window overlaps it. A global batch is a pure function of (seed, step): the
sampler has no hidden state, a resumed run sees exactly the batches it would have seen, and the
global batch does not depend on the number of processes (rank r takes rows
[r*B, (r+1)*B) of it, B = global_batch_size / world_size) — so runs with different process
counts train on the same data.

Shape suffixes: B batch rows on this rank, T sequence length, U tokens of the corpus
(`BatchSampler`'s public `tokens_N` argument and attribute keep their older N).
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moeflow.training.config import DataConfig

# Folders of the stdlib that are not "the library": test suites (large, repetitive fixtures) and
# third-party packages installed next to it.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
# Between two files: a newline so that a file's last line never runs into the next one's first.
_SEPARATOR = b"\n"


@dataclass(frozen=True)
class Corpus:
    """Byte tokens split into a training part and a held-out validation tail."""

    train: np.ndarray
    """[N_train] training tokens (uint8 bytes, or int32 token ids of a tokenizer)."""
    val: np.ndarray
    """[N_val] validation tokens (the tail of the corpus)."""
    source: str
    """Where the text came from (a path, or "stdlib:<path>")."""
    num_files: int
    """How many files were read (some possibly truncated by `max_bytes`)."""


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The stdlib's `.py` files in sorted path order, without tests and site-packages."""
    root = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    return sorted(_walk(root, lambda name: name.endswith(".py")), key=lambda p: p.relative_to(root).parts)


def user_files(path: str | Path) -> list[Path]:
    """A file, or every non-hidden regular file under a folder, in sorted path order."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data path {str(path)!r} does not exist")
    if path.is_file():
        return [path]
    return sorted(_walk(path, lambda name: not name.startswith(".")), key=lambda p: p.relative_to(path).parts)


def _walk(root: Path, keep) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        # os.walk visits in directory-listing order; pruning in place also keeps it out of skipped dirs.
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
        for name in filenames:
            if keep(name):
                yield Path(dirpath) / name


def read_bytes(files: list[Path], max_bytes: int) -> tuple[bytes, int]:
    """Concatenate text files until `max_bytes`; binary files (containing NUL bytes) are skipped."""
    parts: list[bytes] = []
    total = used = 0
    for path in files:
        if total >= max_bytes:
            break
        try:
            data = path.read_bytes()
        except OSError:
            continue  # unreadable (permissions, broken link): not text we can train on
        if not data or b"\0" in data:
            continue
        data = data[: max_bytes - total] + _SEPARATOR
        parts.append(data)
        total += len(data)
        used += 1
    return b"".join(parts)[:max_bytes], used


def corpus_files(cfg: DataConfig) -> tuple[list[Path], str]:
    """(files, source label) of the configured text; a missing `data.path` raises here."""
    if cfg.path is None:
        root = sysconfig.get_paths()["stdlib"]
        return stdlib_files(root), f"stdlib:{root}"
    return user_files(cfg.path), str(cfg.path)


def read_text(cfg: DataConfig) -> tuple[bytes, str, int]:
    """(the configured text as bytes, its source label, files read); no text at all raises."""
    files, source = corpus_files(cfg)
    text, used = read_bytes(files, cfg.max_bytes)
    if not text:
        raise ValueError(f"data path {source!r} contains no text (no readable non-empty text files)")
    return text, source, used


def training_part(text: bytes, cfg: DataConfig) -> bytes:
    """The bytes before the validation tail (what a tokenizer may be trained on)."""
    return text[: len(text) - int(len(text) * cfg.val_fraction)]


def load_corpus(cfg: DataConfig, min_tokens: int = 2, tokenizer=None) -> Corpus:
    """Read the configured text, tokenize it (`training.tokenizer`; None: bytes) and split it;
    `min_tokens` is the shortest usable split (seq_len + 1)."""
    text, source, used = read_text(cfg)
    tokens_U = np.frombuffer(text, dtype=np.uint8) if tokenizer is None else tokenizer.encode(text)
    n_val = int(len(tokens_U) * cfg.val_fraction)
    train_U, val_U = tokens_U[: len(tokens_U) - n_val], tokens_U[len(tokens_U) - n_val :]
    if min(len(train_U), len(val_U)) < min_tokens:
        raise ValueError(
            f"data path {source!r} has {len(tokens_U)} tokens: too little for a training and a validation "
            f"split of at least {min_tokens} tokens each with data.val_fraction={cfg.val_fraction}"
        )
    return Corpus(train=train_U, val=val_U, source=source, num_files=used)


def _windows(tokens_U: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    rows = torch.from_numpy(tokens_U[idx].astype(np.int64))
    return rows[:, :-1], rows[:, 1:]


class BatchSampler:
    """Random windows of `seq_len + 1` bytes; the global batch of step s depends only on (seed, s)."""

    def __init__(
        self,
        tokens_N: np.ndarray,
        seq_len: int,
        global_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
    ) -> None:
        if global_batch_size % world_size:
            raise ValueError(f"global_batch_size={global_batch_size} is not divisible by world_size={world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is outside world_size={world_size}")
        if len(tokens_N) < seq_len + 1:
            raise ValueError(f"seq_len={seq_len} needs at least {seq_len + 1} tokens, got {len(tokens_N)}")
        self.tokens_N = tokens_N
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // world_size
        self.rank = rank
        self.seed = seed

    def global_starts(self, step: int) -> np.ndarray:
        """Start offsets of all global_batch_size windows of `step` (same on every rank)."""
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, len(self.tokens_N) - self.seq_len, size=self.global_batch_size)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs x_BT, targets y_BT) int64 for this rank at `step`; y is x shifted by one."""
        lo = self.rank * self.local_batch_size
        starts = self.global_starts(step)[lo : lo + self.local_batch_size]
        return _windows(self.tokens_N, starts, self.seq_len)

    def state_dict(self, next_step: int) -> dict[str, int]:
        """Everything needed to continue the data order: the seed and the next step."""
        return {"seed": self.seed, "next_step": next_step}

    def check_resume(self, state: dict[str, int]) -> int:
        """Validate a saved state against this sampler; returns the step to continue from."""
        if int(state["seed"]) != self.seed:
            raise ValueError(
                f"checkpoint was trained with train.seed={state['seed']}, this run has "
                f"train.seed={self.seed}: the data order would change"
            )
        return int(state["next_step"])


def validation_batches(
    tokens_N: np.ndarray, seq_len: int, global_batch_size: int, num_batches: int, rank: int = 0, world_size: int = 1
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed, evenly spaced held-out windows, this rank's rows of each global batch."""
    n = num_batches * global_batch_size
    starts = np.linspace(0, len(tokens_N) - seq_len - 1, n).astype(np.int64)
    local = global_batch_size // world_size
    out = []
    for b in range(num_batches):
        lo = b * global_batch_size + rank * local
        out.append(_windows(tokens_N, starts[lo : lo + local], seq_len))
    return out
