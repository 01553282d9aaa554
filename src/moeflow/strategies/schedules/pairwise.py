"""FasterMoE's smart fine-grained schedule (PPoPP'22 §4.2; SPEC.md §1.3).

The W ranks form n groups of G consecutive ranks (close-connected ranks share a group). The
dispatch → experts → combine block becomes n steps of a grouped pairwise exchange; in step s a
rank of group g runs
    S_s  send its tokens for group (g − s) mod n, receive the tokens of group (g + s) mod n
    C_s  compute the received tokens with the experts it holds
    R_s  send those outputs back to group (g + s) mod n, receive its own outputs from (g − s) mod n
with S_s → C_s → R_s. Communication is asynchronous (batched point-to-point requests running on
the backend's threads) while the main thread computes, so C_s overlaps S_{s+1} and R_{s−1}. S and
R are separate requests, not one stream: R_0 does not wait for every S (the public code's
single-stream weakness). Step 0 is the own group (fastest links) and step n − 1 the ring step
between neighbouring groups, so the exposed first S and last R are the cheapest.

Backward is scheduled the same way: every exchange is an autograd pair (`_Start`, `_Finish`); the
backward of `_Finish` posts the reverse exchange and the backward of `_Start` waits for it, so the
autograd engine runs the experts' backward of other steps in between. Every message carries a tag
unique to (layer call, step, S/R, forward/backward), so ranks cannot mismatch messages whatever
order their engines pick. Numerics are those of the synchronous all-to-all (tested).

Shape suffixes: A rows this rank sends (ordered by destination, then expert), R rows received,
D d_model, S source ranks of a step, H experts held by this rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

# Tags: call (mod 2^20) × 64 + step × 4 + kind; kinds below. Steps are at most 16 (W / G <= 16).
_S_FWD, _R_FWD, _S_BWD, _R_BWD = range(4)
MAX_STEPS = 16


def default_group_size(world: int, node_of: Sequence[int] | None) -> int:
    """FasterMoE §4.2: close-connected workers in one group — the ranks of a node when the topology
    is known (so step 0 stays inside the node), else one rank per group."""
    if node_of is None:
        return 1
    size = sum(1 for n in node_of if n == node_of[0])
    return size if world % size == 0 else 1


def step_peers(me: int, world: int, group_size: int, step: int) -> tuple[list[int], list[int]]:
    """(ranks I send tokens to, ranks I receive tokens from) in `step`."""
    n = world // group_size
    g = me // group_size
    target, source = (g - step) % n, (g + step) % n
    return (
        list(range(target * group_size, (target + 1) * group_size)),
        list(range(source * group_size, (source + 1) * group_size)),
    )


class _Exchange:
    """One asynchronous pairwise exchange and, later, its reverse for the gradients."""

    def __init__(self, group, sends: list[tuple[int, int, int]], recvs: list[tuple[int, int, int]], me, tags):
        # sends / recvs: (peer, row offset, rows) of the local send buffer / of the receive buffer.
        self.group, self.sends, self.recvs, self.me = group, sends, recvs, me
        self.fwd_tag, self.bwd_tag = tags
        self.works: list = []

    def _post(self, out_rows, width, src_buf, sends, recvs, tag, zeros=False):
        # Backward of S fills only this step's rows of the sent buffer: the others must be 0
        # (autograd sums the contributions of all steps).
        out = src_buf.new_zeros((out_rows, width)) if zeros else src_buf.new_empty((out_rows, width))
        ops = []
        for peer, off, rows in sends:
            if peer == self.me or rows == 0:
                continue
            ops.append(dist.P2POp(dist.isend, src_buf[off : off + rows], self._global(peer), self.group, tag))
        local_src = {peer: (off, rows) for peer, off, rows in sends if peer == self.me}
        for peer, off, rows in recvs:
            if rows == 0:
                continue
            if peer == self.me:
                s_off, _ = local_src[peer]
                out[off : off + rows] = src_buf[s_off : s_off + rows]
            else:
                ops.append(dist.P2POp(dist.irecv, out[off : off + rows], self._global(peer), self.group, tag))
        self.works = dist.batch_isend_irecv(ops) if ops else []
        return out

    def _global(self, peer):
        return dist.get_global_rank(self.group, peer)

    def start_forward(self, x_AD: torch.Tensor) -> None:
        self.send_rows, self.width = x_AD.shape[0], x_AD.shape[1]
        self.src = x_AD.contiguous()  # kept alive until the sends complete
        rows = sum(r for _, _, r in self.recvs)
        self.out = self._post(rows, self.width, self.src, self.sends, self.recvs, self.fwd_tag)

    def finish(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        self.works, self.src = [], None
        return self.out

    def start_backward(self, grad_RD: torch.Tensor) -> None:
        self.src = grad_RD.contiguous()
        # Reverse: what was received is sent back, what was sent is received.
        self.out = self._post(self.send_rows, self.width, self.src, self.recvs, self.sends, self.bwd_tag, zeros=True)


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_AD, exchange: _Exchange):
        ctx.exchange = exchange
        exchange.start_forward(x_AD)
        return x_AD.new_empty(0)  # a token that orders _Finish after _Start in the graph

    @staticmethod
    def backward(ctx, _):
        return ctx.exchange.finish(), None


class _Finish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token, exchange: _Exchange):
        ctx.exchange = exchange
        return exchange.finish()

    @staticmethod
    def backward(ctx, grad_RD):
        ctx.exchange.start_backward(grad_RD)
        return grad_RD.new_empty(0), None


def _blocks(peers: list[int], splits: Sequence[int], offsets: Sequence[int]) -> list[tuple[int, int, int]]:
    return [(p, int(offsets[p]), int(splits[p])) for p in peers]


def pairwise_block(
    x_sent_AD: torch.Tensor,
    send_splits: Sequence[int],
    recv_counts_SH: np.ndarray,
    compute: Callable[[torch.Tensor, np.ndarray], torch.Tensor],
    group,
    group_size: int,
    call_id: int,
    hooks: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Dispatch → experts → combine as n overlapped pairwise steps; returns the outputs of this
    rank's sent rows, in send order (what the synchronous combine returns).

    `recv_counts_SH[s, h]`: rows source s sends this rank for held expert h (source-major, held
    experts in order, exactly as the synchronous path receives them). `compute(x_RD, counts_SH)`
    runs the held experts on rows of that layout and returns outputs in the same layout.
    """
    world, me = dist.get_world_size(group), dist.get_rank(group)
    if group_size < 1 or world % group_size:
        raise ValueError(f"pairwise group_size={group_size} must divide the expert-parallel size {world}")
    steps = world // group_size
    if steps > MAX_STEPS:
        raise ValueError(f"pairwise: {steps} steps (world {world} / group_size {group_size}) exceeds {MAX_STEPS}")
    hooks = hooks or (lambda point, t: t)
    recv_splits = recv_counts_SH.sum(1)
    send_offsets = np.concatenate([[0], np.cumsum(send_splits)[:-1]])
    base = (call_id % (1 << 20)) * 64
    outputs: dict[int, torch.Tensor] = {}
    sent = hooks("before_dispatch", x_sent_AD)

    def post_s(step):
        targets, sources = step_peers(me, world, group_size, step)
        recv_off = np.concatenate([[0], np.cumsum([recv_splits[p] for p in sources])[:-1]])
        exchange = _Exchange(
            group,
            _blocks(targets, send_splits, send_offsets),
            [(p, int(recv_off[i]), int(recv_splits[p])) for i, p in enumerate(sources)],
            me,
            (base + 4 * step + _S_FWD, base + 4 * step + _S_BWD),
        )
        return exchange, _Start.apply(sent, exchange), sources, targets

    pending_s = post_s(0)
    pending_r = []
    for step in range(steps):
        exchange, token, sources, targets = pending_s
        if step + 1 < steps:
            pending_s = post_s(step + 1)  # S_{s+1} in flight while C_s computes
        x_recv_RD = hooks("after_dispatch", _Finish.apply(token, exchange))
        y_recv_RD = hooks("before_combine", compute(x_recv_RD, recv_counts_SH[sources]))
        # R_s: outputs back to this step's sources; receive my outputs from this step's targets.
        recv_off = np.concatenate([[0], np.cumsum([recv_splits[p] for p in sources])[:-1]])
        out_rows = [int(send_splits[p]) for p in targets]
        out_off = np.concatenate([[0], np.cumsum(out_rows)[:-1]])
        r_exchange = _Exchange(
            group,
            [(p, int(recv_off[i]), int(recv_splits[p])) for i, p in enumerate(sources)],
            [(p, int(out_off[i]), out_rows[i]) for i, p in enumerate(targets)],
            me,
            (base + 4 * step + _R_FWD, base + 4 * step + _R_BWD),
        )
        pending_r.append((r_exchange, _Start.apply(y_recv_RD, r_exchange), targets, out_rows))

    for r_exchange, token, targets, out_rows in pending_r:
        back = _Finish.apply(token, r_exchange)
        for piece, peer in zip(torch.split(back, out_rows), targets):
            outputs[peer] = piece
    y_back_AD = torch.cat([outputs[p] for p in range(world)], dim=0)
    return hooks("after_combine", y_back_AD)
