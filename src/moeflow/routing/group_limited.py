"""Group-limited routing (DeepSeek-V2 §2.1.3, DeepSeek-V3 §2.1.2): a token first picks its best
`topk_group` groups of experts, then its top-k experts inside them.

The experts are split into groups; a group's score for a token is the sum of the `score_topn`
largest selection scores of its experts (DeepSeek-V3: the top 2; DeepSeek-V2: the top 1, i.e. the
maximum); the `topk_group` best groups are kept and every other expert is masked to −∞ before the
top-k. Two kinds of group:

- `n_group`: `E / n_group` consecutive experts each (DeepSeek-V3's `n_group`, `topk_group`);
- `node_limited = M`: the nodes of the expert-parallel layout, each holding the experts its ranks
  own, so a token's experts span at most M nodes (DeepSeek-V3 §2.1.2's node-limited routing, the
  bound TA-MoE and FasterMoE's hierarchical gate approach with a loss or a quota); a node's score
  is the sum of its top `k / M` scores. Without a layout (one process, or a cost model of another
  cluster) there is one node and nothing is masked: the topology-free form.

Group selection breaks ties to the lower group id; only the selection scores (bias included) are
seen, never the combine weights.

Shape suffixes: T tokens, E experts, G groups of experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moeflow.core.checks import positive_int
from moeflow.routing.routing import RoutingLayout, stable_topk


@dataclass(frozen=True)
class GroupLimit:
    """Which groups a token may route to (module docstring). Exactly one of `n_group` (> 1) and
    `node_limited` is set."""

    num_experts: int
    top_k: int
    n_group: int = 1
    """Equal groups of consecutive experts (1: no group limit unless `node_limited`)."""
    topk_group: int = 1
    """Groups kept per token (with `n_group`)."""
    node_limited: int | None = None
    """M: the most nodes of the EP layout a token's experts may span (groups = nodes)."""
    score_topn: int | None = None
    """A group's score: the sum of its this many largest scores (None: 2 with `n_group`, as
    DeepSeek-V3; `k / M` with `node_limited`, §2.1.2)."""

    def __post_init__(self) -> None:
        positive_int("n_group", self.n_group)
        positive_int("topk_group", self.topk_group)
        if self.node_limited is not None:
            positive_int("node_limited", self.node_limited)
            if self.n_group > 1:
                raise ValueError(
                    f"node_limited={self.node_limited} with n_group={self.n_group}: groups are either the "
                    f"layout's nodes or n_group equal blocks, not both"
                )
        if self.score_topn is not None:
            positive_int("group_score_topn", self.score_topn)
        if self.n_group == 1:
            return
        if self.num_experts % self.n_group:
            raise ValueError(f"n_group={self.n_group} must divide num_experts={self.num_experts}")
        size = self.num_experts // self.n_group
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
        if self.topk_group * size < self.top_k:
            raise ValueError(
                f"topk_group={self.topk_group} groups of {size} experts hold fewer than top_k={self.top_k} experts"
            )
        if self.group_topn > size:
            raise ValueError(f"group_score_topn={self.group_topn} exceeds the {size} experts of a group")

    @classmethod
    def of(cls, num_experts: int, top_k: int, options) -> GroupLimit | None:
        """The limit a gate's options ask for (`n_group`, `topk_group`, `group_score_topn`,
        `node_limited`), or None when they ask for none."""
        if options.n_group == 1 and options.node_limited is None:
            if options.topk_group != 1:
                raise ValueError(f"topk_group={options.topk_group} needs n_group > 1 (got n_group=1)")
            return None
        return cls(
            num_experts, top_k, options.n_group, options.topk_group, options.node_limited, options.group_score_topn
        )

    @property
    def group_topn(self) -> int:
        """The number of scores summed into a group's score."""
        if self.score_topn is not None:
            return self.score_topn
        return 2 if self.node_limited is None else max(1, self.top_k // self.node_limited)

    def mask(self, scores_TE: torch.Tensor, layout: RoutingLayout | None) -> torch.Tensor:
        """`scores_TE` with the experts outside each token's kept groups set to −∞."""
        num_tokens = scores_TE.shape[0]
        if self.node_limited is None:
            size = self.num_experts // self.n_group
            group_TG = scores_TE.view(num_tokens, self.n_group, size).topk(self.group_topn, dim=-1).values.sum(-1)
            kept_TG = _top_groups(group_TG, self.topk_group)
            # Each group's experts kept or −∞ by one `where` over the group-major view (the same
            # values as masking with the group mask repeated per expert, without making that mask).
            kept_TG1 = kept_TG.unsqueeze(-1)
            return torch.where(kept_TG1, scores_TE.view(num_tokens, self.n_group, size), -math.inf).view_as(scores_TE)
        group_E = self._node_of_experts(layout, scores_TE.device)
        if group_E is None:
            return scores_TE
        num_groups = int(group_E.max()) + 1
        member_GE = group_E[None, :] == torch.arange(num_groups, device=scores_TE.device)[:, None]
        topn = min(self.group_topn, int(member_GE.sum(1).min()))
        masked_TGE = scores_TE[:, None, :].masked_fill(~member_GE, -math.inf)
        group_TG = masked_TGE.topk(topn, dim=-1).values.sum(-1)
        kept_TG = _top_groups(group_TG, self.node_limited)
        return scores_TE.masked_fill(~kept_TG[:, group_E], -math.inf)

    def _node_of_experts(self, layout: RoutingLayout | None, device) -> torch.Tensor | None:
        """int64 `[E]`: the node of each expert's owner, numbered 0..G-1; None when every expert
        is on one node or the most nodes allowed are all of them (nothing to limit)."""
        if layout is None:
            return None
        node_W = torch.tensor(layout.node_of, dtype=torch.int64)
        nodes, group_E = torch.unique(node_W[layout.owner_E.cpu()], return_inverse=True)
        if nodes.numel() <= self.node_limited:
            return None
        sizes = torch.bincount(group_E, minlength=nodes.numel()).sort().values
        if int(sizes[: self.node_limited].sum()) < self.top_k:
            raise ValueError(
                f"node_limited={self.node_limited}: {self.node_limited} node(s) of this layout can hold only "
                f"{int(sizes[: self.node_limited].sum())} experts, fewer than top_k={self.top_k}"
            )
        return group_E.to(device)


def _top_groups(group_TG: torch.Tensor, keep: int) -> torch.Tensor:
    """bool `[T, G]`: each token's `keep` best groups (ties: the lower group id)."""
    kept_TG = torch.zeros_like(group_TG, dtype=torch.bool)
    return kept_TG.scatter(1, stable_topk(group_TG, keep), True)
