"""Shared pieces of the multi-rank equivalence checks: sizes, tolerance, inputs, one step of a
layer, and a planner that forces copies."""

from __future__ import annotations

import numpy as np
import torch

D, H = 16, 32
TOL = dict(rtol=1e-5, atol=1e-5)


def inputs(world: int, tokens: list[int], seed: int):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(tokens[r], D, generator=gen) for r in range(world)]
    gs = [torch.randn(tokens[r], D, generator=gen) for r in range(world)]
    return xs, gs


def forward_backward(layer, x, g, noise_seed):
    torch.manual_seed(noise_seed)  # noisy_topk draws its noise here, identically in both runs
    x = x.clone().requires_grad_()
    y = layer(x)
    ((y * g).sum() + layer.aux_loss).backward()
    return y.detach(), x.grad, layer.aux_loss.detach(), layer.stats


class ForcedCopies:
    """A planner that materializes a fixed pseudo-random set of extra copies (the same on every
    rank: seeded by the seed given, never by rank)."""

    def __init__(self, seed: int, share: float):
        self.seed, self.share = seed, share

    def __call__(self, flow_WE, placement, cost_model=None):
        rng = np.random.default_rng(self.seed)
        return placement.with_holders(rng.random(placement.holders_EW.shape) < self.share)
