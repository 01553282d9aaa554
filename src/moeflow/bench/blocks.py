"""The model a strategy benchmark times: `blocks` MoE layers, each followed by a dense residual part
(the non-MoE layer of Pro-Prophet's block, §V), so that a planner that plans ahead can prefetch
the copies of layer i+1 during block i (`strategies.prefetch.BlockPrefetch`). One block is one bare
MoE layer (no dense part): what the benchmark timed before blocks existed.

Shape suffixes: T tokens on this rank, D d_model, W ranks, E experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.layer import MoELayer
from moeflow.strategies.prefetch import BlockPrefetch


class BenchBlocks(nn.Module):
    """MoE → dense → MoE → dense ...; `prefetch` wraps the MoE layers in a `BlockPrefetch`."""

    def __init__(self, layers: list[MoELayer], prefetch: bool = False) -> None:
        super().__init__()
        self.moe = nn.ModuleList(layers)
        d = layers[0].d_model
        gen = torch.Generator().manual_seed(len(layers))  # the same dense weights for every variant
        self.dense = nn.ModuleList(nn.Linear(d, d) for _ in layers) if len(layers) > 1 else nn.ModuleList()
        with torch.no_grad():
            for linear in self.dense:
                linear.weight.copy_(torch.randn(d, d, generator=gen) / d**0.5)
                linear.bias.zero_()
        self.prefetch = BlockPrefetch(layers) if prefetch else None

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        if len(self.moe) == 1:
            return self.moe[0](x_TD)
        h_TD = x_TD
        for layer, linear in zip(self.moe, self.dense):
            h_TD = h_TD + layer(h_TD)
            h_TD = h_TD + F.gelu(linear(h_TD))
        return h_TD

    def finish(self) -> None:
        """After backward: land the prefetch's gradient sums (no-op without it)."""
        if self.prefetch is not None:
            self.prefetch.finish()

    def set_popularity(self, probs_BWE: torch.Tensor, rank: int) -> None:
        """Trace replay: block b's sampled gate draws this rank's experts from `probs_BWE[b, rank]`."""
        for layer, probs_WE in zip(self.moe, probs_BWE):
            row_E = probs_WE[rank].clamp_min(1e-6)  # never fewer than top_k experts with mass
            layer.gate.popularity_E.copy_(row_E / row_E.sum())
