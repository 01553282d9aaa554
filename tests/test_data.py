"""Embedded corpus, user data, splits and the deterministic, world-size-independent sampler."""

from __future__ import annotations

import sysconfig

import numpy as np
import pytest
import torch

from moeflow.training.config import DataConfig
from moeflow.training.data import BatchSampler, load_corpus, stdlib_files, user_files, validation_batches


def test_stdlib_corpus_is_deterministic_and_excludes_tests():
    files = stdlib_files()
    root = sysconfig.get_paths()["stdlib"]
    assert files and all(f.suffix == ".py" for f in files)
    parts = [f.relative_to(root).parts for f in files]
    assert parts == sorted(parts)
    assert not any("site-packages" in p or "test" in p[:-1] for p in parts)
    a = load_corpus(DataConfig(max_bytes=200_000, val_fraction=0.1))
    b = load_corpus(DataConfig(max_bytes=200_000, val_fraction=0.1))
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
    assert len(a.train) + len(a.val) == 200_000 and len(a.val) == 20_000
    assert a.source.startswith("stdlib:")


def test_user_folder_files_and_binary_skipping(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "two.txt").write_text("second file\n" * 20)
    (tmp_path / "a.txt").write_text("first file\n" * 20)
    (tmp_path / ".hidden").write_text("never read")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01binary")
    assert [p.name for p in user_files(tmp_path)] == ["a.txt", "two.txt", "blob.bin"]  # b/ sorts before blob.bin
    corpus = load_corpus(DataConfig(path=str(tmp_path), val_fraction=0.25), min_tokens=8)
    text = bytes(corpus.train) + bytes(corpus.val)
    assert text.startswith(b"first file") and b"second file" in text
    assert b"binary" not in text and b"never read" not in text
    assert corpus.num_files == 2


def test_bad_data_paths_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_corpus(DataConfig(path=str(tmp_path / "nope")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="contains no text"):
        load_corpus(DataConfig(path=str(tmp_path / "empty")))
    (tmp_path / "short.txt").write_text("tiny")
    with pytest.raises(ValueError, match="too little"):
        load_corpus(DataConfig(path=str(tmp_path / "short.txt")), min_tokens=65)


def test_sampler_is_a_function_of_seed_and_step_and_shards_the_global_batch():
    tokens = np.arange(10_000, dtype=np.int64).astype(np.uint8)
    whole = BatchSampler(tokens, seq_len=16, global_batch_size=8, seed=3)
    halves = [BatchSampler(tokens, 16, 8, rank=r, world_size=2, seed=3) for r in range(2)]
    for step in (1, 2, 50):
        x, y = whole.batch(step)
        assert x.shape == (8, 16) and x.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
        parts = [h.batch(step) for h in halves]
        assert torch.equal(torch.cat([p[0] for p in parts]), x)  # same global batch on 2 ranks
        assert torch.equal(torch.cat([p[1] for p in parts]), y)
    assert not torch.equal(whole.batch(1)[0], whole.batch(2)[0])
    other_seed = BatchSampler(tokens, 16, 8, seed=4)
    assert not torch.equal(other_seed.batch(1)[0], whole.batch(1)[0])
    # Resuming = asking for the next step; the state is (seed, next step).
    assert whole.check_resume(whole.state_dict(11)) == 11
    with pytest.raises(ValueError, match="train.seed=4"):
        other_seed.check_resume(whole.state_dict(11))


def test_sampler_rejects_bad_arguments():
    tokens = np.zeros(100, np.uint8)
    with pytest.raises(ValueError, match="global_batch_size=7"):
        BatchSampler(tokens, 8, 7, rank=0, world_size=2)
    with pytest.raises(ValueError, match="rank=2"):
        BatchSampler(tokens, 8, 8, rank=2, world_size=2)
    with pytest.raises(ValueError, match="seq_len=200"):
        BatchSampler(tokens, 200, 8)


def test_validation_batches_cover_the_same_rows_on_any_world_size():
    tokens = (np.arange(5000) % 251).astype(np.uint8)
    one = validation_batches(tokens, 16, 8, num_batches=3)
    two = [validation_batches(tokens, 16, 8, 3, rank=r, world_size=2) for r in range(2)]
    for b in range(3):
        assert torch.equal(torch.cat([two[0][b][0], two[1][b][0]]), one[b][0])
