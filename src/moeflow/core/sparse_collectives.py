"""Sparse collectives over a `Placement` (Hecate §3 spAG/spRS, §4.1; Pro-Prophet §IV-A Trans/Agg).

`materialize` copies each expert's parameters from its owner to the other holders; its backward is
`reduce_to_owner`: every holder's gradient for a copy is summed into the owner's parameter
gradient. Only parameters and gradients move — the optimizer state stays with the owner (FasterMoE
§4.1, Pro-Prophet §IV-A). One engine serves every copy of an expert: shadowing, Pro-Prophet,
FSSDP's spAG/spRS and EPLB all build a `Placement`, and this module moves it.

Experts with the same owner and the same holders form one *bundle* and travel as one flat message.
A bundle whose holders are every rank of the group moves by one broadcast / reduce (a pipelined
ring with NCCL, FasterMoE Eq. 8); any other bundle, and on gloo across nodes (`copies_by_tree`)
every bundle, moves along `placement.copy_tree`: one transfer into each destination node, then
fanned out inside it by a relay; its reduction is the mirror image (the node's holders summed at the
relay, one transfer out, summed at the owner). All trees of a layer go together in rounds of
batched point-to-point (`batch_isend_irecv`, which works for arbitrary subsets without subgroups),
then the broadcasts / reduces. With `chunks` c > 1 the messages travel in c column pieces and a
relay forwards piece j while it receives piece j + 1 (Hecate §4.1's chunk pipeline,
`core.copy_rounds`: c + 1 rounds, each stage 1's next piece beside stage 2's previous); c = 1 sends
each stage whole, one round after the other. Sums run in a fixed order (a relay's own gradient,
then its node-mates' by rank; at the owner the same over its node and the relays), whatever c, so
the result is deterministic and the same bit for bit for every c.

Shape suffixes: O experts owned by this rank, J experts held (computed) by this rank, P flattened
parameters of one expert, Y copies received by this rank (one message each), K rows of one bundle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from moeflow.core.copy_rounds import copy_rounds, reduce_rounds
from moeflow.core.placement import Placement, copies_by_tree, copy_tree


@dataclass(frozen=True)
class Bundle:
    """Experts with one owner and one set of holders, moved as one message."""

    owner: int
    experts: tuple[int, ...]
    """Global expert ids, ascending."""
    holders: tuple[int, ...]
    """Non-owner holders, ascending."""
    everywhere: bool
    """The holders are every rank but the owner."""


@dataclass
class _Transfers:
    """Who sends what to whom for one placement, enumerated identically on every rank."""

    me: int
    """This rank's index in the group."""
    bundles: list[Bundle]
    """The bundles this rank owns or holds (in the order every rank enumerates them)."""
    stages: list[list[tuple[int, int, int]]]
    """The two stages of (bundle index, src, dst) tree edges that involve this rank (`copy_tree`;
    either may be empty)."""
    collective: list[int]
    """Bundles moved by one broadcast / reduce over the group (held everywhere, no tree)."""
    received: list[int]
    """Experts whose copies arrive here, in the row order of the received buffer."""
    row_start: dict[int, int]
    """Bundle index -> its first row in the received buffer (bundles this rank holds, not owns)."""
    chunks: int = 1
    """Column pieces of every tree message (`core.copy_rounds`); 1 where no tree of the placement has
    a second stage (nothing to overlap), the same on every rank."""

    def rows(self, b: int) -> slice:
        """Rows of the received buffer that hold bundle `b`'s experts (a bundle this rank holds)."""
        start = self.row_start[b]
        return slice(start, start + len(self.bundles[b].experts))

    @property
    def owned(self) -> list[int]:
        """Bundles this rank owns (it sends them and sums their gradients)."""
        return [b for b, bundle in enumerate(self.bundles) if bundle.owner == self.me]


def bundles_of(placement: Placement) -> list[Bundle]:
    """The placement's copies grouped by (owner, holders), in a fixed order: owner, then holders."""
    extra_EW = placement.materialized_EW()
    W = placement.world_size
    groups: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    for e in np.flatnonzero(extra_EW.any(1)):
        key = (int(placement.owner_E[e]), tuple(int(w) for w in np.flatnonzero(extra_EW[e])))
        groups.setdefault(key, []).append(int(e))
    return [
        Bundle(owner, tuple(experts), holders, len(holders) == W - 1)
        for (owner, holders), experts in sorted(groups.items())
    ]


def _transfers(
    placement: Placement, me: int, node_of: Sequence[int] | None, backend: str, chunks: int = 1
) -> _Transfers:
    """This rank's part of the placement's copies (module docstring): the bundles it owns or holds,
    their tree edges that involve it, and the bundles moved by a collective; `chunks` pieces per
    tree message where some tree has a second stage (`core.copy_rounds`)."""
    everywhere_tree = copies_by_tree(node_of, backend)
    stages: list[list[tuple[int, int, int]]] = [[], []]
    mine, collective, relayed = [], [], False
    for bundle in bundles_of(placement):
        if bundle.everywhere and not everywhere_tree:
            if bundle.owner == me or me in bundle.holders:
                collective.append(len(mine))
                mine.append(bundle)
            continue
        tree = copy_tree(bundle.owner, bundle.holders, node_of)
        relayed = relayed or bool(tree[1])  # every rank sees every tree: all agree on the pieces
        if bundle.owner == me or me in bundle.holders:
            for stage, edges in zip(stages, tree):
                stage += [(len(mine), src, dst) for src, dst in edges if me in (src, dst)]
            mine.append(bundle)
    received, row_start = [], {}
    for i, bundle in enumerate(mine):
        if bundle.owner != me:
            row_start[i] = len(received)
            received += bundle.experts
    return _Transfers(me, mine, stages, collective, received, row_start, chunks if relayed else 1)


def prefetch_transfers(placement: Placement, me: int, node_of: Sequence[int] | None) -> _Transfers:
    """The copies of `placement` as `strategies.prefetch` launches them asynchronously: partial replica
    sets along their trees, experts held everywhere one asynchronous broadcast / reduce per bundle
    (never through the trees, as on gloo across nodes in `materialize`)."""
    return _transfers(placement, me, node_of, "nccl")


@dataclass
class _Layout:
    """Where each held expert's weights come from, and the flat message layout of one expert."""

    owned_pos: torch.Tensor
    """Positions in `held_J` of the experts this rank owns."""
    owned_rows: torch.Tensor
    """Their rows in the local parameters."""
    recv_pos: torch.Tensor
    """Positions in `held_J` of the received copies, in the order of `_Transfers.received`."""
    sent_rows: list[int]
    """Local rows this rank sends (to partial replica sets, or held everywhere): only these are
    flattened into messages."""
    widths: list[int]
    """Elements of one expert in each parameter (the columns of a flat message)."""
    row_of: dict[int, int]
    """Global expert id -> its local row (the experts this rank owns)."""

    def rows(self, experts) -> list[int]:
        """Local rows of the owned `experts` (global ids)."""
        return [self.row_of[e] for e in experts]

    @property
    def sent_index(self) -> dict[int, int]:
        """Local row -> its row in `flat_sent`."""
        return {row: i for i, row in enumerate(self.sent_rows)}

    def flat_sent(self, local_params: list[torch.Tensor]) -> torch.Tensor:
        """The sent rows, one flat message each `[len(sent_rows), P]` (detached)."""
        rows = torch.tensor(self.sent_rows, dtype=torch.long, device=local_params[0].device)
        return torch.cat(
            [p.detach().index_select(0, rows).reshape(len(rows), w) for p, w in zip(local_params, self.widths)], dim=1
        )


def held_from_flat(layout: _Layout, local_params: list[torch.Tensor], recv_YP: torch.Tensor) -> tuple:
    """The held experts' weights: owned rows from `local_params`, copies from the received rows."""
    held = []
    for p, col in zip(local_params, _columns(layout.widths)):
        out = p.new_empty((len(layout.owned_pos) + len(layout.recv_pos), *p.shape[1:]))
        out.index_copy_(0, layout.owned_pos, p.detach().index_select(0, layout.owned_rows))
        out.index_copy_(0, layout.recv_pos, recv_YP[:, col].reshape(-1, *p.shape[1:]))
        held.append(out)
    return tuple(held)


def split_held_gradients(layout: _Layout, shapes: list, grad_held: tuple) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Backward of the held weights: the owned experts' gradients in the local parameters' shapes,
    and the copies' gradients as flat message rows `[Y, P]` (to be summed into their owners)."""
    grads = []
    for shape, g in zip(shapes, grad_held):
        grad = g.new_zeros(shape)
        grad.index_add_(0, layout.owned_rows, g.index_select(0, layout.owned_pos))
        grads.append(grad)
    n_recv = len(layout.recv_pos)
    grad_YP = torch.cat(
        [g.index_select(0, layout.recv_pos).reshape(n_recv, w) for g, w in zip(grad_held, layout.widths)], 1
    )
    return grads, grad_YP


def add_flat_rows(grads: list[torch.Tensor], layout: _Layout, rows: list[int], flat: torch.Tensor) -> None:
    """Add flat message rows `[len(rows), P]` into local rows `rows` of each parameter's gradient."""
    index = torch.tensor(rows, dtype=torch.long, device=flat.device)
    for grad, col in zip(grads, _columns(layout.widths)):
        grad.index_add_(0, index.to(grad.device), flat[:, col].reshape(len(rows), *grad.shape[1:]))


def _columns(widths: list[int]) -> list[slice]:
    offsets = np.concatenate([[0], np.cumsum(widths)])
    return [slice(int(a), int(b)) for a, b in zip(offsets[:-1], offsets[1:])]


class _Materialize(torch.autograd.Function):
    """forward: owner → holders copies along the trees, returning the weights of the held experts;
    backward: holders → owner gradient sums along the same trees reversed, written with the held
    experts' own gradients into one gradient per parameter (no full-size zero gradient beside the
    owned experts', nothing flattened but the experts that travel)."""

    @staticmethod
    def forward(ctx, plan, group, layout, *local_params):
        ctx.plan, ctx.group, ctx.layout = plan, group, layout
        ctx.shapes = [p.shape for p in local_params]
        flat_sent = layout.flat_sent(list(local_params))
        recv_YP = flat_sent.new_empty((len(plan.received), sum(layout.widths)))
        sent_index = layout.sent_index
        owned = {
            b: flat_sent[[sent_index[r] for r in layout.rows(plan.bundles[b].experts)]] for b in plan.owned
        }  # gathered once, sent in pieces

        def message(b: int) -> torch.Tensor:
            """Bundle b `[K, P]`: the owner's rows on the owner, the received rows elsewhere."""
            return owned[b] if b in owned else recv_YP[plan.rows(b)]

        # A relay forwards what it received: whole in a second round, or piece by piece (Hecate §4.1).
        copy_rounds(plan, message, lambda b: recv_YP[plan.rows(b)], group)
        for b in plan.collective:
            dist.broadcast(message(b), src=dist.get_global_rank(group, plan.bundles[b].owner), group=group)
        return held_from_flat(layout, list(local_params), recv_YP)

    @staticmethod
    def backward(ctx, *grad_held):
        plan, group, layout = ctx.plan, ctx.group, ctx.layout
        grads, grad_YP = split_held_gradients(layout, ctx.shapes, grad_held)
        partial = reduce_partials(plan, grad_YP, group)
        for b in plan.owned:
            add_flat_rows(grads, layout, layout.rows(plan.bundles[b].experts), partial[b])
        return (None, None, None, *grads)


def reduce_partials(plan: _Transfers, grad_YP: torch.Tensor, group) -> dict[int, torch.Tensor]:
    """reduce_to_owner along the trees reversed, then one reduce per collective bundle: per bundle
    this rank owns or relays, the sum of its holders' gradients (`[len(experts), P]`; the owner's
    own gradient excluded). Sums in a fixed order: own rows, then each sender's in edge order.
    `grad_YP` is consumed: a relay sums into its rows in place, piece by piece (no copy of them)."""
    me = plan.me
    partial = {
        b: grad_YP.new_zeros((len(bundle.experts), grad_YP.shape[1])) if bundle.owner == me else grad_YP[plan.rows(b)]
        for b, bundle in enumerate(plan.bundles)
    }
    reduce_rounds(plan, partial, group)  # a relay sums its node-mates' before sending on
    for b in plan.collective:
        buf = partial[b].clone()
        dist.reduce(buf, dst=dist.get_global_rank(group, plan.bundles[b].owner), op=dist.ReduceOp.SUM, group=group)
        partial[b] = buf
    return partial


def materialize(
    weights: dict[str, torch.Tensor],
    placement: Placement,
    group,
    expert_ids: Sequence[int],
    held_J: np.ndarray,
    node_of: Sequence[int] | None = None,
    chunks: int = 1,
) -> dict[str, torch.Tensor]:
    """Weights `[J, ...]` of the experts this rank holds (in `held_J` order), differentiable:
    owned experts (`expert_ids`: the global id of each local row) are this rank's own rows; the
    others arrive from their owners, and their gradients flow back to the owners (reduce_to_owner)
    in backward.

    `node_of` (node of every rank; None: one node) shapes the trees (`placement.copy_tree`): one
    transfer into each node that holds a copy; experts held everywhere go through the tree too when
    the ranks span nodes on gloo (`placement.copies_by_tree`), else by broadcast / reduce. Every rank
    of the group must call this, in the same order and with the same `node_of`, whenever the
    placement has any copy. `chunks` (>= 1, the same on every rank): column pieces of each tree
    message, a relay forwarding one while it receives the next (`core.copy_rounds`, Hecate §4.1);
    the results are the same bit for bit for every value.
    """
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be an integer >= 1, got {chunks!r}")
    names = list(weights)
    local = [weights[n] for n in names]
    plan = _transfers(placement, dist.get_rank(group), node_of, dist.get_backend(group), chunks)
    layout = flat_layout(weights, plan, expert_ids, held_J)
    return dict(zip(names, _Materialize.apply(plan, group, layout, *local)))


def flat_layout(
    weights: dict[str, torch.Tensor], plan: _Transfers, expert_ids: Sequence[int], held_J: np.ndarray
) -> _Layout:
    """Where each held expert's weights come from under `plan`, and the flat message layout
    (`expert_ids`: the global id of every local row)."""
    local = list(weights.values())
    row_of = {int(e): row for row, e in enumerate(expert_ids)}
    device = local[0].device
    held = [int(e) for e in held_J]
    received = {e: i for i, e in enumerate(plan.received)}
    owned = [j for j, e in enumerate(held) if e in row_of]
    recv_pos = [0] * len(received)
    for j, e in enumerate(held):
        if e in received:
            recv_pos[received[e]] = j
    sent_rows = sorted({row_of[e] for b in plan.owned for e in plan.bundles[b].experts})
    return _Layout(
        owned_pos=torch.tensor(owned, dtype=torch.long, device=device),
        owned_rows=torch.tensor([row_of[held[j]] for j in owned], dtype=torch.long, device=device),
        recv_pos=torch.tensor(recv_pos, dtype=torch.long, device=device),
        sent_rows=sent_rows,
        widths=[int(np.prod(w.shape[1:])) for w in local],
        row_of=row_of,
    )
