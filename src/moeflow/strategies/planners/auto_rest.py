"""Which of `strategy="auto"`'s candidates rest: not asked for a placement, not priced.

Pricing a proposal is on the layer's critical path: about 2 ms per distinct placement at 16 devices
(a profile of `benchmarks/planner_overhead.py`, FasterMoE's johnny cluster). A candidate whose price
came out more than `rest_margin` above the winner's rests: it is not priced (nor run) for the next
1, 2, 4, ... calls (doubling each time it loses again, at most `max_rest`), then priced again; a
candidate within the margin or winning is priced every call. While it rests its planner is not asked
for a placement, except at the call before it is priced again (a planner that plans ahead runs its
search then); one that plans ahead records every flow meanwhile (`observe`: its history stays
whole). So does a planner that proposed the winner's placement under another name (on a strongly
skewed load every planner proposes the one placement that copies the hot experts): asking it (its
search: Pro-Prophet's 3 ms a call at the testbed's size, on a first layer inline) adds nothing to
the call, its price is the winner's — except one that plans ahead, in a prefetched layer, while the
winner does not, whose plan ahead the prefetch may need. (On the 2 × 1 testbed at Zipf 1.6–2
`auto`'s first layer asked four planners a call for one placement; now one.)

On an even load every planner proposes plain EP's placement: when EP wins those rest too (in a
prefetched layer those that plan ahead only if nothing was sent ahead to the call: no plan ahead was
worth sending), and all wake as soon as EP's own price on the current flow rises `rest_margin` above
what it was when they began to rest — the load has changed, and so may what they propose. Asking
them all cost 10–18 and 27–28 ms of CPU a call at 8 and 16 GPUs (Pro-Prophet's LPWNV and FasterMoE's
johnny presets, searches inline), now 0.8 and 1.0 ms (`benchmarks/planner_overhead.py --load even
--hidden-share 0`); on the 2 × 1 testbed at Zipf 0, 1.7% of the iteration against `auto` with EP
alone as candidate (one run of 100 iterations; after: 0.1%). A planner proposing EP's placement
while another placement wins is not rested as a loser: one without history yet proposes that. Plain
EP, the guard's reference, is always priced. Every rank rests the same candidates: the prices are
global numbers. The planning thread runs the searches of the candidates priced at the next call
first, so the planned-ahead choice (`next_placement()`) does not wait for the resting ones.

State (the `AutoPlanner`'s, checkpointed with it): `rest`, name -> [calls it rests now, calls it rests
after its next loss]; `wake_above`, name -> EP's price above which a planner resting on EP's
placement wakes. Every function here is a pure function of the prices and proposals, and the same
on every rank.
"""

from __future__ import annotations

from moeflow.core.placement import Placement


def calls_left(rest: dict[str, list[int]], name: str) -> int:
    """The calls candidate `name` still rests (0: priced at this call)."""
    return rest.get(name, [0, 0])[0]


def duplicates(
    proposals: dict[str, Placement], best: str, planners: dict, prefetched: bool, sent_ahead: bool
) -> list[str]:
    """The planners that proposed the winner's placement under another name — plain EP's too
    (module docstring): they add nothing to the call. Not one whose plan ahead the prefetch may
    need: in a `prefetched` layer, one that plans ahead while the winner does not, unless the winner
    is EP and nothing was `sent_ahead` to this call (no plan ahead was worth sending: resting it
    leaves the prefetch nothing it would have sent)."""
    base = best.removesuffix("+prefetch")
    winner_ahead = getattr(planners.get(base), "plans_ahead", False)
    prefetch_needs_ahead = prefetched and not winner_ahead and (base != "ep" or sent_ahead)
    return [
        name
        for name, p in proposals.items()
        if name in planners
        and name != base
        and p == proposals[best]
        and not (prefetch_needs_ahead and getattr(planners[name], "plans_ahead", False))
    ]


def update_rest(
    rest: dict[str, list[int]],
    wake_above: dict[str, float],
    prices: dict[str, float],
    resting: list[str],
    as_ep: list[str],
    duplicates: list[str],
    options,
) -> None:
    """Count down the `resting` candidates; rest those priced above the winner by more than
    `options.rest_margin`, and the winner's `duplicates` (1, 2, 4, ... calls, at most
    `options.max_rest`); a candidate within the margin is priced every call again. Not rested as a
    loser: one that proposed plain EP's placement (`as_ep`: a planner without history yet proposes
    that); rested as the winner's duplicate, it wakes when EP's price rises by `rest_margin` (`wake`)."""
    for name in resting:
        rest[name][0] -= 1
    if options.max_rest == 0:
        return
    limit = (1.0 + options.rest_margin) * min(prices.values())
    best_of: dict[str, float] = {}  # a planner's best price: its proposal, or its prefetched plan
    for name, price in prices.items():
        base = name.removesuffix("+prefetch")
        if base != "ep" and (name not in as_ep or name in duplicates):
            best_of[base] = min(price, best_of.get(base, price))
    for name, price in best_of.items():
        state = rest.setdefault(name, [0, 1])
        wake_above.pop(name, None)
        if price > limit or name in duplicates:
            state[0], state[1] = state[1], min(2 * state[1], options.max_rest)
            if name in as_ep:
                wake_above[name] = (1.0 + options.rest_margin) * prices["ep"]
        else:
            state[:] = [0, 1]


def wake(rest: dict[str, list[int]], wake_above: dict[str, float], ep_price: float) -> None:
    """End the rest of the planners resting on plain EP's placement (`update_rest`) once EP's price
    on the current flow is above what it was then by `rest_margin`: the load changed, and what they
    propose may too."""
    for name, above in list(wake_above.items()):
        if ep_price > above:
            rest[name] = [0, 1]
            del wake_above[name]
