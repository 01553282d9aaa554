"""Sparse collectives over a `Placement` (Hecate §3 spAG/spRS; Pro-Prophet §IV-A Trans/Agg).

`materialize` copies each expert's parameters from its owner to the other holders; its backward is
`reduce_to_owner`: every holder's gradient for a copy is sent back and summed into the owner's
parameter gradient. Only parameters and gradients move — the optimizer state stays with the owner
(FasterMoE §4.1, Pro-Prophet §IV-A). Implemented as batched point-to-point (`batch_isend_irecv`),
one flat message per (expert, holder), so arbitrary subsets work without building subgroups. Experts
held by every rank (FasterMoE shadowing) move as one message per owner: through one broadcast / reduce
per owner (a pipelined ring with NCCL), or, with gloo across nodes, through the two-level tree of
`placement.broadcast_tree` (each inter-node link carries them once; all owners at the same time).

Shape suffixes: L experts owned by this rank, J experts held (computed) by this rank, P flattened
parameters of one expert, M messages (copies received by this rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from moeflow.core.placement import Placement, broadcast_tree, copies_by_tree


@dataclass
class _Transfers:
    """Who sends what to whom for one placement, enumerated identically on every rank."""

    me: int
    """This rank's index in the group."""
    sends: list[tuple[int, int]]
    """(expert, holder) pairs this rank sends point-to-point, as owner of a partial replica set."""
    recvs: list[tuple[int, int]]
    """(expert, owner) pairs this rank receives point-to-point."""
    everywhere: dict[int, list[int]]
    """owner -> its experts held by *every* rank (FasterMoE shadowing), moved as one message."""
    tree: list[list[tuple[int, int, int]]] | None
    """Stages of (owner, src, dst) edges that involve this rank (`placement.broadcast_tree`, see
    `copies_by_tree`); None: one broadcast / reduce per owner over the whole group."""
    received: list[int]
    """Experts whose copies arrive here, in the row order of the received buffer."""

    def rows(self, owner: int) -> slice:
        """Rows of the received buffer that hold `owner`'s everywhere-experts (owner != this rank)."""
        start = len(self.recvs)
        for o, experts in self.everywhere.items():
            if o == owner:
                return slice(start, start + len(experts))
            start += len(experts) if o != self.me else 0
        raise KeyError(owner)


def _transfers(placement: Placement, me: int, node_of: Sequence[int] | None, backend: str) -> _Transfers:
    """Experts replicated on every rank go as one message per owner (FasterMoE Eq. 8: each link
    carries the parameters once); partial replica sets (Pro-Prophet, Hecate) through batched
    point-to-point, which works for arbitrary subsets without subgroups."""
    extra_EW = placement.materialized_EW()
    everywhere_E = placement.holders_EW.all(1) & extra_EW.any(1)
    sends, recvs = [], []
    for e, d in zip(*np.nonzero(extra_EW & ~everywhere_E[:, None])):
        owner = int(placement.owner_E[e])
        if owner == me:
            sends.append((int(e), int(d)))
        elif d == me:
            recvs.append((int(e), owner))
    everywhere: dict[int, list[int]] = {}
    for e in np.flatnonzero(everywhere_E):
        everywhere.setdefault(int(placement.owner_E[e]), []).append(int(e))
    everywhere = dict(sorted(everywhere.items()))
    tree = None
    if copies_by_tree(node_of, backend) and everywhere:
        tree = [[], []]
        for owner in everywhere:
            for stage, edges in zip(tree, broadcast_tree(owner, node_of)):
                stage += [(owner, src, dst) for src, dst in edges if me in (src, dst)]
    received = [e for e, _ in recvs] + [e for o, es in everywhere.items() if o != me for e in es]
    return _Transfers(me, sends, recvs, everywhere, tree, received)


def prefetch_transfers(placement: Placement, me: int) -> _Transfers:
    """The copies of `placement` as `strategies.prefetch` launches them asynchronously: partial replica
    sets point-to-point, experts held everywhere one broadcast / reduce per owner — never the
    two-stage tree, whose second stage would have to wait for the first."""
    return _transfers(placement, me, None, "nccl")


def batched_p2p(send: list[tuple[int, torch.Tensor]], recv: list[tuple[int, torch.Tensor]], group) -> None:
    ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(group, peer), group) for peer, t in send]
    ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(group, peer), group) for peer, t in recv]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


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


def held_from_flat(layout: _Layout, local_params: list[torch.Tensor], recv_MP: torch.Tensor) -> tuple:
    """The held experts' weights: owned rows from `local_params`, copies from the received rows."""
    held = []
    for p, col in zip(local_params, _columns(layout.widths)):
        out = p.new_empty((len(layout.owned_pos) + len(layout.recv_pos), *p.shape[1:]))
        out.index_copy_(0, layout.owned_pos, p.detach().index_select(0, layout.owned_rows))
        out.index_copy_(0, layout.recv_pos, recv_MP[:, col].reshape(-1, *p.shape[1:]))
        held.append(out)
    return tuple(held)


def split_held_gradients(layout: _Layout, shapes: list, grad_held: tuple) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Backward of the held weights: the owned experts' gradients in the local parameters' shapes,
    and the copies' gradients as flat message rows `[M, P]` (to be summed into their owners)."""
    grads = []
    for shape, g in zip(shapes, grad_held):
        grad = g.new_zeros(shape)
        grad.index_add_(0, layout.owned_rows, g.index_select(0, layout.owned_pos))
        grads.append(grad)
    n_recv = len(layout.recv_pos)
    grad_MP = torch.cat(
        [g.index_select(0, layout.recv_pos).reshape(n_recv, w) for g, w in zip(grad_held, layout.widths)], 1
    )
    return grads, grad_MP


def add_flat_rows(grads: list[torch.Tensor], layout: _Layout, rows: list[int], flat: torch.Tensor) -> None:
    """Add flat message rows `[len(rows), P]` into local rows `rows` of each parameter's gradient."""
    index = torch.tensor(rows, dtype=torch.long, device=flat.device)
    for grad, col in zip(grads, _columns(layout.widths)):
        grad.index_add_(0, index.to(grad.device), flat[:, col].reshape(len(rows), *grad.shape[1:]))


def _columns(widths: list[int]) -> list[slice]:
    offsets = np.concatenate([[0], np.cumsum(widths)])
    return [slice(int(a), int(b)) for a, b in zip(offsets[:-1], offsets[1:])]


class _Materialize(torch.autograd.Function):
    """forward: owner → holders copies, returning the weights of the held experts; backward:
    holders → owner gradient sums, written with the held experts' own gradients into one gradient
    per parameter (no full-size zero gradient beside the owned experts', nothing flattened but the
    experts that travel)."""

    @staticmethod
    def forward(ctx, plan, group, layout, *local_params):
        me, row_of = plan.me, layout.row_of
        ctx.plan, ctx.group, ctx.layout = plan, group, layout
        ctx.shapes = [p.shape for p in local_params]
        sent_index = layout.sent_index
        flat_sent = layout.flat_sent(list(local_params))
        recv_MP = flat_sent.new_empty((len(plan.received), sum(layout.widths)))
        batched_p2p(
            [(peer, flat_sent[sent_index[row_of[e]]]) for e, peer in plan.sends],
            [(peer, recv_MP[i]) for i, (_, peer) in enumerate(plan.recvs)],
            group,
        )

        def message(owner: int) -> torch.Tensor:
            """`owner`'s everywhere-experts: the local rows on the owner, the received rows elsewhere."""
            if owner == me:
                return flat_sent[[sent_index[row_of[e]] for e in plan.everywhere[owner]]]
            return recv_MP[plan.rows(owner)]

        if plan.tree is None:
            for owner in plan.everywhere:
                dist.broadcast(message(owner), src=dist.get_global_rank(group, owner), group=group)
        else:
            for stage in plan.tree:  # a leader forwards in stage 2 what it received in stage 1
                batched_p2p(
                    [(dst, message(owner)) for owner, src, dst in stage if src == me],
                    [(src, recv_MP[plan.rows(owner)]) for owner, src, dst in stage if dst == me],
                    group,
                )
        return held_from_flat(layout, list(local_params), recv_MP)

    @staticmethod
    def backward(ctx, *grad_held):
        plan, group, layout, me = ctx.plan, ctx.group, ctx.layout, ctx.plan.me
        grads, grad_MP = split_held_gradients(layout, ctx.shapes, grad_held)
        width = grad_MP.shape[1]

        def add_rows(rows: list[int], flat: torch.Tensor) -> None:
            add_flat_rows(grads, layout, rows, flat)

        # reduce_to_owner: every holder's gradient for a copy is summed into the owner's row.
        incoming = grad_MP.new_empty((len(plan.sends), width))
        batched_p2p(
            [(peer, grad_MP[i]) for i, (_, peer) in enumerate(plan.recvs)],
            [(peer, incoming[i]) for i, (_, peer) in enumerate(plan.sends)],
            group,
        )
        if plan.sends:
            add_rows(layout.rows(e for e, _ in plan.sends), incoming)
        # Per owner of everywhere-experts: this rank's partial sum of their gradients.
        partial = {
            owner: grad_MP.new_zeros((len(rows), width)) if owner == me else grad_MP[plan.rows(owner)].clone()
            for owner, rows in plan.everywhere.items()
        }
        if plan.tree is None:
            for owner in plan.everywhere:
                dist.reduce(partial[owner], dst=dist.get_global_rank(group, owner), op=dist.ReduceOp.SUM, group=group)
        else:
            for stage in reversed(plan.tree):  # a leader sums its node-mates' before sending on
                inbox = [(owner, dst, torch.empty_like(partial[owner])) for owner, src, dst in stage if src == me]
                batched_p2p(
                    [(src, partial[owner]) for owner, src, dst in stage if dst == me],
                    [(dst, buf) for _, dst, buf in inbox],
                    group,
                )
                for owner, _, buf in inbox:
                    partial[owner] += buf
        if me in plan.everywhere:
            add_rows(layout.rows(plan.everywhere[me]), partial[me])
        return (None, None, None, *grads)


def materialize(
    weights: dict[str, torch.Tensor],
    placement: Placement,
    group,
    expert_ids: Sequence[int],
    held_J: np.ndarray,
    node_of: Sequence[int] | None = None,
) -> dict[str, torch.Tensor]:
    """Weights `[J, ...]` of the experts this rank holds (in `held_J` order), differentiable:
    owned experts (`expert_ids`: the global id of each local row) are this rank's own rows; the
    others arrive from their owners, and their gradients flow back to the owners (reduce_to_owner)
    in backward.

    `node_of` (node of every rank; None: one node) routes copies of experts held everywhere through
    a two-level tree when the ranks span nodes on gloo (`placement.copies_by_tree`). Every rank of
    the group must call this, in the same order and with the same `node_of`, whenever the placement
    has any copy.
    """
    names = list(weights)
    local = [weights[n] for n in names]
    plan = _transfers(placement, dist.get_rank(group), node_of, dist.get_backend(group))
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
    sent_rows = sorted({row_of[e] for e, _ in plan.sends} | {row_of[e] for e in plan.everywhere.get(plan.me, [])})
    return _Layout(
        owned_pos=torch.tensor(owned, dtype=torch.long, device=device),
        owned_rows=torch.tensor([row_of[held[j]] for j in owned], dtype=torch.long, device=device),
        recv_pos=torch.tensor(recv_pos, dtype=torch.long, device=device),
        sent_rows=sent_rows,
        widths=[int(np.prod(w.shape[1:])) for w in local],
        row_of=row_of,
    )
