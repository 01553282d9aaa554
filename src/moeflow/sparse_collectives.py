"""Sparse collectives over a `Placement` (SPEC.md §6; Hecate §3 spAG/spRS; Pro-Prophet Trans/Agg).

`materialize` copies each expert's parameters from its owner to the other holders; its backward is
`reduce_to_owner`: every holder's gradient for a copy is sent back and summed into the owner's
parameter gradient. Only parameters and gradients move — the optimizer state stays with the owner
(FasterMoE §4.1, Pro-Prophet §IV-A). Implemented as batched point-to-point (`batch_isend_irecv`),
one flat message per (expert, holder), so arbitrary subsets work without building subgroups.

Shape suffixes: L experts owned by this rank, H experts held (computed) by this rank, P flattened
parameters of one expert, M messages (copies received by this rank).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from moeflow.placement import Placement


def _transfers(placement: Placement, me: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(expert, peer) pairs this rank sends (as owner) and receives (as holder), in a global order
    that both sides of every pair enumerate identically (expert, then holder rank)."""
    sends, recvs = [], []
    for e, d in zip(*np.nonzero(placement.materialized_EW())):
        owner = int(placement.owner_E[e])
        if owner == me:
            sends.append((int(e), int(d)))
        elif d == me:
            recvs.append((int(e), owner))
    return sends, recvs


def _p2p(send: list[tuple[int, torch.Tensor]], recv: list[tuple[int, torch.Tensor]], group) -> None:
    ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(group, peer), group) for peer, t in send]
    ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(group, peer), group) for peer, t in recv]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


class _Materialize(torch.autograd.Function):
    """forward: owner → holders copies; backward: holders → owner gradient sums."""

    @staticmethod
    def forward(ctx, placement, group, first_expert, *local_params):
        me = dist.get_rank(group)
        sends, recvs = _transfers(placement, me)
        ctx.sends, ctx.recvs, ctx.group, ctx.first = sends, recvs, group, first_expert
        ctx.shapes = [p.shape for p in local_params]
        ref = local_params[0]
        flat_LP = torch.cat([p.detach().reshape(p.shape[0], -1) for p in local_params], dim=1)
        recv_MP = ref.new_empty((len(recvs), flat_LP.shape[1]))
        _p2p(
            [(peer, flat_LP[e - first_expert].contiguous()) for e, peer in sends],
            [(peer, recv_MP[i]) for i, (_, peer) in enumerate(recvs)],
            group,
        )
        return recv_MP

    @staticmethod
    def backward(ctx, grad_MP):
        grad_MP = grad_MP.contiguous()
        shapes = ctx.shapes
        width = sum(int(np.prod(s[1:])) for s in shapes)
        incoming = grad_MP.new_empty((len(ctx.sends), width))
        _p2p(
            [(peer, grad_MP[i]) for i, (_, peer) in enumerate(ctx.recvs)],
            [(peer, incoming[i]) for i, (_, peer) in enumerate(ctx.sends)],
            ctx.group,
        )
        # Sum every holder's gradient into the owned expert's row (reduce_to_owner).
        grad_LP = grad_MP.new_zeros((shapes[0][0], width))
        if ctx.sends:
            rows = torch.tensor([e - ctx.first for e, _ in ctx.sends], device=grad_LP.device)
            grad_LP.index_add_(0, rows, incoming)
        grads, offset = [], 0
        for s in shapes:
            n = int(np.prod(s[1:]))
            grads.append(grad_LP[:, offset : offset + n].reshape(s))
            offset += n
        return (None, None, None, *grads)


def materialize(
    weights: dict[str, torch.Tensor], placement: Placement, group, first_expert: int, held_H: np.ndarray
) -> dict[str, torch.Tensor]:
    """Weights `[H, ...]` of the experts this rank holds (in `held_H` order), differentiable:
    owned experts are slices of `weights`; the others arrive from their owners, and their
    gradients flow back to the owners (reduce_to_owner) in backward.

    Every rank of the group must call this, in the same order, whenever the placement has any copy.
    """
    names = list(weights)
    local = [weights[n] for n in names]
    me = dist.get_rank(group)
    recv_MP = _Materialize.apply(placement, group, first_expert, *local)
    _, recvs = _transfers(placement, me)
    received = {e: i for i, (e, _) in enumerate(recvs)}
    num_local = local[0].shape[0]
    owned = [int(e) for e in held_H if first_expert <= e < first_expert + num_local]
    owned_rows = torch.tensor([e - first_expert for e in owned], dtype=torch.long, device=local[0].device)
    # Position of each held expert in cat([owned rows, received rows]).
    index = {e: i for i, e in enumerate(owned)}
    index.update({e: len(owned) + received[e] for e in held_H if int(e) in received})
    order_H = torch.tensor([index[int(e)] for e in held_H], dtype=torch.long, device=local[0].device)
    out, offset = {}, 0
    for name, w in zip(names, local):
        n = int(np.prod(w.shape[1:]))
        copies = recv_MP[:, offset : offset + n].reshape(-1, *w.shape[1:])
        out[name] = torch.cat([w.index_select(0, owned_rows), copies], dim=0).index_select(0, order_H)
        offset += n
    return out
