"""Order of side-by-side measurements.

Benchmarks time their variants interleaved, round by round, so that drift on a shared machine hits
all of them alike. What ran just before a variant may matter too (caches, buffers, the network's
queues), and a fixed or rotated order always gives a variant the same predecessor. The rounds
follow a Williams design (Williams 1949, a Latin square balanced for first-order carry-over): over
a full cycle every variant runs in every position, and right after every other variant, equally
often.

It does not remove noise that has nothing to do with order: on the 2 × 2 network testbed two
identical sync layers still measured 0.83–0.97× of each other over 20–40 rounds in this order
(0.78–1.34× in fixed and rotated ones; docs/fastermoe.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def williams_rows(n: int) -> list[list[int]]:
    """The rows of a Williams design for `n` treatments: n rows for even n, 2n for odd n."""
    if n <= 0:
        return []
    # First row 0, 1, n-1, 2, n-2, ...; row r adds r (mod n). Odd n also needs the mirror rows.
    first = [0] + [(j + 1) // 2 if j % 2 else n - j // 2 for j in range(1, n)]
    rows = [[(a + r) % n for a in first] for r in range(n)]
    return rows + ([row[::-1] for row in rows] if n % 2 else [])


def balanced_order(items: Sequence[T], round_index: int) -> list[T]:
    """The order in which round `round_index` runs `items` (module docstring)."""
    rows = williams_rows(len(items))
    if not rows:
        return []
    return [items[i] for i in rows[round_index % len(rows)]]
