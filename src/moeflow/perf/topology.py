"""Cluster topology: devices, switches, directed links, routes (FasterMoE §3.2 Eq. 2; TA-MoE §3.2).

A topology is a tree of switches written as a nested list (TA-MoE §3.2): every list is a switch,
every integer a device, e.g. ``[[0,1],[2,3]]`` (two nodes of two devices) or the asymmetric
``[[[0,1],[2,3]],[[4,5]]]``. A duplex cable is two *directed* links, each with its own traffic
(FasterMoE §3.2). Traffic between two devices goes up to their lowest common switch and down.

Links are grouped by *level*: the depth of the switch they hang under (0 = the root switch, so
for ``[[0,1],[2,3]]`` level 0 is the inter-node network, level 1 the device links inside a node).
Bandwidth and latency are given per level, outermost first.

The lowest-level groups ("nodes") may instead be *rings* (NVLink rings, FasterMoE §5.1 trevor):
traffic between members of the same ring travels along the ring edges (shortest direction),
traffic leaving the node goes through the node's switch as in a tree.

Shape suffixes: W devices, L directed links, P = W·W ordered device pairs, H hops of a route. `L`,
`P` and `H` keep these meanings here only because they are in public names (`bandwidth_L`,
`routes_PL`, `route_WWH`, `pair_traffic(bytes_P, pairs_P)`); docs/architecture.md, "Shape letters".

    topo = Topology.from_spec([[0, 1], [2, 3]], level_bandwidth_bytes_per_s=[12.5e9, 16e9])
    topo.path(0, 3)          # [d0->n0, n0->root, root->n1, n1->d3]
    Topology.preset("johnny").num_devices   # 16
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import sparse

from moeflow.perf.topology_families import TopologyFamilies, tree_depth
from moeflow.perf.topology_presets import GBIT, GBYTE, PRESETS
from moeflow.perf.two_level import TWO_LEVEL_FROM, two_level_links

__all__ = ["GBIT", "GBYTE", "PRESETS", "Link", "Topology"]


@dataclass(frozen=True)
class Link:
    """One directed link between two vertices (devices are ``d<i>``, switches ``s<path>``)."""

    src: str
    """Vertex the bytes leave."""
    dst: str
    """Vertex the bytes arrive at."""
    bandwidth_bytes_per_s: float
    """Sustained bandwidth of this direction."""
    latency_s: float
    """One-way latency added by this hop."""
    level: int
    """Depth of the switch this link hangs under (0 = root); ring edges carry the node's level."""
    kind: str = "tree"
    """``tree`` (device/switch to parent switch) or ``ring`` (edge between ring neighbours)."""

    def __str__(self) -> str:
        return f"{self.src}->{self.dst}"


def _parse(spec: Any, where: str = "spec") -> Any:
    """Validate the nested list; return it with ints and lists only. Errors name the element."""
    if isinstance(spec, bool) or not isinstance(spec, (int, list, tuple)):
        raise ValueError(f"topology {where}={spec!r}: expected a device id (int) or a list")
    if isinstance(spec, int):
        if spec < 0:
            raise ValueError(f"topology {where}={spec!r}: device ids must be >= 0")
        return spec
    if len(spec) == 0:
        raise ValueError(f"topology {where}=[]: an empty group has no devices")
    return [_parse(child, f"{where}[{i}]") for i, child in enumerate(spec)]


def _leaves(spec: Any) -> list[int]:
    return [spec] if isinstance(spec, int) else [d for c in spec for d in _leaves(c)]


def _as_levels(value: float | Sequence[float], depth: int, name: str) -> tuple[float, ...]:
    if isinstance(value, (int, float)):
        return (float(value),) * depth
    values = tuple(float(v) for v in value)
    if len(values) != depth:
        raise ValueError(f"{name}={list(value)!r}: expected {depth} values (one per level, root first)")
    return values


@dataclass
class Topology(TopologyFamilies):
    """Devices, switches and directed links of a cluster; see the module docstring."""

    spec: Any
    """Nested list of device ids (lists are switches), e.g. ``[[0,1],[2,3]]``."""
    level_bandwidth_bytes_per_s: float | Sequence[float]
    """Bandwidth of one direction of a link under a switch of each depth, root first (a scalar = all)."""
    level_latency_s: float | Sequence[float] = 0.0
    """One-way latency of one hop at each level, root first (a scalar = all)."""
    ring_edge_bandwidth_bytes_per_s: Sequence[float] | None = None
    """If set, every node (lowest-level group) is a ring: edge i joins member i and i+1 (mod m);
    one value per edge (m values; 1 for a node of 2). ``None``: nodes are switches."""
    name: str = "custom"
    """Label shown in reports (preset name or ``custom``)."""
    source: str = ""
    """Where the numbers come from (paper, section, datasheet)."""
    links: list[Link] = field(init=False, repr=False)
    node_of: list[int] = field(init=False, repr=False)
    """Device -> index of its node (the lowest-level group containing it)."""

    def __post_init__(self) -> None:
        self.spec = _parse(self.spec)
        if isinstance(self.spec, int):
            self.spec = [self.spec]
        devices = _leaves(self.spec)
        if sorted(devices) != list(range(len(devices))):
            dup = sorted({d for d in devices if devices.count(d) > 1})
            missing = sorted(set(range(len(devices))) - set(devices))
            raise ValueError(
                f"topology spec={self.spec!r}: device ids must be 0..{len(devices) - 1} exactly once "
                f"(duplicated {dup}, missing {missing})"
            )
        self.num_devices = len(devices)
        self.depth = tree_depth(self.spec)
        self._bw = _as_levels(self.level_bandwidth_bytes_per_s, self.depth, "level_bandwidth_bytes_per_s")
        self._lat = _as_levels(self.level_latency_s, self.depth, "level_latency_s")
        for i, b in enumerate(self._bw):
            if not (b > 0 and math.isfinite(b)):
                raise ValueError(f"level_bandwidth_bytes_per_s[{i}]={b!r}: must be a positive finite number")
        for i, a in enumerate(self._lat):
            if not (a >= 0 and math.isfinite(a)):
                raise ValueError(f"level_latency_s[{i}]={a!r}: must be >= 0 and finite")
        self._build()

    # ---- construction -------------------------------------------------------------------------
    def _build(self) -> None:
        """Links, node groups, ring edges and the route incidence of every pair (long: one walk of
        the nested spec, then the rings and routes that need all of its links)."""
        links: list[Link] = []
        index: dict[tuple[str, str], int] = {}
        parent_chain: dict[int, list[str]] = {}  # device -> switches from its parent up to the root
        node_groups: list[list[int]] = []
        node_switch: list[str] = []

        def add(src: str, dst: str, level: int, kind: str, bw: float, lat: float) -> None:
            index[(src, dst)] = len(links)
            links.append(Link(src, dst, bw, lat, level, kind))

        def walk(group: list, name: str, depth: int, chain: list[str]) -> None:
            chain = [name, *chain]
            if all(isinstance(c, int) for c in group):
                node_groups.append(list(group))
                node_switch.append(name)
            elif any(isinstance(c, int) for c in group) and self.ring_edge_bandwidth_bytes_per_s is not None:
                raise ValueError(f"topology spec={self.spec!r}: ring nodes need groups of devices only")
            for i, child in enumerate(group):
                if isinstance(child, int):
                    dev = f"d{child}"
                    add(dev, name, depth, "tree", self._bw[depth], self._lat[depth])
                    add(name, dev, depth, "tree", self._bw[depth], self._lat[depth])
                    parent_chain[child] = chain
                else:
                    sub = f"{name}.{i}" if name != "s" else f"s{i}"
                    add(sub, name, depth, "tree", self._bw[depth], self._lat[depth])
                    add(name, sub, depth, "tree", self._bw[depth], self._lat[depth])
                    walk(child, sub, depth + 1, chain)

        walk(self.spec, "s", 0, [])
        ring_pos: dict[int, tuple[int, int]] = {}  # device -> (node, position in ring)
        if self.ring_edge_bandwidth_bytes_per_s is not None:
            edges = [float(b) for b in self.ring_edge_bandwidth_bytes_per_s]
            for n, members in enumerate(node_groups):
                m = len(members)
                want = 1 if m == 2 else m
                if m < 2 or len(edges) != want:
                    raise ValueError(
                        f"ring_edge_bandwidth_bytes_per_s={edges!r}: node {members} of {m} devices "
                        f"needs {want} edge bandwidths"
                    )
                level = len(parent_chain[members[0]]) - 1
                for e in range(want):
                    a, b = f"d{members[e]}", f"d{members[(e + 1) % m]}"
                    add(a, b, level, "ring", edges[e], self._lat[level])
                    add(b, a, level, "ring", edges[e], self._lat[level])
                for pos, d in enumerate(members):
                    ring_pos[d] = (n, pos)
        self.links = links
        self._index = index
        self._chain = parent_chain
        self._ring_pos = ring_pos
        self._node_groups = node_groups
        self.node_of = [0] * self.num_devices
        for n, members in enumerate(node_groups):
            for d in members:
                self.node_of[d] = n
        W, L = self.num_devices, len(links)
        self.route_WWH = self._route_table()
        """Links of every ordered pair's route in order from the source, padded with L (no link):
        int32 ``[W, W, H]``, built array-wise once; link traffic and route latencies read it."""
        self.bandwidth_L = np.array([lk.bandwidth_bytes_per_s for lk in links])
        self.latency_L = np.array([lk.latency_s for lk in links])
        self.path_latency_WW = np.append(self.latency_L, 0.0)[self.route_WWH].sum(-1)
        self.latency_classes, classes = np.unique(self.path_latency_WW, return_inverse=True)
        """The distinct route latencies, ascending; `latency_class_WW` indexes them per pair."""
        self.latency_class_WW = classes.reshape(W, W)
        self.path_bandwidth_WW = np.append(self.bandwidth_L, math.inf)[self.route_WWH].min(-1)
        """Bottleneck bandwidth of every route (inf on the diagonal)."""
        self.reverse_L = np.array([self._index.get((lk.dst, lk.src), -1) for lk in links], dtype=np.int64)
        """Each directed link's opposite direction (-1: none)."""
        self.nodes_under_root = len(node_groups) > 1 and all(len(self._chain[d]) == 2 for d in range(W))
        """Every node hangs from the root switch: bytes between two nodes take the same four links —
        their source's, its node's up, the other node's down, their destination's."""
        if self.nodes_under_root:  # those links of every device, from a device of the next node
            partner = [node_groups[(self.node_of[d] + 1) % len(node_groups)][0] for d in range(W)]
            self.leave_W2 = self.route_WWH[np.arange(W), partner][:, :2]
            self.enter_W2 = self.route_WWH[partner, np.arange(W)][:, 2:4]
            self.cross_class = int(self.latency_class_WW[0, partner[0]])
        self._two_level = (
            two_level_links(self.route_WWH, self.leave_W2, self.enter_W2, self.node_of, L)
            if self.nodes_under_root and W >= TWO_LEVEL_FROM
            else None
        )
        cross_routes = (
            (self.leave_W2.astype(np.int64), self.enter_W2.astype(np.int64), self.cross_class)
            if self.nodes_under_root
            else (np.zeros((W, 2), dtype=np.int64), np.zeros((W, 2), dtype=np.int64), 0)
        )
        self.route_tables = (
            self.route_WWH,
            self.latency_class_WW.astype(np.int64),
            np.asarray(self.node_of, dtype=np.int64),
            *cross_routes,
            bool(self.nodes_under_root),
        )
        """The routes as `perf.compiled_sums` reads them: (`route_WWH`, `latency_class_WW`, node of
        every device, `leave_W2`, `enter_W2`, `cross_class`, `nodes_under_root`)."""
        H = self.route_WWH.shape[-1]
        hops = self.route_WWH.reshape(-1)
        keep = hops < L
        pairs = np.repeat(np.arange(W * W), H)[keep]
        # The incidence of every pair's route on every link, sparse: the traffic of any flow is one product.
        self._routes_csr = sparse.csr_matrix((np.ones(pairs.size), (pairs, hops[keep])), shape=(W * W, L))
        self._links_csr = self._routes_csr.T.tocsr()  # [L, W·W]: link sums as sparse @ dense, no transpose per call
        self._routes_dense: np.ndarray | None = None

    def _route_table(self) -> np.ndarray:
        """`route_WWH`: up from the source to the lowest common switch and down (a tree), or round a
        ring node the shorter way (ties forward) between members of one ring."""
        W, L = self.num_devices, len(self.links)
        chains = [[f"d{d}", *self._chain[d]] for d in range(W)]  # device, parent, ..., root
        depth = max(len(c) for c in chains) - 1
        names = {name: i for i, name in enumerate(sorted({v for c in chains for v in c}))}
        # The vertex at each depth from the root (0) down to the device; below a device: -1 - device.
        anc_WD = np.array([[-1 - d] * (depth + 1) for d in range(W)], dtype=np.int64)
        up_WD = np.full((W, depth + 1), L, dtype=np.int32)  # the link from the depth-ℓ vertex up
        down_WD = np.full((W, depth + 1), L, dtype=np.int32)  # the link down into it
        for d, chain in enumerate(chains):
            top_down = chain[::-1]
            for level, vertex in enumerate(top_down):
                anc_WD[d, level] = names[vertex]
                if level:
                    up_WD[d, level] = self._index[(vertex, top_down[level - 1])]
                    down_WD[d, level] = self._index[(top_down[level - 1], vertex)]
        ring_hops = max((len(m) // 2 for m in self._node_groups), default=0) if self._ring_pos else 0
        table = np.full((W, W, max(2 * depth, ring_hops, 1)), L, dtype=np.int32)
        for k, level in enumerate(range(depth, 0, -1)):  # up, the deepest link first
            apart = anc_WD[:, None, level] != anc_WD[None, :, level]
            table[:, :, k] = np.where(apart, up_WD[:, None, level], L)
        for k, level in enumerate(range(1, depth + 1)):  # then down
            apart = anc_WD[:, None, level] != anc_WD[None, :, level]
            table[:, :, depth + k] = np.where(apart, down_WD[None, :, level], L)
        # A route's hops contiguous from column 0 (the padding of shallower devices moved to the end).
        table = np.take_along_axis(table, np.argsort(table == L, axis=-1, kind="stable"), axis=-1)
        for members in self._node_groups if self._ring_pos else []:
            m = len(members)
            for a in range(m):
                for b in range(m):
                    step = 1 if (b - a) % m <= (a - b) % m else -1  # shortest way round; ties go forward
                    hops, pos = [], a
                    while pos != b:
                        hops.append(self._index[(f"d{members[pos]}", f"d{members[(pos + step) % m]}")])
                        pos = (pos + step) % m
                    table[members[a], members[b]] = L
                    table[members[a], members[b], : len(hops)] = hops
        return table

    @property
    def routes_PL(self) -> np.ndarray:
        """Dense incidence of every ordered pair's route on every link ``[W·W, L]`` (1: the bytes
        i -> j cross link l), built on first use (``W²·L`` floats: for small clusters)."""
        if self._routes_dense is None:
            self._routes_dense = self._routes_csr.toarray()
        return self._routes_dense

    # ---- queries ------------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return len(self._node_groups)

    @property
    def nodes(self) -> list[list[int]]:
        """Devices of every node, in node order."""
        return [list(g) for g in self._node_groups]

    def path(self, i: int, j: int) -> list[Link]:
        """Directed links the bytes from device i to device j cross (empty for i == j)."""
        for name, v in (("i", i), ("j", j)):
            if not (isinstance(v, (int, np.integer)) and 0 <= v < self.num_devices):
                raise ValueError(f"path {name}={v!r}: not a device of this {self.num_devices}-device topology")
        L = len(self.links)
        return [self.links[li] for li in self.route_WWH[int(i), int(j)] if li < L]

    def path_bandwidth(self, i: int, j: int) -> float:
        """Bottleneck bandwidth of the route i -> j (inf for i == j)."""
        self.path(i, j)  # checks the device ids
        return float(self.path_bandwidth_WW[int(i), int(j)])

    def device_link_bandwidth(self, w: int) -> float:
        """Bandwidth of device w's own link into its node (the first hop of all of its traffic
        leaving the device through the node's switch)."""
        return self.links[self._index[(f"d{w}", self._chain[w][0])]].bandwidth_bytes_per_s

    def node_uplink_bandwidth(self, w: int) -> float:
        """Bandwidth of the link that takes device w's node's traffic to the rest of the cluster
        (inf on a single-node topology)."""
        chain = self._chain[w]
        if len(chain) < 2:
            return math.inf
        return self.links[self._index[(chain[0], chain[1])]].bandwidth_bytes_per_s

    def link_traffic(self, bytes_WW: np.ndarray) -> np.ndarray:
        """Bytes on every directed link for flows ``[..., W, W]`` -> ``[..., L]`` (FasterMoE Eq. 2).
        Where every node hangs from the root switch (from `TWO_LEVEL_FROM` devices), by sums over
        rows, columns and node blocks (`perf.two_level`); else through the routes' incidence."""
        bytes_WW = np.asarray(bytes_WW, dtype=np.float64)
        W = self.num_devices
        if bytes_WW.shape[-2:] != (W, W):
            raise ValueError(f"flow shape {bytes_WW.shape}: last two dims must be ({W}, {W})")
        if self._two_level is not None:
            return self._two_level.traffic(bytes_WW)
        flat = bytes_WW.reshape(-1, W * W)
        return np.asarray(self._links_csr @ flat.T).T.reshape(*bytes_WW.shape[:-2], len(self.links))

    def pair_traffic(self, bytes_P: np.ndarray, pairs_P: np.ndarray) -> np.ndarray:
        """Bytes on every link ``[..., L]`` when ``bytes_P[..., p]`` go along pair ``pairs_P[p] = i·W + j``."""
        bytes_P = np.asarray(bytes_P, dtype=np.float64)
        pairs_P = np.asarray(pairs_P, dtype=np.int64)
        flat = bytes_P.reshape(int(np.prod(bytes_P.shape[:-1])), pairs_P.size)
        routes = self._routes_csr[pairs_P]
        return np.asarray(flat @ routes).reshape(*bytes_P.shape[:-1], len(self.links))

    def level_bandwidth(self) -> tuple[float, ...]:
        return self._bw

    def level_latency(self) -> tuple[float, ...]:
        return self._lat
