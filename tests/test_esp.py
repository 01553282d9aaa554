"""Expert sharding (ESP, FSMoE §3): one gloo spawn per world size runs every layout check of
tests/multirank_esp.py (2 ranks: esp 2 × ep 1; 4 ranks: esp 2 × ep 2, esp 1 × ep 4,
esp 2 × ep 1 × dp 2, esp 4)."""

from __future__ import annotations

import pytest

from .multirank_esp import esp_body


@pytest.mark.multirank
@pytest.mark.spawned(body=esp_body)
@pytest.mark.parametrize("world", [2, 4])
def test_expert_sharding_equals_single_process(world, shared_spawns):
    shared_spawns.run(esp_body, world)
