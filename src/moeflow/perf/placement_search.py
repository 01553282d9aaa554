"""A bounded search over the prefixes of a list of steps: the part of
`perf.placement_pricing.PlacementPricer` that decides how many prefixes a search prices (its base
class, kept apart from the terms).

A prefix costs at least its copies out and back (every term of a price is non-negative), so once
every later prefix's copies alone cost more than the best priced prefix, none of them can be the
cheapest (FasterMoE §4.1's and Pro-Prophet's searches, Hecate's and EPLB's). The first
`PRICED_FIRST` prefixes are priced, then as many more as that bound leaves; where every step adds
copies (each expert copied once, its owner kept), the copies never fall from one prefix to the next
and the bound at a prefix is its own copies.

It reads from the pricer: `E`, `W`, `owner`, `cm`, `topology`, `param_bytes`, `prefixes` and
`copies_of_prefixes`.

Shape suffixes: W ranks, Q steps, Z candidates (prefixes: Q + 1).
"""

from __future__ import annotations

import numpy as np

PRICED_FIRST = 32
"""Prefixes priced before the copies' bound decides how many more (`cheapest_prefixes`)."""


class PlacementSearch:
    """`cheapest_prefixes` of `PlacementPricer` (module docstring)."""

    def cheapest_prefixes(self, experts_Q, holders_QW, price, detail: bool = False, bounded: bool = True) -> np.ndarray:
        """`price(terms) -> [Z]` of the prefixes of the steps, up to the last that can be the
        cheapest: a prefix costs at least its copies (`bounded`: when its price is a sum of
        non-negative terms with the copies in full), so past the first prefix after which every
        prefix's copies alone cost more than the best priced one, none is priced. The first
        `PRICED_FIRST` are priced, then as many more as the bound leaves (the list is that long)."""
        experts = np.asarray(experts_Q, dtype=np.int64)
        rows = np.asarray(holders_QW, dtype=bool).reshape(experts.size, self.W)
        if not bounded or experts.size <= PRICED_FIRST:
            return price(self.prefixes(experts, rows, detail))
        if self._copies_grow(experts, rows):
            return self._cheapest_growing(experts, rows, price, detail)
        floor = np.minimum.accumulate(self.copies_of_prefixes(experts, rows)[::-1])[::-1]  # from each prefix on
        priced = PRICED_FIRST
        while True:
            predicted = price(self.prefixes(experts[:priced], rows[:priced], detail))
            beyond = np.flatnonzero(floor > predicted.min())
            last = int(beyond[0]) if beyond.size else experts.size
            if last <= priced:
                return predicted
            priced = last

    def _copies_grow(self, experts: np.ndarray, rows: np.ndarray) -> bool:
        """Whether every prefix's copies cost at least the previous prefix's: each step gives a new
        expert copies (none twice, its owner kept), so it only adds tree edges or a broadcast; a
        stage costs its busiest link (`CostModel.stage_on_busiest_link`) plus its slowest route, and
        a broadcast or reduce costs no less for more bytes."""
        Q = experts.size
        if not self._distinct(experts) or not rows[np.arange(Q), self.owner[experts]].all():
            return False
        if not self.cm.stage_on_busiest_link or (self.topology.latency_classes < 0).any():
            return False
        return all(self.cm.collective_never_falls(k, self.param_bytes) for k in ("broadcast", "reduce"))

    def _distinct(self, experts: np.ndarray) -> bool:
        """Whether no expert is stepped twice."""
        seen = np.zeros(self.E, dtype=bool)
        seen[experts] = True
        return int(np.count_nonzero(seen)) == experts.size

    def _cheapest_growing(self, experts: np.ndarray, rows: np.ndarray, price, detail: bool) -> np.ndarray:
        """`cheapest_prefixes` where the copies never fall from one prefix to the next
        (`_copies_grow`): the copies' bound at a prefix is its own copies, so in a long search they
        are priced for the first 2·`PRICED_FIRST` prefixes, and for all only if none of those costs
        more than the best price (the same prefixes priced as with every prefix's copies known)."""
        Q = experts.size
        known = Q if Q <= 4 * PRICED_FIRST else 2 * PRICED_FIRST
        copies = self.copies_of_prefixes(experts[:known], rows[:known])
        priced = PRICED_FIRST
        while True:
            predicted = price(self.prefixes(experts[:priced], rows[:priced], detail))
            while True:
                beyond = np.flatnonzero(copies > predicted.min())
                if beyond.size or known == Q:
                    break
                known = Q
                copies = self.copies_of_prefixes(experts, rows)
            last = int(beyond[0]) if beyond.size else Q
            if last <= priced:
                return predicted
            priced = last
