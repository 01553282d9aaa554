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


def _bodies(rank: int, world_size: int, bodies) -> None:
    for body in bodies:
        body(rank, world_size)
        dist.barrier()


class SharedSpawns:
    """One spawn per world size for the whole session: a test marked `@pytest.mark.spawned(body=body)`
    and parametrized by `world` calls `shared_spawns.run(body, world)` (tests/conftest.py); the
    first such call for a world size runs, in one spawn and in collection order, the bodies of every
    selected test of that size. A failing body fails the spawn, and with it every test of the spawn
    (each names the failure): no body's failure can pass unseen, at the price of blaming its
    neighbours too."""

    def __init__(self, items) -> None:
        self.items = items
        self.done: dict[int, tuple[list, BaseException | None]] = {}

    def _selected(self, world: int) -> list:
        bodies = []
        for item in self.items:
            marker = item.get_closest_marker("spawned")
            callspec = getattr(item, "callspec", None)
            if marker is None or callspec is None or callspec.params.get("world") != world:
                continue
            if marker.kwargs["body"] not in bodies:
                bodies.append(marker.kwargs["body"])
        return bodies

    def run(self, body, world: int) -> None:
        if world not in self.done:
            bodies = self._selected(world)
            try:
                run_ranks(_bodies, world, bodies)
                self.done[world] = (bodies, None)
            except Exception as exc:  # noqa: BLE001 - re-raised for every test of this spawn
                self.done[world] = (bodies, exc)
        bodies, failure = self.done[world]
        assert body in bodies, f"{body.__name__}: mark its test @pytest.mark.spawned(body={body.__name__})"
        if failure is not None:
            names = ", ".join(b.__name__ for b in bodies)
            raise AssertionError(f"the shared {world}-rank spawn of {names} failed: {failure}") from failure
