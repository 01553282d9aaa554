"""Run a test body on several gloo ranks (real torch.distributed, spawned processes).

A spawn costs ~10-15 s on a 2-core machine, so each body should batch many checks. The body is a
module-level function `body(rank, world_size, *args)`; an exception on any rank fails the test with
that rank's traceback.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, init_file: str, body, args) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        with warnings.catch_warnings():  # the filters, as they were
            body(rank, world_size, *args)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(body, world_size: int, *args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_entry, args=(world_size, os.path.join(tmp, "rendezvous"), body, args), nprocs=world_size)


def _bodies(rank: int, world_size: int, bodies) -> None:
    """Each body in turn, as if alone in its spawn: the process-wide settings that a body may change
    (a Trainer turns deterministic algorithms on; tests/multirank_train.py sets the launcher's
    environment and the command's warning format) are put back before the next one."""
    import torch

    for body, args in bodies:
        environ, formatwarning = dict(os.environ), warnings.formatwarning
        saved = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.get_default_dtype(),
            torch.is_grad_enabled(),
        )
        with warnings.catch_warnings():  # the filters, as they were
            body(rank, world_size, *args)
            dist.barrier()
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.set_default_dtype(saved[2])
        torch.set_grad_enabled(saved[3])
        torch.set_num_threads(1)
        os.environ.clear()
        os.environ.update(environ)
        warnings.formatwarning = formatwarning


def _no_args(folder: Path) -> tuple:
    return ()


class SharedSpawns:
    """One spawn per world size for the whole session. A test marked
    `@pytest.mark.spawned(body=body)` and parametrized by `world` (or marked with `world=N`) calls
    `shared_spawns.run(body, world)` (tests/conftest.py); the first such call for a world size runs,
    in one spawn and in collection order, the bodies of every selected test of that size, each as
    `body(rank, world)` — or, when marked with `setup=f`, as `body(rank, world, tmp, *f(tmp))` with
    a folder of its own (`f` runs here first, in this process; `run` returns the folder); marked
    with `folder=True`, as `body(rank, world, tmp)`.
    A failing body fails the spawn, and with it every test of the spawn (each names the failure): no
    body's failure can pass unseen, at the price of blaming its neighbours too."""

    def __init__(self, items, tmp: Path) -> None:
        self.items = items
        self.tmp = tmp
        self.done: dict[int, tuple[list, BaseException | None]] = {}

    def _selected(self, world: int) -> list:
        bodies = []
        for item in self.items:
            marker = item.get_closest_marker("spawned")
            if marker is None:
                continue
            callspec = getattr(item, "callspec", None)
            marked = marker.kwargs.get("world", callspec.params.get("world") if callspec else None)
            if marked == world and marker.kwargs["body"] not in [b for b, _ in bodies]:
                setup = marker.kwargs.get("setup") or (_no_args if marker.kwargs.get("folder") else None)
                bodies.append((marker.kwargs["body"], setup))
        return bodies

    def _folder(self, body, world: int) -> Path:
        return self.tmp / f"{body.__name__}-{world}ranks"

    def run(self, body, world: int) -> Path:
        if world not in self.done:
            bodies = self._selected(world)
            try:
                calls = []
                for each, setup in bodies:
                    args: tuple = ()
                    if setup is not None:
                        folder = self._folder(each, world)
                        folder.mkdir(parents=True)
                        args = (str(folder), *setup(folder))
                    calls.append((each, args))
                run_ranks(_bodies, world, calls)
                self.done[world] = ([b for b, _ in bodies], None)
            except Exception as exc:  # noqa: BLE001 - re-raised for every test of this spawn
                self.done[world] = ([b for b, _ in bodies], exc)
        bodies, failure = self.done[world]
        assert body in bodies, f"{body.__name__}: mark its test @pytest.mark.spawned(body={body.__name__})"
        if failure is not None:
            names = ", ".join(b.__name__ for b in bodies)
            raise AssertionError(f"the shared {world}-rank spawn of {names} failed: {failure}") from failure
        return self._folder(body, world)
