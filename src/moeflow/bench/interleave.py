"""Order of side-by-side measurements.

Benchmarks time their variants interleaved, round by round, so that drift on a shared machine hits
all of them alike. What ran just before a variant matters too: on the 2 × 2 network testbed
(`moeflow bench --skews 0`, variants `ep:sync shadow:sync ep:pairwise shadow:pairwise`) the shadow
layer, which shadowed nothing and so ran EP's code, measured 0.78–0.82× of EP whenever it came
right after EP's sync layer — in a fixed order and in a rotated one, which keeps each variant's
predecessor — and 1.34× when the list was reversed; three sync layers alone measured within 5% of
each other. So the rounds follow a Williams design (Williams 1949, a Latin square balanced for
first-order carry-over): over a full cycle of rounds every variant runs in every position equally
often and right after every other variant equally often.
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
