"""Tokens of the training text (`data.tokenizer`): raw bytes, a tokenizer file, or a BPE trained on
the run's own corpus.

    data.tokenizer = "bytes"                 # default: 256 byte values, nothing to train
    data.tokenizer = "path/to/tokenizer.json"   # a Hugging Face `tokenizers` file
    data.tokenizer = "bpe:4096"              # a byte-level BPE of 4096 tokens trained on the corpus

`bpe:N` is trained offline, once, before any training process starts (`prepare_tokenizer`), with the
`tokenizers` package (byte-level pre-tokenizer and decoder: every byte sequence encodes, nothing is
unknown) on the corpus' training part — the validation tail is left out — and saved in the run folder
as `tokenizer.json`; a resumed run and `moeflow generate` read it from there. `model.vocab_size`
follows the tokenizer (256 for bytes).

    tokenizer = load_tokenizer(cfg.data, run_dir)
    ids_U = tokenizer.encode(text_bytes); tokenizer.decode(ids) -> str     (U: tokens of a corpus)
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

BYTES = "bytes"
TOKENIZER_FILE = "tokenizer.json"
"""In the run folder: the BPE trained for the run (`bpe:N`)."""
MIN_BPE = 257
"""A byte-level BPE starts from the 256 byte values; it needs at least one merge."""


def parse_tokenizer(spec: str) -> tuple[str, int | str | None]:
    """`("bytes", None)`, `("bpe", N)` or `("file", path)`; a malformed `bpe:` raises naming the key."""
    if spec == BYTES:
        return BYTES, None
    if spec.startswith("bpe:"):
        text = spec.removeprefix("bpe:")
        if not text.isdigit() or int(text) < MIN_BPE:
            raise ValueError(
                f"data.tokenizer={spec!r}: expected bpe:N with N an integer >= {MIN_BPE} (tokens of the BPE)"
            )
        return "bpe", int(text)
    return "file", spec


class ByteTokenizer:
    """Raw bytes: token = byte value."""

    vocab_size = 256
    name = BYTES

    def encode(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8)

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class FileTokenizer:
    """A Hugging Face `tokenizers` tokenizer (a `tokenizer.json`)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"data.tokenizer file {str(path)!r} does not exist")
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - the Rust library's errors have no common Python type
            raise ValueError(f"data.tokenizer file {str(path)!r}: not a tokenizers JSON ({exc})") from None
        self.path = path
        self.name = str(path)
        self.vocab_size = self.tokenizer.get_vocab_size()

    def encode(self, data: bytes) -> np.ndarray:
        text = data.decode("utf-8", errors="replace")
        # One encoding per line block keeps the Rust library's memory modest on a large corpus.
        chunks = [text[i : i + (1 << 20)] for i in range(0, len(text), 1 << 20)] or [""]
        ids = [np.asarray(e.ids, dtype=np.int32) for e in self.tokenizer.encode_batch(chunks)]
        return np.concatenate(ids) if ids else np.zeros(0, np.int32)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


Tokenizer = ByteTokenizer | FileTokenizer


def train_bpe(text: bytes, vocab_size: int, path: Path) -> FileTokenizer:
    """A byte-level BPE of `vocab_size` tokens trained on `text`, saved to `path` (atomically)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    decoded = text.decode("utf-8", errors="replace")
    tokenizer.train_from_iterator((decoded[i : i + (1 << 16)] for i in range(0, len(decoded), 1 << 16)), trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tokenizer.save(str(tmp))
    os.replace(tmp, path)
    return FileTokenizer(path)


def load_tokenizer(spec: str, run_dir: str | Path) -> Tokenizer:
    """The tokenizer of a run (after `prepare_tokenizer`): bytes, the given file, or the run's BPE."""
    kind, value = parse_tokenizer(spec)
    if kind == BYTES:
        return ByteTokenizer()
    if kind == "file":
        return FileTokenizer(str(value))
    path = Path(run_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"data.tokenizer={spec!r}: the run's {str(path)!r} does not exist")
    return FileTokenizer(path)


def prepare_tokenizer(spec: str, run_dir: Path, train_text: bytes, resume: bool) -> tuple[Tokenizer, str | None]:
    """Before processes start: the run's tokenizer, training `bpe:N` on `train_text` (a fresh run, or
    a resumed run that has none yet). Returns (tokenizer, a line to print, or None)."""
    kind, value = parse_tokenizer(spec)
    path = run_dir / TOKENIZER_FILE
    if kind != "bpe" or (resume and path.is_file()):
        return load_tokenizer(spec, run_dir), None
    import time

    started = time.perf_counter()
    tokenizer = train_bpe(train_text, int(value), path)
    return tokenizer, (
        f"tokenizer: a BPE of {tokenizer.vocab_size} tokens trained on {len(train_text):,} bytes of the corpus in "
        f"{time.perf_counter() - started:.1f} s, saved as {path}"
    )


class TextStream:
    """Text of sampled tokens as it grows: `push(id)` returns what can be shown now (a character
    whose bytes are not complete yet waits for the next token)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.shown = ""

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        text = self.tokenizer.decode(self.ids).rstrip("\ufffd")
        if not text.startswith(self.shown):
            return ""
        new, self.shown = text[len(self.shown) :], text
        return new

    def finish(self) -> str:
        text = self.tokenizer.decode(self.ids)
        rest = text[len(self.shown) :] if text.startswith(self.shown) else ""
        self.shown = text
        return rest
