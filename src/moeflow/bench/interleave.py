"""Order of side-by-side measurements.

Benchmarks time their variants interleaved, round by round, so that drift on a shared machine hits
all of them alike. A fixed order within the round is not enough: on the 2 × 2 network testbed two
identical sync layers (EP, and shadowing with nothing shadowed) measured 0.78× when the shadow
layer ran second in every round and 1.34× when it ran first (`moeflow bench --skews 0`, 20 and
40 rounds, docs/benchmarks.md, "FasterMoE on the network testbed"). Rotating the order every
round puts each variant in each position equally often.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def rotated(items: Sequence[T], round_index: int) -> list[T]:
    """`items` starting at position `round_index mod len(items)`: round r runs them in this order."""
    if not items:
        return []
    shift = round_index % len(items)
    return [*items[shift:], *items[:shift]]
