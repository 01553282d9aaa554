"""`core.heap.HeapTrim`: returns freed heap memory only after the process has grown by its slack."""

from __future__ import annotations

from moeflow.core.heap import HeapTrim, resident_bytes


def test_trims_only_after_growing_by_the_slack():
    heap = HeapTrim(slack_bytes=1 << 40)
    assert resident_bytes() > 0 and not heap.maybe_trim() and heap.trims == 0
    heap.slack = -1  # already "grown": it trims (glibc), and says so
    assert heap.maybe_trim() == (heap.libc is not None) and heap.trims == int(heap.libc is not None)
