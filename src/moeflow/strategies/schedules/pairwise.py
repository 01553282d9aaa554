"""`schedule="pairwise"`: FasterMoE's smart fine-grained schedule (PPoPP'22 §4.2).

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

The sent rows are split once into one piece per target group (rows are ordered by destination, so
a group's rows are contiguous); each step's exchange takes its piece, so the backward of a step
returns a gradient the size of that piece and autograd concatenates them once (no buffer the size
of all sent rows per step).

Shape suffixes: A rows this rank sends (ordered by destination, then expert), R rows received,
D d_model, S source ranks of a step, J experts held by this rank, W ranks; ``...`` = batch dims of
a simulation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from moeflow.core.checks import positive_int
from moeflow.core.exchange import ExchangeBlock
from moeflow.strategies.schedules.base import PredictedBlock, Schedule, StepLoad
from moeflow.strategies.schedules.sync import SyncSchedule

# Tags: call (mod 2^20) × 64 + step × 4 + kind; kinds below. Steps are at most 16 (W / G <= 16).
_S_FWD, _R_FWD, _S_BWD, _R_BWD = range(4)
MAX_STEPS = 16


def default_group_size(world: int, node_of: Sequence[int] | None) -> int:
    """FasterMoE §4.2: close-connected workers in one group — the ranks of a node when the topology
    has several nodes (so step 0 stays inside the node), else one rank per group (a single group
    would leave nothing to overlap)."""
    if node_of is None or len(set(node_of)) < 2:
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

    def _post(self, out_rows, width, src_buf, sends, recvs, tag):
        # Every row of `out` is received (or copied from this rank): a piece of the sent buffer
        # holds exactly the rows of one group, so its backward fills all of them.
        out = src_buf.new_empty((out_rows, width))
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
        self.out = self._post(self.send_rows, self.width, self.src, self.recvs, self.sends, self.bwd_tag)


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


def pairwise_block(
    x_sent_AD: torch.Tensor,
    send_splits: Sequence[int],
    recv_counts_SJ: np.ndarray,
    compute: Callable[[torch.Tensor, np.ndarray], torch.Tensor],
    group,
    group_size: int,
    call_id: int,
    hooks: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """Dispatch → experts → combine as n overlapped pairwise steps; returns the outputs of this
    rank's sent rows, in send order (what the synchronous combine returns). One function, long, so
    that the order in which S, C and R of the steps are posted reads as FasterMoE §4.2 lays it out.

    `recv_counts_SJ[s, j]`: rows source s sends this rank for held expert j (source-major, held
    experts in order, exactly as the synchronous path receives them). `compute(x_RD, counts_SJ)`
    runs the held experts on rows of that layout and returns outputs in the same layout.
    """
    world, me = dist.get_world_size(group), dist.get_rank(group)
    if group_size < 1 or world % group_size:
        raise ValueError(f"pairwise group_size={group_size} must divide the expert-parallel size {world}")
    steps = world // group_size
    if steps > MAX_STEPS:
        raise ValueError(f"pairwise: {steps} steps (world {world} / group_size {group_size}) exceeds {MAX_STEPS}")
    hooks = hooks or (lambda point, t, **_: t)
    recv_splits = recv_counts_SJ.sum(1)
    base = (call_id % (1 << 20)) * 64
    outputs: dict[int, torch.Tensor] = {}
    sent = hooks("before_dispatch", x_sent_AD)
    group_rows = [int(sum(send_splits[g * group_size : (g + 1) * group_size])) for g in range(steps)]
    pieces = torch.split(sent, group_rows)  # one autograd node: backward concatenates the pieces

    def post_s(step):
        targets, sources = step_peers(me, world, group_size, step)
        piece = pieces[targets[0] // group_size]
        piece_off = np.concatenate([[0], np.cumsum([send_splits[p] for p in targets])[:-1]])
        recv_off = np.concatenate([[0], np.cumsum([recv_splits[p] for p in sources])[:-1]])
        exchange = _Exchange(
            group,
            [(p, int(piece_off[i]), int(send_splits[p])) for i, p in enumerate(targets)],
            [(p, int(recv_off[i]), int(recv_splits[p])) for i, p in enumerate(sources)],
            me,
            (base + 4 * step + _S_FWD, base + 4 * step + _S_BWD),
        )
        return exchange, _Start.apply(piece, exchange), sources, targets

    pending_s = post_s(0)
    pending_r = []
    for step in range(steps):
        exchange, token, sources, targets = pending_s
        if step + 1 < steps:
            pending_s = post_s(step + 1)  # S_{s+1} in flight while C_s computes
        piece = {"first": step == 0, "last": step == steps - 1}  # marks of the block run once (`core.hooks`)
        x_recv_RD = hooks("after_dispatch", _Finish.apply(token, exchange), **piece)
        y_recv_RD = hooks("before_combine", compute(x_recv_RD, recv_counts_SJ[sources]), **piece)
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


@dataclass(frozen=True)
class PairwiseOptions:
    """Options of `schedule="pairwise"` (`--set moe.schedule_options.group_size=...`)."""

    group_size: int | None = None
    """G, ranks per group (close-connected ranks share one); None: the ranks of a node of the cost
    model's topology, else 1 (`default_group_size`)."""

    def __post_init__(self) -> None:
        if self.group_size is not None:
            positive_int("group_size", self.group_size)


class PairwiseSchedule(Schedule):
    """FasterMoE's smart schedule as a `schedule` axis object (module docstring)."""

    def __init__(self, options: PairwiseOptions | None = None) -> None:
        self.options = options or PairwiseOptions()

    def group_size(self, world: int, node_of: Sequence[int] | None) -> int:
        size = self.options.group_size or default_group_size(world, node_of)
        if world % size:
            raise ValueError(f"pairwise group_size={size} must divide the expert-parallel size {world}")
        return size

    def runs_with(self, dispatcher) -> bool:
        return dispatcher.name == "a2a"

    def check_dispatcher(self, dispatcher) -> None:
        if not self.runs_with(dispatcher):
            raise ValueError(
                f"schedule='pairwise' exchanges point-to-point between groups and runs with dispatch='a2a' "
                f"only (got dispatch={dispatcher.name!r})"
            )

    def execute(self, block: ExchangeBlock) -> torch.Tensor:
        if block.group is None:  # one process: nothing to overlap
            return SyncSchedule().execute(block)
        world = len(block.send_splits)
        return pairwise_block(
            block.x_sent_AD,
            block.send_splits,
            block.counts_SJ,
            block.compute,
            block.group,
            self.group_size(world, block.node_of),
            block.call_id,
            hooks=block.hooks,
        )

    def predict(self, step: StepLoad, cost_model, dispatcher) -> PredictedBlock:
        """FasterMoE §4.2 on every rank: n = W/G steps; in step s group g exchanges with group
        (g − s) mod n. The step's token exchanges S_s and returns R_s are priced on the pairs they
        use; every rank runs its own pipeline — S_0, then per step its compute C_{s,w} overlapped
        with S_{s+1} and R_{s−1} (one communication stream), then R_{n−1} — and the block ends with
        the slowest rank. Ranks compute independently: a rank idle in one step does not wait for
        the slowest rank of that step (only for the exchanges). Backward mirrors it with twice the
        compute per step."""
        send = np.asarray(step.send_tokens_WW, dtype=np.float64)
        W = send.shape[-1]
        G = self.group_size(W, step.node_of)
        n = W // G
        lead = send.shape[:-2]
        send_b = send * step.shape.d_model * cost_model.bytes_per_element
        send_P = (send_b * (1.0 - np.eye(W))).reshape(*lead, W * W)
        tokens_P = send.reshape(*lead, W * W)
        experts_W = (np.asarray(step.computed_WE) > 0).sum(-1)  # GEMM launches: experts with tokens
        dst = np.repeat(np.arange(W), G)  # pairs ordered by destination, G sources each
        S, R, C = [], [], []
        for s in range(n):
            src = ((dst // G + s) % n) * G + np.tile(np.arange(G), W)
            fwd, back = src * W + dst, dst * W + src
            S.append(cost_model.a2a_time_pairs(send_P[..., fwd], fwd))
            R.append(cost_model.a2a_time_pairs(send_P[..., fwd], back))
            tokens_W = tokens_P[..., fwd].reshape(*lead, W, G).sum(-1)
            calls_W = np.where(tokens_W > 0, experts_W * step.shape.gemms, 0)
            C.append(
                cost_model.expert_forward_time(tokens_W, step.shape, calls_W)
                + cost_model.elementwise_time(tokens_W, step.shape)
            )

        def pipeline(scale: float) -> np.ndarray:
            t_W = (S[0] + R[-1])[..., None]
            for s in range(n):
                comm = (S[s + 1] if s + 1 < n else 0.0) + (R[s - 1] if s > 0 else 0.0)
                t_W = t_W + np.maximum(scale * C[s], np.asarray(comm)[..., None])
            return t_W.max(axis=-1)

        compute = 3 * cost_model.slowest(sum(C))
        comm = 2 * (sum(S) + sum(R))
        return PredictedBlock(pipeline(1.0) + pipeline(2.0), compute, comm)
