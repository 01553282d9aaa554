"""Published clusters of the five papers, as topology presets; every number cites its source.

`Topology.preset(name)` builds one; `preset_peak_flops(name)` gives its device's peak for the
cost model's GEMM-time default (90% of it, FasterMoE §3.1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

GBIT = 1e9 / 8  # bytes per second in one Gb/s
GBYTE = 1e9


@dataclass(frozen=True)
class Preset:
    """A published cluster; every number cites its source."""

    nodes: int
    """Number of nodes (servers)."""
    devices_per_node: int | Sequence[Any]
    """Devices per node, or the nested spec of one node (e.g. two sockets of two GPUs)."""
    level_bandwidth_bytes_per_s: Sequence[float]
    """Per-level link bandwidth, root (inter-node network) first."""
    level_latency_s: Sequence[float]
    """Per-level one-way latency, root first."""
    peak_flops_per_s: float
    """Dense fp32 (or tensor-core fp16 where stated) peak of one device, for GEMM-time defaults."""
    source: str
    """Citation of every number above."""
    ring_edge_bandwidth_bytes_per_s: Sequence[float] | None = None
    """Ring edges inside a node (NVLink rings), see ``Topology.ring_edge_bandwidth_bytes_per_s``."""

    def node_size(self) -> int:
        """Devices in one node."""
        shape = self.devices_per_node
        count = 0 if not isinstance(shape, int) else shape

        def leaves(s: Any) -> int:
            return 1 if isinstance(s, int) else sum(leaves(c) for c in s)

        return count or leaves(shape)

    def scaled(self, num_devices: int) -> Preset:
        """The same link classes with `num_devices` devices: as many nodes of this layout as fit
        exactly (the scale benchmark's clusters, `moeflow simulate --sweep NAME@N`)."""
        per_node = self.node_size()
        if num_devices < per_node or num_devices % per_node:
            raise ValueError(
                f"num_devices={num_devices}: must be a positive multiple of the {per_node} devices per node"
            )
        return replace(self, nodes=num_devices // per_node, source=f"{self.source}; scaled to {num_devices} devices")

    def spec(self) -> list:
        out, nxt = [], 0
        for _ in range(self.nodes):
            shape = self.devices_per_node
            if isinstance(shape, int):
                out.append(list(range(nxt, nxt + shape)))
                nxt += shape
            else:  # nested node layout: renumber devices consecutively

                def renum(s: Any) -> Any:
                    nonlocal nxt
                    if isinstance(s, int):
                        nxt += 1
                        return nxt - 1
                    return [renum(c) for c in s]

                out.append(renum(shape))
        return out


# PCIe 3.0 x16: 15.75 GB/s per direction (PCI-SIG spec, 8 GT/s × 16 lanes × 128/130);
# PCIe 4.0 x16: 31.5 GB/s. NVLink 2.0: 25 GB/s per direction per link (NVIDIA V100 whitepaper).
_PCIE3 = 15.75 * GBYTE
_PCIE4 = 31.5 * GBYTE
# Latencies are not published in the papers; ~5 µs for an InfiniBand/RoCE hop and ~1 µs inside a
# node are the usual figures (IB EDR switch port-to-port + NIC), documented as assumptions.
_NET_LAT, _NODE_LAT = 5e-6, 1e-6

PRESETS: dict[str, Preset] = {
    # FasterMoE §5.1: "johnny ... 16 GPUs on 2 worker nodes. Each worker node has 8 NVIDIA Tesla
    # V100-PCIE GPUs connected to 2 CPU sockets via PCIe switches. Although equipped with Infiniband
    # EDR, the bandwidth degrades to 50Gb/s". Intra-node: PCIe 3.0 x16. Peak: V100-PCIe 14 TFLOP/s
    # fp32 (NVIDIA datasheet); FasterMoE §3.1 uses 90% of peak as the GEMM throughput.
    "johnny": Preset(
        2,
        8,
        [50 * GBIT, _PCIE3],
        [_NET_LAT, _NODE_LAT],
        14e12,
        "FasterMoE §5.1 (johnny: 2x8 V100-PCIe, IB degraded to 50 Gb/s); PCIe 3.0 x16 spec",
    ),
    # FasterMoE §5.1: "trevor ... 4 NVIDIA V100-SXM2 GPUs in each node with NVLink interconnecting
    # them to form a heterogeneous ring, where half of the edges have double bandwidth via a bond of
    # two links. Infiniband EDR at 100Gb/s ... 64 GPUs in 16 nodes". Ring edges alternate 2 and 1
    # NVLink-2 links (50 / 25 GB/s); GPUs reach the NIC over PCIe 3.0 x16. V100-SXM2 15.7 TFLOP/s fp32.
    "trevor": Preset(
        16,
        4,
        [100 * GBIT, _PCIE3],
        [_NET_LAT, _NODE_LAT],
        15.7e12,
        "FasterMoE §5.1 (trevor: 16x4 V100-SXM2, NVLink ring with doubled edges, IB EDR 100 Gb/s)",
        ring_edge_bandwidth_bytes_per_s=[50 * GBYTE, 25 * GBYTE, 50 * GBYTE, 25 * GBYTE],
    ),
    # FSMoE §6 Table 3 and "Testbeds": testbed A = 6 nodes of Nvidia RTX A6000 (48 GPUs; Table 3
    # lists 8 GPUs per node, the prose says four, 48/6 = 8 agrees with Table 3), NVLink 112.5 GB/s,
    # PCIe 4.0 x16, Mellanox 200 Gb/s. We model the node as a switch at the NVLink figure. A6000 peak
    # 38.7 TFLOP/s fp32 (datasheet); FSMoE Fig. 5a fits beta_gemm = 2.29e-11 ms/FLOP (43.7 TFLOP/s).
    "fsmoe_a": Preset(
        6,
        8,
        [200 * GBIT, 112.5 * GBYTE],
        [_NET_LAT, _NODE_LAT],
        38.7e12,
        "FSMoE §6 Table 3 (testbed A: 6x8 RTX A6000, NVLink 112.5 GB/s, 200 Gb/s network)",
    ),
    # FSMoE §6 Table 3: testbed B = 8 nodes x 4 RTX 2080Ti, no NVLink, PCIe 3.0 x16, 100 Gb/s.
    # 2080Ti 13.4 TFLOP/s fp32 (datasheet).
    "fsmoe_b": Preset(
        8,
        4,
        [100 * GBIT, _PCIE3],
        [_NET_LAT, _NODE_LAT],
        13.4e12,
        "FSMoE §6 Table 3 (testbed B: 8x4 RTX 2080Ti, PCIe 3.0 x16, 100 Gb/s network)",
    ),
    # Hecate §6 "Testbeds": cluster A = 4 AWS p3dn.24xlarge, 8 V100-32G each, 300 GB/s NVLink,
    # 100 Gbps network. 300 GB/s is the aggregate bidirectional NVLink figure per GPU -> 150 GB/s
    # per direction. V100 15.7 TFLOP/s fp32.
    "hecate_a": Preset(
        4,
        8,
        [100 * GBIT, 150 * GBYTE],
        [_NET_LAT, _NODE_LAT],
        15.7e12,
        "Hecate §6 (cluster A: 4x p3dn.24xlarge, 8 V100 per node, NVLink 300 GB/s, 100 Gbps)",
    ),
    # Hecate §6: cluster B = 4 AWS p4d.24xlarge, 8 A100-40G each, 600 GB/s NVSwitch (300 GB/s per
    # direction), 400 Gbps network. A100 19.5 TFLOP/s fp32 (156 TF32; datasheet).
    "hecate_b": Preset(
        4,
        8,
        [400 * GBIT, 300 * GBYTE],
        [_NET_LAT, _NODE_LAT],
        19.5e12,
        "Hecate §6 (cluster B: 4x p4d.24xlarge, 8 A100 per node, NVSwitch 600 GB/s, 400 Gbps)",
    ),
    # Pro-Prophet §VI "Testbed": HPWNV node = 2 Xeon CPUs, 4 RTX 3090, each CPU connected to two
    # GPUs through PCIe 3.0, 100 Gb/s InfiniBand between nodes; evaluated with 4 and 8 nodes. The
    # socket-to-socket hop (UPI, ~20.8 GB/s per link, Intel datasheet) is an assumption: the paper
    # does not give it. 3090 35.6 TFLOP/s fp32 (datasheet).
    "prophet_hpwnv": Preset(
        4,
        [[0, 1], [2, 3]],
        [100 * GBIT, 20.8 * GBYTE, _PCIE3],
        [_NET_LAT, _NODE_LAT, _NODE_LAT],
        35.6e12,
        "Pro-Prophet §VI (HPWNV: 4x RTX 3090 on 2 sockets via PCIe 3.0, 100 Gb/s IB)",
    ),
    # Pro-Prophet §VI: HPNV = HPWNV plus one NVLink-3 bridge inside each pair of GPUs (3090 NVLink
    # bridge: 112.5 GB/s bidirectional -> 56.25 GB/s per direction, NVIDIA datasheet). Each pair is a
    # 2-member ring; the pair's uplink stays PCIe 3.0.
    "prophet_hpnv": Preset(
        4,
        [[0, 1], [2, 3]],
        [100 * GBIT, 20.8 * GBYTE, _PCIE3],
        [_NET_LAT, _NODE_LAT, _NODE_LAT],
        35.6e12,
        "Pro-Prophet §VI (HPNV: HPWNV + NVLink-3 between the GPUs of a pair, 4 nodes)",
        ring_edge_bandwidth_bytes_per_s=[56.25 * GBYTE],
    ),
    # Pro-Prophet §VI: LPWNV = HPWNV with RTX 2080Ti; Table V uses 2 nodes. 13.4 TFLOP/s fp32.
    "prophet_lpwnv": Preset(
        2,
        [[0, 1], [2, 3]],
        [100 * GBIT, 20.8 * GBYTE, _PCIE3],
        [_NET_LAT, _NODE_LAT, _NODE_LAT],
        13.4e12,
        "Pro-Prophet §VI (LPWNV: 4x RTX 2080Ti on 2 sockets via PCIe 3.0, 100 Gb/s IB, 2 nodes)",
    ),
}


def resolve_preset(name: str) -> tuple[str, Preset]:
    """A preset by name, case-insensitive, or the same link classes at another size: `NAME@N` is
    N devices in nodes of the preset's layout (its per-node spec, ring edges, level bandwidths and
    latencies), N a multiple of the devices per node (`Preset.scaled`). Returns (canonical name, preset)."""
    key, at, size = name.lower().replace("-", "_").partition("@")
    if key not in PRESETS:
        raise ValueError(f"topology preset={name!r}: unknown; choose from {sorted(PRESETS)} (or NAME@DEVICES)")
    if not at:
        return key, PRESETS[key]
    if not size.isdigit() or int(size) < 1:
        raise ValueError(f"topology preset={name!r}: expected NAME@DEVICES with DEVICES a positive integer")
    return f"{key}@{int(size)}", PRESETS[key].scaled(int(size))


def preset_peak_flops(name: str) -> float:
    """Device peak FLOP/s of a preset (for CostModel defaults); `NAME@N` as `resolve_preset`."""
    return resolve_preset(name)[1].peak_flops_per_s
