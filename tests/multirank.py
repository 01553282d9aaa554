"""Run a test body on several gloo ranks (real torch.distributed, spawned processes).

A spawn costs ~10-15 s on a 2-core machine, so each body should batch many checks. The body is a
module-level function `body(rank, world_size, *args)`; an exception on any rank fails the test with
that rank's traceback.
"""

from __future__ import annotations

import os
import tempfile

import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, init_file: str, body, args) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        body(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(body, world_size: int, *args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_entry, args=(world_size, os.path.join(tmp, "rendezvous"), body, args), nprocs=world_size)
