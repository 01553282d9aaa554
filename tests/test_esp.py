"""Expert sharding (ESP, FSMoE §3): one gloo spawn per world size runs every layout check of
tests/multirank_esp.py (2 ranks: esp 2 × ep 1; 4 ranks: esp 2 × ep 2, esp 1 × ep 4,
esp 2 × ep 1 × dp 2, esp 4)."""

from __future__ import annotations

import pytest

from .multirank import run_ranks
from .multirank_esp import esp_body


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 4])
def test_expert_sharding_equals_single_process(world):
    run_ranks(esp_body, world)


def test_training_refuses_esp_for_now():
    """Training checkpoints do not store hidden slices yet: moe.esp_size>1 is refused by name."""
    from moeflow.training.config import MoEConfig

    assert MoEConfig().esp_size == 1
    with pytest.raises(ValueError, match="moe.esp_size=2: expert sharding is not available in training yet"):
        MoEConfig(esp_size=2)
