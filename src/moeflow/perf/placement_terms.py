"""What a placement pricer returns: the terms of every candidate (`perf.placement_pricing`).

Shape suffixes: W ranks, Z candidates.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class PlacementTerms:
    """The terms of every candidate ``[Z]`` (seconds unless said), as `CostModel` prices a plan."""

    compute_s: np.ndarray
    """One forward expert compute of the slowest device (`CostModel.compute_time`)."""
    a2a_s: np.ndarray
    """One token exchange (`CostModel.a2a_time` of the plan's sends; a step has four)."""
    trans_s: np.ndarray
    """Copies out, as the sparse collectives run them (`CostModel.copies_time`, materialize)."""
    agg_s: np.ndarray
    """Their gradients back (`copies_time`, reduce)."""
    trans_prefetched_s: np.ndarray
    """Copies out as the block-wise prefetch sends them (`copies_time(tree=False)`)."""
    agg_prefetched_s: np.ndarray
    tokens_ZW: np.ndarray | None
    """Tokens each device computes (None from the compiled sums, which keep only the most: a search
    that reads them — Pro-Prophet's Eq. 1 as printed — asks for `detail`)."""
    local_ZW: np.ndarray | None
    """Of which its own tokens (with `detail=True`; Pro-Prophet's Eq. 1 as printed needs them)."""
    copies_Z: np.ndarray
    """Copies beyond the owners."""
