"""`dispatch="hierarchical"`: the 2D-hierarchical all-to-all (Tutel's 2DH, FSMoE §3.1's dispatch
option, DeepSpeed-MoE's hierarchical all-to-all).

With N nodes of M ranks, rank (n, l) = local index l on node n:

1. layout transform: its rows, in destination order, regrouped by the destination's local index l'
   then node m;
2. intra-node all-to-all: to node-mate l' go all of its rows for ranks (·, l');
3. layout transform: the rows received from each node-mate (l_s, in destination-node order m)
   regrouped by destination node m then source l_s;
4. inter-node all-to-all among the ranks with the same local index: to (m, l) go all rows of node
   n for (m, l);
5. layout transform back to the order a plain all-to-all delivers: by source rank.

Each rank sends M−1 + N−1 messages instead of W−1, and every inter-node message carries the rows of
a whole node: fewer, larger messages across the slow links — a win when messages are small
(start-up-bound), at the price of moving the intra-node rows twice. With few ranks it does not
pay: on the 2 × 2 gloo testbed it lost to `a2a` at every size from 1 KiB to 16 MiB per pair
(docs/fsmoe.md). Both exchanges are point-to-point among the peers with
rows (`core.dispatch.peer_exchange`), inside autograd; the permutations are gathers both ways.
Numerics equal the plain all-to-all's exactly (tested).

The node layout comes from the cost model's topology, else from the launcher (`LOCAL_WORLD_SIZE`,
ranks numbered node by node); nodes of unequal size are refused.

Shape suffixes: A rows sent, R rows received, D d_model, W ranks, M ranks per node, N nodes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from moeflow.core import dispatch
from moeflow.strategies.dispatchers import Dispatcher


@dataclass(frozen=True)
class NodeGrid:
    """The ranks of the group as an N × M grid: `rank_NM[n, l]` is local rank l of node n."""

    rank_NM: np.ndarray

    @classmethod
    def of(cls, node_of: Sequence[int]) -> NodeGrid:
        nodes = sorted(set(node_of), key=list(node_of).index)
        members = [[r for r, n in enumerate(node_of) if n == node] for node in nodes]
        sizes = sorted({len(m) for m in members})
        if len(sizes) > 1:
            raise ValueError(
                f"dispatch='hierarchical' needs nodes of equal size; node_of={list(node_of)} has "
                f"{[len(m) for m in members]} ranks per node"
            )
        return cls(np.array(members, dtype=np.int64))

    def position(self, rank: int) -> tuple[int, int]:
        n, l = np.argwhere(self.rank_NM == rank)[0]
        return int(n), int(l)


def _node_of(group: Any, node_of: Sequence[int] | None, world: int) -> list[int]:
    if node_of is not None:
        return list(node_of)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % local:
        raise ValueError(f"dispatch='hierarchical': LOCAL_WORLD_SIZE={local} does not divide the group's {world} ranks")
    return [dist.get_global_rank(group, r) // local for r in range(world)]


def hierarchical_exchange(x_AD: torch.Tensor, send_WW: np.ndarray, me: int, group: Any, grid: NodeGrid) -> torch.Tensor:
    """The five steps of the module docstring; returns the rows this rank receives, by source."""
    send = np.asarray(send_WW, dtype=np.int64)
    W = send.shape[0]
    N, M = grid.rank_NM.shape
    n, l = grid.position(me)
    # 1-2: by the destination's local index l', then node m; to node-mate l' its share.
    order1 = grid.rank_NM.T.reshape(-1)  # destinations in (l', m) order
    x_AD = _permute(x_AD, dispatch.block_permutation(send[me], order1))
    split1, recv1 = np.zeros(W, np.int64), np.zeros(W, np.int64)
    for l2 in range(M):
        mate = grid.rank_NM[n, l2]
        split1[mate] = send[me, grid.rank_NM[:, l2]].sum()
        recv1[mate] = send[mate, grid.rank_NM[:, l]].sum()
    x_AD = dispatch.peer_exchange(x_AD, split1.tolist(), recv1.tolist(), group)
    # 3-4: blocks (source l_s, destination node m) -> (m, l_s); to (m, l) node n's rows for it.
    mates = grid.rank_NM[n]  # node-mates in rank order: the order the exchange delivered them
    lengths_SM = send[np.ix_(mates, grid.rank_NM[:, l])]
    nodes_by_peer_rank = np.argsort(grid.rank_NM[:, l], kind="stable")  # the exchange's peer order
    order2 = (np.arange(M)[None, :] * N + nodes_by_peer_rank[:, None]).reshape(-1)
    x_AD = _permute(x_AD, dispatch.block_permutation(lengths_SM.reshape(-1), order2))
    split2, recv2 = np.zeros(W, np.int64), np.zeros(W, np.int64)
    for m in range(N):
        peer = grid.rank_NM[m, l]
        split2[peer] = send[mates, peer].sum()
        recv2[peer] = send[grid.rank_NM[m], me].sum()
    x_AD = dispatch.peer_exchange(x_AD, split2.tolist(), recv2.tolist(), group)
    # 5: blocks (peer node in rank order, source l_s) -> source rank order.
    peers = sorted(grid.rank_NM[:, l].tolist())
    sources = np.array([grid.rank_NM[grid.position(p)[0], ls] for p in peers for ls in range(M)])
    return _permute(x_AD, dispatch.block_permutation(send[sources, me], np.argsort(sources, kind="stable")))


def _permute(x_AD: torch.Tensor, perm: np.ndarray) -> torch.Tensor:
    perm_A = torch.as_tensor(perm, device=x_AD.device)
    return dispatch.permute_rows(x_AD, perm_A, dispatch.inverse_permutation(perm_A))


def hierarchical_bytes(bytes_WW: np.ndarray, grid: NodeGrid) -> tuple[np.ndarray, np.ndarray]:
    """Bytes `[..., W, W]` of the intra-node stage and of the inter-node stage for an exchange of
    `bytes_WW[..., src, dst]` (the diagonal of each stage stays on its rank)."""
    b = np.asarray(bytes_WW, dtype=np.float64)
    N, M = grid.rank_NM.shape
    W = N * M
    node, local = np.empty(W, np.int64), np.empty(W, np.int64)
    node[grid.rank_NM.reshape(-1)] = np.repeat(np.arange(N), M)
    local[grid.rank_NM.reshape(-1)] = np.tile(np.arange(M), N)
    # Stage 1: (n, l) -> (n, l') carries everything (n, l) sends to ranks of local index l'.
    to_local = np.eye(M)[local]  # [W, M]
    stage1_WM = b @ to_local  # bytes from each src per destination local index
    stage1 = np.zeros_like(b)
    stage1[..., np.arange(W)[:, None], grid.rank_NM[node][:, :]] = stage1_WM
    # Stage 2: (n, l) -> (m, l) carries what all of node n sends to (m, l).
    same_node = (node[:, None] == node[None, :]).astype(np.float64)
    node_to_dst = same_node @ b  # row (n, l): bytes node n sends to each dst
    stage2 = node_to_dst * (local[:, None] == local[None, :])
    for stage in (stage1, stage2):
        stage[..., np.arange(W), np.arange(W)] = 0.0
    return stage1, stage2


class HierarchicalDispatcher(Dispatcher):
    """`dispatch="hierarchical"` (module docstring)."""

    name = "hierarchical"

    def __init__(self) -> None:
        self._grids: dict[tuple[int, ...], NodeGrid] = {}

    def _grid(self, node_of: Sequence[int]) -> NodeGrid:
        key = tuple(node_of)
        if key not in self._grids:
            self._grids[key] = NodeGrid.of(key)
        return self._grids[key]

    def exchange(self, x_AD: torch.Tensor, send_WW: np.ndarray, me: int, group: Any, node_of) -> torch.Tensor:
        if group is None:
            return x_AD
        grid = self._grid(_node_of(group, node_of, send_WW.shape[0]))
        return hierarchical_exchange(x_AD, send_WW, me, group, grid)

    def price(self, cost_model: Any, bytes_WW: np.ndarray) -> np.ndarray:
        """Both stages, one after the other, each with one message per peer of its stage, plus the
        three layout transforms: each a pass over the busiest rank's rows, priced as an
        elementwise op (on the testbed they cost as much as the intra-node stage;
        docs/fsmoe.md). Not modelled: gloo's
        fixed cost per round (two rounds here, one for `a2a`) and the lower throughput of one TCP
        flow per rank across nodes — the price is optimistic by both (0.83–0.88× predicted, 0.15–0.97×
        measured on the 2 × 2 testbed)."""
        grid = self._grid(cost_model.topology.node_of)
        N, M = grid.rank_NM.shape
        stage1, stage2 = hierarchical_bytes(bytes_WW, grid)
        b = np.asarray(bytes_WW, dtype=np.float64)
        rows_bytes = np.maximum(b.sum(-1).max(-1), b.sum(-2).max(-1))  # a rank's rows out or in
        transforms = 3 * cost_model.op_time("elementwise", rows_bytes)
        return cost_model.a2a_time(stage1, peers=M - 1) + cost_model.a2a_time(stage2, peers=N - 1) + transforms
