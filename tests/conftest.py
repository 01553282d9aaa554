"""The session's shared gloo spawns (tests/multirank.py, `SharedSpawns`)."""

from __future__ import annotations

import pytest

from .multirank import SharedSpawns


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "spawned(body): runs body(rank, world) in the session's shared spawn of world")


@pytest.fixture(scope="session")
def shared_spawns(request) -> SharedSpawns:
    return SharedSpawns(request.session.items)
