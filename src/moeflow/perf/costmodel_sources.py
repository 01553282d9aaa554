"""Where a `CostModel` comes from: a published cluster of the five papers (`perf.topology_presets`;
P = 90% of the device's peak, FasterMoE §3.1; FSMoE's testbeds with the α-β constants of FSMoE
Fig. 5), a ``moeflow profile`` / cost-model JSON file, the CLI's choice between the two, and a
sub-cluster of some ranks. A part of `moeflow.perf.costmodel.CostModel` (its base class),
kept apart from the pricing, which never reads a file or a preset.

It reads from the cost model its fields (``topology``, ``gemm_flops_per_s``, ``fits``, ...).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moeflow.perf.alpha_beta import AlphaBeta, published_fits
from moeflow.perf.topology import Topology
from moeflow.perf.topology_presets import PRESETS, preset_peak_flops

if TYPE_CHECKING:
    from moeflow.perf.costmodel import CostModel

# FasterMoE §3.1: "a V100 GPU can achieve more than 90% of its peak throughput when running
# GeMMs"; the paper's model uses 90% of peak as P.
GEMM_PEAK_FRACTION = 0.9
GROUP_FIT_KINDS = frozenset({"a2a", "all_gather", "reduce_scatter", "all_reduce", "broadcast", "reduce", "copies"})
"""Fits measured over every device of the group (not valid on a sub-cluster: `CostModel.restricted`)."""


class CostModelSources:
    """The constructors, the sub-cluster and the JSON of `CostModel` (module docstring)."""

    # ---- sub-cluster --------------------------------------------------------------------------
    def restricted(self, ranks: Sequence[int]) -> CostModel:
        """This model on the sub-cluster of `ranks` (`Topology.restricted`: the same links and
        routes), for an expert-parallel group of a data-parallel mesh. Fits of whole-group
        collectives (all-to-all, ring collectives, copies) were measured over every device and are
        dropped (the link model prices the group); per-device and point-to-point fits stay."""
        fits = {k: f for k, f in self.fits.items() if k not in GROUP_FIT_KINDS}
        topology = self.topology.restricted(ranks)
        return dataclasses.replace(
            self, topology=topology, fits=fits, name=f"{self.name}{topology.name[len(self.topology.name) :]}"
        )

    # ---- construction and JSON --------------------------------------------------------------------
    @classmethod
    def from_preset(
        cls, name: str, gemm_flops_per_s: float | None = None, with_published_fits: bool = True
    ) -> CostModel:
        """A paper cluster; P defaults to 90% of the device's peak (FasterMoE §3.1). FSMoE testbeds
        also carry the α-β constants of FSMoE Fig. 5 unless ``with_published_fits=False``; ``NAME@N``: its
        link classes at N devices (`topology_presets.resolve_preset`), without fits (measured at its size)."""
        topo = Topology.preset(name)
        flops = gemm_flops_per_s if gemm_flops_per_s is not None else GEMM_PEAK_FRACTION * preset_peak_flops(name)
        fits = published_fits(topo.name) if with_published_fits else {}  # none at another size (NAME@N)
        return cls(topo, flops, fits, name=topo.name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "topology": self.topology.to_dict(),
            "gemm_flops_per_s": self.gemm_flops_per_s,
            "bytes_per_element": self.bytes_per_element,
            "a2a_calibration": self.a2a_calibration,
            "host_cores": self.host_cores,
            "backend": self.backend,
            "pipeline_overlap": list(self.pipeline_overlap),
            "fits": {k: f.to_dict() for k, f in self.fits.items()},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostModel:
        """From ``to_dict`` output or a ``moeflow profile`` JSON (which has these keys and more)."""
        for key in ("topology", "gemm_flops_per_s"):
            if key not in data:
                raise ValueError(f"cost model JSON: missing key {key!r}")
        fits = {k: AlphaBeta.from_dict(f) for k, f in data.get("fits", {}).items()}
        return cls(
            Topology.from_dict(data["topology"]),
            float(data["gemm_flops_per_s"]),
            fits,
            int(data.get("bytes_per_element", 4)),
            data.get("name", "profile"),
            data.get("host_cores"),
            bool(data.get("a2a_calibration", True)),
            data.get("backend", "nccl"),
            tuple(data.get("pipeline_overlap") or (1.0, 1.0)),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"cost model file {str(path)!r} does not exist")
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"cost model file {str(path)!r}: not JSON ({exc.msg})") from None
        except UnicodeDecodeError:
            raise ValueError(f"cost model file {str(path)!r}: not JSON (binary data)") from None
        try:
            return cls.from_dict(data)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"cost model file {str(path)!r}: {exc}") from None

    @classmethod
    def resolve(cls, value: str, gemm_flops_per_s: float | None = None) -> CostModel:
        """CLI helper: a topology preset name or a profile/cost-model JSON file."""
        if value.lower().replace("-", "_").partition("@")[0] in PRESETS:
            return cls.from_preset(value, gemm_flops_per_s)
        if Path(value).is_file():
            if gemm_flops_per_s is None:
                return cls.load(value)
            # override before validation: a profile without a GEMM sweep has no P of its own
            return cls.from_dict({**cls.load(value).to_dict(), "gemm_flops_per_s": gemm_flops_per_s})
        raise ValueError(f"cost model {value!r}: not a topology preset ({sorted(PRESETS)}) nor a profile JSON file")
