"""Token dispatch: count exchange, ordering (permutation), all-to-all-v inside autograd, regrouping.

The dispatcher's only collective besides the two all-to-alls is the count exchange: an all-gather
of each rank's per-expert counts, which gives *every* rank the global flow matrix. Planners need
that matrix (FasterMoE §4.1: the shadowing decision is made from it with no extra communication),
and every split size below is derived from it, identically on every rank. With `group=None` the
same code runs with W = 1 and the collectives become identities.

Shape suffixes: A assignments on this rank, R rows received, D d_model, W ranks, E experts,
S source rank, J held experts (experts this rank computes this iteration).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def exchange_counts(counts: list[torch.Tensor], group: dist.ProcessGroup | None) -> list[np.ndarray]:
    """All-gather per-expert count rows (each `[E]`: the counts dispatched, and the choices before
    capacity drops when they differ) in one collective → one global matrix `[W, E]` (int64 numpy)
    per row, identical on every rank. A list of one row returns it twice (choices = flow)."""
    counts = [c if c.dtype == torch.int64 else c.to(torch.int64) for c in counts]  # (bincount's already are)
    if group is None and len(counts) == 1:  # one process, dropless: the row itself, one copy to the host
        flow_WE = np.array(counts[0].cpu().numpy()[None])  # a copy: on the CPU `numpy()` shares memory
        return [flow_WE, flow_WE]
    # One row (dropless) needs no stack: one op fewer per call.
    rows_RE = counts[0][None] if len(counts) == 1 else torch.stack(counts)
    if group is None:
        gathered = rows_RE.cpu().numpy()[None]
    else:
        world = dist.get_world_size(group)
        # gloo and nccl both gather int64; the counts live on the compute device for nccl.
        out = torch.empty(world * rows_RE.numel(), dtype=torch.int64, device=rows_RE.device)
        dist.all_gather_single(out, rows_RE.contiguous().view(-1), group=group)
        gathered = out.view(world, *rows_RE.shape).cpu().numpy()
    # Copies: on the CPU `numpy()` shares the counts' memory, which the routing still reads.
    matrices = [np.array(gathered[:, r]) for r in range(rows_RE.shape[0])]
    return matrices if len(matrices) > 1 else matrices * 2


class _Exchange(torch.autograd.Function):
    """Rows out by `send_splits`, rows in by `recv_splits`, through `transport` (`_exchange`: one
    all_to_all_single; `_peer_exchange`: point-to-point with the peers that have rows); backward
    is the reverse exchange through the same transport (splits swapped)."""

    @staticmethod
    def forward(ctx, x_AD, send_splits, recv_splits, group, transport):
        ctx.send_splits, ctx.recv_splits, ctx.group, ctx.transport = send_splits, recv_splits, group, transport
        return transport(x_AD, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad_RD):
        return ctx.transport(grad_RD, ctx.recv_splits, ctx.send_splits, ctx.group), None, None, None, None


def _exchange(x_AD: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    out = x_AD.new_empty((sum(recv_splits), *x_AD.shape[1:]))
    dist.all_to_all_single(out, x_AD.contiguous(), recv_splits, send_splits, group=group)
    return out


def all_to_all_v(x_AD: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    """Rows `[sum(send_splits[:p]), ...)` go to peer p; rows from peer p arrive in rank order."""
    if group is None:
        return x_AD
    return _Exchange.apply(x_AD, list(send_splits), list(recv_splits), group, _exchange)


def _peer_exchange(x_AD: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    me = dist.get_rank(group)
    x_AD = x_AD.contiguous()
    out = x_AD.new_empty((sum(recv_splits), *x_AD.shape[1:]))
    send_off = np.concatenate([[0], np.cumsum(send_splits)]).astype(int)
    recv_off = np.concatenate([[0], np.cumsum(recv_splits)]).astype(int)
    ops = []
    for peer in range(len(send_splits)):
        rows_out, rows_in = send_splits[peer], recv_splits[peer]
        if peer == me:
            out[recv_off[me] : recv_off[me] + rows_in] = x_AD[send_off[me] : send_off[me] + rows_out]
            continue
        global_peer = dist.get_global_rank(group, peer)
        if rows_out:
            ops.append(dist.P2POp(dist.isend, x_AD[send_off[peer] : send_off[peer + 1]], global_peer, group))
        if rows_in:
            ops.append(dist.P2POp(dist.irecv, out[recv_off[peer] : recv_off[peer + 1]], global_peer, group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return out


def peer_exchange(x_AD: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    """`all_to_all_v` that talks only to the peers with rows to send or receive (point-to-point: a
    stage of the hierarchical all-to-all exchanges with a node's ranks, or with one rank per node)."""
    if group is None:
        return x_AD
    return _Exchange.apply(x_AD, list(send_splits), list(recv_splits), group, _peer_exchange)


def block_permutation(lengths: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Row permutation that reorders consecutive blocks of `lengths` into the block order `order`:
    `rows[perm]` lists block order[0]'s rows, then block order[1]'s, ... (each block's rows in place)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    picked = lengths[order]
    total = int(picked.sum())
    out_starts = np.cumsum(picked) - picked
    return np.repeat(starts[order] - out_starts, picked) + np.arange(total, dtype=np.int64)


def count_per_expert(expert_A: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 `[E]`: how many rows go to each expert (`torch.bincount(expert_A, minlength=E)` for ids
    in `[0, E)`). On the CPU it is that bincount (the fastest there); on an accelerator a scatter
    into E zeros (`scatter_counts`), because CUDA's bincount reads the largest id back to the host
    to size its output: two device synchronisations per count."""
    if expert_A.device.type == "cpu":
        return torch.bincount(expert_A, minlength=num_experts)
    return scatter_counts(expert_A, num_experts)


def scatter_counts(index_A: torch.Tensor, size: int) -> torch.Tensor:
    """int64 `[size]`: occurrences of each value of `index_A` (all in `[0, size)`), by a scatter-add
    of ones: the output's size is known beforehand, so nothing is read back to the host."""
    counts = torch.zeros(size, dtype=torch.int64, device=index_A.device)
    return counts.scatter_add_(0, index_A.to(torch.int64), torch.ones_like(index_A, dtype=torch.int64))


def remote_nodes_per_token(
    token_A: torch.Tensor, node_A: torch.Tensor, my_node: int, num_tokens: int, nodes: int
) -> torch.Tensor:
    """Distinct nodes other than `my_node` that the rows of a token go to (`node_A`: each row's
    destination node, in `[0, nodes)`), averaged over `num_tokens` tokens: a 0-dim float tensor on
    the rows' device. The (token, node) pairs are marked in a `[T · nodes]` mask — every row of a
    pair writes the same value, whether its node is another — so nothing is read back to the host
    (a `unique` of the remote pairs waits for the device to size its output)."""
    seen = torch.zeros(num_tokens * nodes, dtype=torch.bool, device=token_A.device)
    seen.index_put_((token_A * nodes + node_A,), node_A != my_node)
    return seen.sum().double() / num_tokens  # float64, as `count / tokens` in Python


def position_in_expert(expert_A: torch.Tensor, num_experts: int) -> torch.Tensor:
    """For each assignment, how many assignments to the same expert come before it (in `A` order):
    the priority rank used by capacity dropping and by the split of an expert's rows over holders."""
    order_A = torch.sort(expert_A, stable=True).indices
    counts_E = count_per_expert(expert_A, num_experts)
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    position_A = torch.empty_like(expert_A)
    position_A[order_A] = torch.arange(expert_A.numel(), device=expert_A.device) - starts_E[expert_A[order_A]]
    return position_A


def assignment_destinations(expert_A: torch.Tensor, plan_EW: np.ndarray) -> torch.Tensor:
    """Destination rank of each assignment of this rank, following its row of the dispatch plan.

    `plan_EW[e, d]` of this rank's assignments to expert e go to rank d; they are taken in
    assignment order (the priority order), the first `plan_EW[e, 0]` to rank 0, and so on.
    """
    num_experts, world = plan_EW.shape
    if world == 1 or expert_A.numel() == 0:
        return torch.zeros_like(expert_A)
    single_dest_E = plan_EW.argmax(1)
    if ((plan_EW > 0).sum(1) <= 1).all():  # owners only (plain EP): one destination per expert
        return torch.as_tensor(single_dest_E, device=expert_A.device)[expert_A]
    position_A = position_in_expert(expert_A, num_experts)
    bounds_EW = torch.as_tensor(np.cumsum(plan_EW, axis=1), device=expert_A.device)
    return (position_A[:, None] >= bounds_EW[expert_A]).sum(1)


def source_major_to_expert_major(counts_SJ: np.ndarray) -> np.ndarray | None:
    """Permutation that regroups received rows from (source, expert) blocks to (expert, source).

    Received rows arrive source by source, each source's rows ordered by expert; the experts want
    their rows contiguous. Returns `perm_R` with `expert_major = received[perm_R]`, or None when
    the rows are already in that order (at most one source sent anything).
    """
    counts = np.asarray(counts_SJ, dtype=np.int64)
    if np.count_nonzero(counts.sum(1)) <= 1:
        return None
    starts_SH = (np.cumsum(counts.ravel()) - counts.ravel()).reshape(counts.shape)
    lengths = counts.T.ravel()  # expert-major block order
    block_starts = starts_SH.T.ravel()
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    out_starts = np.cumsum(lengths) - lengths
    return np.repeat(block_starts - out_starts, lengths) + np.arange(total, dtype=np.int64)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    # scatter_ rather than `inv[perm] = arange` (index_put): the same values, about half the time.
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))


class _Permute(torch.autograd.Function):
    """Row permutation whose backward is the inverse permutation: a gather both ways, where
    `x[perm]` would back-propagate through a (much slower) accumulating scatter."""

    @staticmethod
    def forward(ctx, x_RD, perm_R, inverse_R):
        ctx.save_for_backward(inverse_R)
        return x_RD.index_select(0, perm_R)

    @staticmethod
    def backward(ctx, grad_RD):
        (inverse_R,) = ctx.saved_tensors
        return grad_RD.index_select(0, inverse_R), None, None


def permute_rows(x_RD: torch.Tensor, perm_R: torch.Tensor, inverse_R: torch.Tensor) -> torch.Tensor:
    """`x_RD[perm_R]` for a bijective `perm_R` (with its precomputed inverse)."""
    return _Permute.apply(x_RD, perm_R, inverse_R)


def run_expert_major(fn, x_RD: torch.Tensor, counts_SJ: np.ndarray) -> torch.Tensor:
    """`fn(x_grouped, counts_J)` on rows that arrived (source, expert)-major, regrouped
    (expert, source)-major for it (`source_major_to_expert_major`); its output back in arrival order."""
    counts_SJ = np.asarray(counts_SJ)
    if counts_SJ.shape[0] == 1:  # one source (one process): its rows are grouped by expert already
        return fn(x_RD, counts_SJ[0].tolist())
    counts_J = counts_SJ.sum(0).tolist()
    perm = source_major_to_expert_major(counts_SJ)
    if perm is None:  # one source: already grouped by expert
        return fn(x_RD, counts_J)
    perm_R = torch.as_tensor(perm, device=x_RD.device)
    inverse_R = inverse_permutation(perm_R)
    return permute_rows(fn(permute_rows(x_RD, perm_R, inverse_R), counts_J), inverse_R, perm_R)


def choices_per_token(token_A: torch.Tensor, num_tokens: int) -> int:
    """K when the rows are choice-major token choices with none dropped (`token_A` is `0..T-1`
    repeated K times, what `routing.token_choices` builds), else 0. Rows of that shape go back to
    their tokens by a gather and a sum over K instead of an accumulating scatter."""
    rows = token_A.numel()
    if num_tokens == 0 or rows == 0 or rows % num_tokens:
        return 0
    k = rows // num_tokens
    tiled_A = torch.arange(num_tokens, device=token_A.device).repeat(k)
    return k if torch.equal(token_A, tiled_A) else 0


class _GatherTokenRows(torch.autograd.Function):
    """`x_TD[token_sent_A]` where every token is sent exactly K times. Backward: the row gradients
    gathered back into choice-major order (`inverse_A`) and summed over the K choices, where
    `index_select`'s own backward is an accumulating scatter (`index_add`) over all A rows."""

    @staticmethod
    def forward(ctx, x_TD, token_sent_A, inverse_A, k):
        ctx.save_for_backward(inverse_A)
        ctx.k = k
        return x_TD.index_select(0, token_sent_A)

    @staticmethod
    def backward(ctx, grad_AD):
        (inverse_A,) = ctx.saved_tensors
        grad_KTD = grad_AD.index_select(0, inverse_A).view(ctx.k, -1, grad_AD.shape[1])
        return (grad_KTD[0] if ctx.k == 1 else grad_KTD.sum(0)), None, None, None


def gather_token_rows(
    x_TD: torch.Tensor, token_A: torch.Tensor, order_A: torch.Tensor, k: int, inverse_A: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows `x_TD[token_A[order_A]]` of choice-major token choices (`choices_per_token` = k > 0);
    `inverse_A`: `inverse_permutation(order_A)` where the caller has it."""
    inverse_A = inverse_permutation(order_A) if inverse_A is None else inverse_A
    return _GatherTokenRows.apply(x_TD, token_A.index_select(0, order_A), inverse_A, k)


def sum_token_rows(
    y_AD: torch.Tensor,
    weight_A: torch.Tensor,
    order_A: torch.Tensor,
    k: int,
    inverse_A: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each token's `Σ_k weight · y` over its k rows, for rows `y_AD` in `order_A` order of
    choice-major token choices (`choices_per_token` = k > 0): the rows go back to choice-major
    order by a gather (backward: the inverse gather) and are summed over K, where `index_add`
    would scatter-accumulate them forward and gather backward (k = 2: bit-identical to it).
    `inverse_A`: `inverse_permutation(order_A)` where the caller has it."""
    inverse_A = inverse_permutation(order_A) if inverse_A is None else inverse_A
    y_KTD = permute_rows(y_AD, inverse_A, order_A).view(k, -1, y_AD.shape[1])
    weighted_KTD = y_KTD * weight_A.view(k, -1, 1).to(y_AD.dtype)
    return weighted_KTD[0] if k == 1 else weighted_KTD.sum(0)
