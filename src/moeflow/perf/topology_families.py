"""How a `Topology` is made: the families of trees (TA-MoE §3.2: homogeneous, ring, symmetric
trees, nodes × devices), a sub-cluster of some ranks, JSON, and the published presets. A part of
`moeflow.perf.topology.Topology` (its base class), kept apart from the routes and their queries.

Shape suffixes: W devices.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moeflow.perf.topology_presets import GBYTE, PRESETS, resolve_preset

if TYPE_CHECKING:
    from moeflow.perf.topology import Topology


def tree_depth(spec: Any) -> int:
    """Number of switch levels above the deepest device of a nested-list spec."""
    return 0 if isinstance(spec, int) else 1 + max(tree_depth(c) for c in spec)


class TopologyFamilies:
    """The constructors and the JSON of `Topology` (module docstring)."""

    # ---- families -----------------------------------------------------------------------------
    @classmethod
    def from_spec(
        cls,
        spec: Any,
        level_bandwidth_bytes_per_s: float | Sequence[float] = 10 * GBYTE,
        level_latency_s: float | Sequence[float] = 0.0,
        **kwargs: Any,
    ) -> Topology:
        """Tree from a nested list or its JSON text (``"[[0,1],[2,3]]"``)."""
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise ValueError(f"topology spec={spec!r}: not a JSON nested list ({exc.msg})") from None
        return cls(spec, level_bandwidth_bytes_per_s, level_latency_s, **kwargs)

    @classmethod
    def homogeneous(cls, num_devices: int, bandwidth_bytes_per_s: float, latency_s: float = 0.0) -> Topology:
        """All devices under one switch (NVSwitch; TA-MoE Fig. 2a)."""
        if num_devices < 1:
            raise ValueError(f"num_devices={num_devices!r}: must be >= 1")
        return cls(list(range(num_devices)), bandwidth_bytes_per_s, latency_s, name="homogeneous")

    @classmethod
    def ring(
        cls,
        edge_bandwidth_bytes_per_s: Sequence[float],
        uplink_bandwidth_bytes_per_s: float,
        latency_s: float = 0.0,
    ) -> Topology:
        """One node whose devices form a ring (NVLink ring; TA-MoE Fig. 2b), one edge bandwidth per edge."""
        m = len(edge_bandwidth_bytes_per_s)
        m = 2 if m == 1 else m
        return cls(
            list(range(m)),
            uplink_bandwidth_bytes_per_s,
            latency_s,
            ring_edge_bandwidth_bytes_per_s=list(edge_bandwidth_bytes_per_s),
            name="ring",
        )

    @classmethod
    def symmetric_tree(
        cls,
        fanout: Sequence[int],
        level_bandwidth_bytes_per_s: float | Sequence[float],
        level_latency_s: float | Sequence[float] = 0.0,
    ) -> Topology:
        """Symmetric tree ``[L0, L1, ...]`` (TA-MoE §3.2): L0 children of the root, each with L1, ..."""
        if not fanout or any(not isinstance(f, int) or f < 1 for f in fanout):
            raise ValueError(f"fanout={list(fanout)!r}: expected a non-empty list of positive ints")
        counter = iter(range(math.prod(fanout)))

        def build(level: int) -> Any:
            if level == len(fanout) - 1:
                return [next(counter) for _ in range(fanout[level])]
            return [build(level + 1) for _ in range(fanout[level])]

        return cls(build(0), level_bandwidth_bytes_per_s, level_latency_s, name=f"tree{list(fanout)}")

    @classmethod
    def nodes_of(
        cls,
        num_nodes: int,
        devices_per_node: int,
        inter_bandwidth_bytes_per_s: float,
        intra_bandwidth_bytes_per_s: float,
        inter_latency_s: float = 0.0,
        intra_latency_s: float = 0.0,
    ) -> Topology:
        """``num_nodes`` × ``devices_per_node``; a single node is a flat switch."""
        if num_nodes == 1:
            return cls(list(range(devices_per_node)), intra_bandwidth_bytes_per_s, intra_latency_s)
        return cls.symmetric_tree(
            [num_nodes, devices_per_node],
            [inter_bandwidth_bytes_per_s, intra_bandwidth_bytes_per_s],
            [inter_latency_s, intra_latency_s],
        )

    def restricted(self, ranks: Sequence[int]) -> Topology:
        """The sub-cluster of `ranks` (renumbered 0.. in the order given): the same switches and
        per-level links with every other device removed, so that traffic among `ranks` takes the
        routes it takes in the whole cluster (an expert-parallel group of a data-parallel mesh). Ring
        nodes must be kept whole (a partial ring has other edges)."""
        ranks = [int(r) for r in ranks]
        if not ranks or len(set(ranks)) != len(ranks) or any(not 0 <= r < self.num_devices for r in ranks):
            raise ValueError(f"ranks={ranks!r}: expected distinct device ids in [0, {self.num_devices})")
        new_id = {r: i for i, r in enumerate(ranks)}
        if self.ring_edge_bandwidth_bytes_per_s is not None:
            for members in self._node_groups:
                kept = [d for d in members if d in new_id]
                if kept and len(kept) != len(members):
                    raise ValueError(f"ranks={ranks!r}: ring node {members} must be kept whole or not at all")

        def prune(group: list) -> list:
            out = []
            for child in group:
                if isinstance(child, int):
                    if child in new_id:
                        out.append(new_id[child])
                elif kept := prune(child):
                    out.append(kept)
            return out

        spec = prune(self.spec)
        depth = tree_depth(spec)  # an asymmetric tree loses its deepest levels with their devices
        return type(self)(
            spec,
            self._bw[:depth],
            self._lat[:depth],
            ring_edge_bandwidth_bytes_per_s=self.ring_edge_bandwidth_bytes_per_s,
            name=f"{self.name}[{len(ranks)} of {self.num_devices}]",
            source=self.source,
        )

    # ---- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "spec": self.spec,
            "level_bandwidth_bytes_per_s": list(self._bw),
            "level_latency_s": list(self._lat),
            "ring_edge_bandwidth_bytes_per_s": (
                None
                if self.ring_edge_bandwidth_bytes_per_s is None
                else [float(b) for b in self.ring_edge_bandwidth_bytes_per_s]
            ),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Topology:
        unknown = set(data) - {
            "name",
            "source",
            "spec",
            "level_bandwidth_bytes_per_s",
            "level_latency_s",
            "ring_edge_bandwidth_bytes_per_s",
        }
        if unknown:
            raise ValueError(f"topology JSON: unknown keys {sorted(unknown)}")
        if "spec" not in data or "level_bandwidth_bytes_per_s" not in data:
            raise ValueError("topology JSON: needs 'spec' and 'level_bandwidth_bytes_per_s'")
        return cls(**data)

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> Topology:
        text = str(text_or_path)
        if not text.lstrip().startswith("{"):
            text = Path(text_or_path).read_text()
        return cls.from_dict(json.loads(text))

    @classmethod
    def preset(cls, name: str) -> Topology:
        """A published cluster (see ``PRESETS``); ``name`` is case-insensitive; ``NAME@N``: its link
        classes at N devices (``topology_presets.resolve_preset``)."""
        key, p = resolve_preset(name)
        return cls(
            p.spec(),
            p.level_bandwidth_bytes_per_s,
            p.level_latency_s,
            ring_edge_bandwidth_bytes_per_s=p.ring_edge_bandwidth_bytes_per_s,
            name=key,
            source=p.source,
        )

    @classmethod
    def resolve(cls, value: str) -> Topology:
        """CLI helper: a preset name, a JSON file, or inline JSON (a topology object)."""
        if value.lower().replace("-", "_").partition("@")[0] in PRESETS:
            return cls.preset(value)
        if value.lstrip().startswith("{") or Path(value).is_file():
            return cls.from_json(value)
        raise ValueError(f"--topology={value!r}: not a preset ({sorted(PRESETS)}), a JSON file or inline JSON")
