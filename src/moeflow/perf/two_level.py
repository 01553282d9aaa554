"""Link traffic of a two-level tree by sums: every device under its node's switch, every node's
switch under the root (FasterMoE's and Hecate's clusters).

There a route is a device's link up, then — to another node only — its node's link up and the
other node's down, then the destination's link down. So the bytes on every link of a flow
``[..., W, W]`` are four sums: each device's row and column (its links up and down, the diagonal
left out), and each node block's row and column of the node-by-node matrix (its switch's links, the
block's own diagonal left out). Two passes over the flow instead of a sparse product with the
routes' incidence (four links per pair): the same sums for integer bytes (in another order
otherwise), and cheaper from about a hundred devices (at 16: 26 µs against 9; at 64: equal; at
1024: 11 ms against 21).

Shape suffixes: W devices, N nodes, L directed links, H hops of a route; ``...`` = any leading dims.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

TWO_LEVEL_FROM = 128
"""Devices from which `Topology.link_traffic` sums a two-level tree's links directly."""


class TwoLevel(NamedTuple):
    """The links of a two-level tree (module docstring)."""

    up_W: np.ndarray
    down_W: np.ndarray
    node_up_N: np.ndarray
    node_down_N: np.ndarray
    by_node: np.ndarray
    """The devices node by node."""
    first_N: np.ndarray
    """Each node's first position in `by_node`."""
    links: int

    def traffic(self, bytes_WW: np.ndarray) -> np.ndarray:
        """Bytes on every directed link ``[..., L]`` (module docstring)."""
        W = self.up_W.size
        flat = bytes_WW.reshape(-1, W, W)
        diag = np.diagonal(flat, axis1=-2, axis2=-1)
        ordered = flat if np.array_equal(self.by_node, np.arange(W)) else flat[:, self.by_node][:, :, self.by_node]
        node_NN = np.add.reduceat(np.add.reduceat(ordered, self.first_N, axis=1), self.first_N, axis=2)
        within = np.diagonal(node_NN, axis1=-2, axis2=-1)
        out = np.zeros((flat.shape[0], self.links))
        out[:, self.up_W] = flat.sum(-1) - diag
        out[:, self.down_W] = flat.sum(-2) - diag
        out[:, self.node_up_N] = node_NN.sum(-1) - within
        out[:, self.node_down_N] = node_NN.sum(-2) - within
        return out.reshape(*bytes_WW.shape[:-2], self.links)


def two_level_links(
    route_WWH: np.ndarray, leave_W2: np.ndarray, enter_W2: np.ndarray, node_of: Sequence[int], links: int
) -> TwoLevel | None:
    """The tree's links (`leave_W2`: each device's and its node's link up; `enter_W2`: a node's and
    the device's link down), or None if some route of `route_WWH` (padded with `links`) is not the
    two-level one (rings inside a node)."""
    W = route_WWH.shape[0]
    up_W, down_W = leave_W2[:, 0], enter_W2[:, 1]
    node_W = np.asarray(node_of)
    by_node = np.argsort(node_W, kind="stable")
    first_N = np.searchsorted(node_W[by_node], np.arange(int(node_W.max()) + 1))
    node_up_N, node_down_N = leave_W2[by_node[first_N], 1], enter_W2[by_node[first_N], 0]
    same_WW = node_W[:, None] == node_W[None, :]
    H = route_WWH.shape[-1]
    want_WWH = np.full((W, W, max(4, H)), links, dtype=np.int64)
    want_WWH[..., 0] = up_W[:, None]
    want_WWH[..., 1] = np.where(same_WW, down_W[None, :], node_up_N[node_W][:, None])
    want_WWH[..., 2] = np.where(same_WW, links, node_down_N[node_W][None, :])
    want_WWH[..., 3] = np.where(same_WW, links, down_W[None, :])
    want_WWH[np.arange(W), np.arange(W)] = links
    if H > 4 or not np.array_equal(want_WWH[..., :H], route_WWH) or (want_WWH[..., H:] != links).any():
        return None
    return TwoLevel(up_W, down_W, node_up_N, node_down_N, by_node, first_N, links)
