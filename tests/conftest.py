"""The session's shared gloo spawns (tests/multirank.py, `SharedSpawns`)."""

from __future__ import annotations

import pytest

from .multirank import SharedSpawns


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "spawned(body, world=None, setup=None): runs body in the session's shared spawn of world ranks"
    )


@pytest.fixture(scope="session")
def shared_spawns(request, tmp_path_factory) -> SharedSpawns:
    return SharedSpawns(request.session.items, tmp_path_factory.mktemp("shared_spawns"))
