"""The rounds of point-to-point messages that move a placement's copy trees, with the chunk pipeline
of Hecate §4.1: a relay forwards chunk j of a bundle while it receives chunk j + 1.

`core.sparse_collectives` sends every tree-moved bundle along `placement.copy_tree`'s two stages
(owner → node-mates and one relay per other node; relay → its node's other holders). With `chunks`
c every message is split along its flat columns into c contiguous pieces (`torch.tensor_split` on
dim 1; a message narrower than c columns has empty pieces, which neither side sends), and the two
stages run in c + 1 rounds of one `batch_isend_irecv` each:

    copies (forward):    round r = stage 1's piece r (r < c)  beside  stage 2's piece r − 1 (r ≥ 1)
    sums (backward):     round r = stage 2 reversed, piece r  beside  stage 1 reversed, piece r − 1

so in round r a relay forwards (or, backward, sends on its summed) piece r − 1, which arrived in
round r − 1, while piece r comes in. c = 1 is two rounds, the stages one after the other. Every
rank enumerates the same edges in the same order (`_Transfers.stages`) and the same pieces, so a
pair's messages match in each round. A relay sums a piece exactly as it sums the whole message
(its own rows, then each node-mate's in edge order; at the owner its node-mates' and the relays' in
edge order): elementwise the same additions in the same order, so any c gives the c = 1 result bit
for bit.

What it buys (`perf.copies_pricing.pipelined_trees`): the two stages overlap, (t₁/c + l₁) +
(c − 1)·max(t₁/c + l₁, t₂/c + l₂) + (t₂/c + l₂) for stage times t and latencies l instead of
t₁ + l₁ + t₂ + l₂; it pays where the second stage is slow (a PCIe node) and the experts big. A layer
whose trees have no second stage anywhere sends its messages whole (`_Transfers.chunks` is then 1):
rounds of one stage would only add latencies.

Shape suffixes: K rows of one bundle (its experts), P flattened parameters of one expert.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


def batched_p2p(send: list[tuple[int, torch.Tensor]], recv: list[tuple[int, torch.Tensor]], group) -> None:
    """One round: every send and receive posted in one `batch_isend_irecv`, then waited on."""
    ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(group, peer), group) for peer, t in send]
    ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(group, peer), group) for peer, t in recv]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def piece(rows_KP: torch.Tensor, chunks: int, r: int) -> torch.Tensor:
    """Piece r of a bundle's message `[K, P]`: contiguous columns (`tensor_split` on dim 1), a view."""
    return rows_KP.tensor_split(chunks, dim=1)[r] if chunks > 1 else rows_KP


def _receiver(view_KP: torch.Tensor) -> torch.Tensor:
    """Where a piece lands: the view itself when contiguous, else a buffer copied into it after the round
    (gloo receives into contiguous tensors only)."""
    if view_KP.is_contiguous():
        return view_KP
    return torch.empty(view_KP.shape, dtype=view_KP.dtype, device=view_KP.device)


def _schedule(chunks: int, r: int, stages: list) -> list[tuple[list, int]]:
    """The (edges, piece) pairs of round r: `stages[0]`'s piece r, then `stages[1]`'s piece r − 1."""
    return [(edges, p) for edges, p in ((stages[0], r), (stages[1], r - 1)) if 0 <= p < chunks]


def copy_rounds(plan, message: Callable[[int], torch.Tensor], landing: Callable[[int], torch.Tensor], group) -> None:
    """The copies along the trees (module docstring): `message(b)` is bundle b's rows as this rank
    sends them (the owner's own, or a relay's received rows), `landing(b)` where bundle b's rows
    arrive here (a relay's received rows are its `message`, filled piece by piece before it
    forwards them)."""
    me, chunks = plan.me, plan.chunks
    for r in range(chunks + 1):
        sends, recvs, landed = [], [], []
        for edges, p in _schedule(chunks, r, plan.stages):
            for b, src, dst in edges:
                if src == me and (part := piece(message(b), chunks, p)).shape[1]:
                    sends.append((dst, part.contiguous()))
            for b, src, dst in edges:
                if dst == me and (part := piece(landing(b), chunks, p)).shape[1]:
                    buf = _receiver(part)
                    recvs.append((src, buf))
                    landed.append((part, buf))
        batched_p2p(sends, recvs, group)
        for part, buf in landed:
            if buf is not part:
                part.copy_(buf)


def reduce_rounds(plan, partial: dict[int, torch.Tensor], group) -> None:
    """The gradient sums along the trees reversed (module docstring), in place: `partial[b]` holds
    this rank's rows of bundle b (zeros at its owner); a relay adds its node-mates' pieces to its own
    before it sends them on, the owner the relays' and its node-mates' (each in edge order)."""
    me, chunks = plan.me, plan.chunks
    reversed_stages = [plan.stages[1], plan.stages[0]]
    for r in range(chunks + 1):
        sends, recvs, inbox = [], [], []
        for edges, p in _schedule(chunks, r, reversed_stages):
            for b, src, dst in edges:
                if dst == me and (part := piece(partial[b], chunks, p)).shape[1]:
                    sends.append((src, part.contiguous()))
            for b, src, dst in edges:
                if src == me and (part := piece(partial[b], chunks, p)).shape[1]:
                    buf = torch.empty(part.shape, dtype=part.dtype, device=part.device)
                    recvs.append((dst, buf))
                    inbox.append((part, buf))
        batched_p2p(sends, recvs, group)
        for part, buf in inbox:  # in edge order: the order of the sums whatever the chunks
            part.add_(buf)
