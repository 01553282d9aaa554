"""The sparse-collective engine on 2 and 4 gloo ranks (`multirank_sparse_collectives`): trees and
point-to-point copies and gradient sums equal the owners' weights and the holders' sums, and the
block-wise prefetch sending the trees equals plain EP."""

from __future__ import annotations

import pytest

from .multirank import run_ranks
from .multirank_sparse_collectives import check_prefetched_trees, check_sparse_collectives


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 4])
def test_sparse_collectives_trees_equal_point_to_point(world):
    run_ranks(_both, world)


def _both(rank: int, world: int) -> None:
    check_sparse_collectives(rank, world)
    check_prefetched_trees(rank, world)
