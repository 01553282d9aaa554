"""`Routing`: what a gate decided for the tokens of one rank, in one shape for every kind of gate.

The rows a rank sends to the experts are *assignments*: one row per (token, expert) choice for
token-choice gates (k per token) and expert-choice gates (any number per token, C per expert), or
one row per *slot* for slot-based gates (SoftMoE: a slot is a weighted mix of all the rank's
tokens). Every row has an expert (`expert_A`), so counts, flows, planners and the dispatch plan
see one thing; how rows are made from tokens and how outputs go back to tokens is the routing's
own business (`rows` / `combine`), so the layer has no case per gate kind.

"The same as one process" (the invariant every test checks) means: routing is a function of the
rank's own batch. Token choice routes each token alone; expert choice picks each expert's top-C
among the rank's tokens; SoftMoE mixes the rank's tokens into its slots. Expert parallelism over
W ranks then equals the single-process layer applied to each rank's tokens separately.

Shape suffixes: T tokens on this rank, D d_model, E experts, K top-k, A rows (assignments, or
the slots of slot-based routing).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, replace

import torch

from moeflow.core import dispatch

ROUTING_KINDS = ("token_choice", "expert_choice", "soft")
"""What a gate's rows are: a token's choices (k per token), an expert's choices (C per expert,
0..E per token), or slots mixing all tokens."""


@dataclass
class SlotMixing:
    """Slot-based routing (SoftMoE): slot rows are mixtures of tokens, outputs mixtures of slots."""

    dispatch_TA: torch.Tensor
    """fp32 `[T, A]`: weight of token t in slot a (each column sums to 1 over the rank's tokens)."""
    combine_TA: torch.Tensor
    """fp32 `[T, A]`: weight of slot a in token t's output (each row sums to 1 over the slots)."""


@dataclass
class Routing:
    """A gate's decision for the tokens of this rank (module docstring)."""

    expert_A: torch.Tensor
    """int64 `[A]`: global expert id of each row."""
    weight_A: torch.Tensor
    """fp32 `[A]`: combine weight of each row (differentiable w.r.t. the gate); 1 for slots."""
    probs_TE: torch.Tensor
    """fp32 `[T, E]`: router probabilities, for balance terms (P_e) and statistics."""
    logits_TE: torch.Tensor
    """fp32 `[T, ·]`: raw router logits (experts, or slots), for the z-loss."""
    num_tokens: int
    """T, the tokens routed (needed when A = 0)."""
    token_A: torch.Tensor | None = None
    """int64 `[A]`: the token of each row (token and expert choice); None for slot rows."""
    slots: SlotMixing | None = None
    """How slot rows mix tokens (slot-based routing); None for token rows."""
    kind: str = "token_choice"
    """One of `ROUTING_KINDS`."""
    redirected: int = 0
    """Assignments a topology-aware gate moved from a remote to a local expert."""
    input_scaled: bool = False
    """Each row is its token scaled by the row's weight and the outputs are summed unweighted
    (Llama 4), instead of weighting the outputs."""
    sequence_length: int | None = None
    """The rank's tokens are consecutive sequences of `sequence_length` tokens (the layer sets it
    from its input's shape `[..., T, D]`; sequence-wise balance terms use it); None: one sequence."""
    choice_major_k: int | None = None
    """K when the rows are known to be choice-major token choices with none dropped (`token_A` is
    `0..T-1` repeated K times: `token_choices` builds them so), 0 when known not to be; None:
    unknown, checked where used (`dispatch.choices_per_token`, which compares on the device and
    so waits for it: the gates that know say so instead)."""
    _counts_E: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    """`expert_counts`, once computed (never copied by `dataclasses.replace`: new rows, new counts)."""
    _inverse: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False, repr=False, compare=False)
    """(order, its inverse permutation): `rows` and `combine` of one forward share the inverse."""

    def __post_init__(self) -> None:
        if self.kind not in ROUTING_KINDS:
            raise ValueError(f"Routing kind={self.kind!r}: expected one of {list(ROUTING_KINDS)}")
        if (self.token_A is None) == (self.slots is None):
            raise ValueError("Routing: give exactly one of token_A (token rows) or slots (slot rows)")

    def within_capacity(self, capacity_factor: float | None, num_experts: int, top_k: int) -> tuple[Routing, int]:
        """(routing, dropped): token choice keeps at most C = ceil(c·k·T/E) assignments per expert,
        in row order (choice-major: first choices before second, then earlier tokens); a dropped
        assignment contributes zero. Expert choice has its capacity built in and slots never drop."""
        if capacity_factor is None or self.kind != "token_choice":
            return self, 0
        capacity = math.ceil(capacity_factor * top_k * self.num_tokens / num_experts)
        keep_A = dispatch.position_in_expert(self.expert_A, num_experts) < capacity
        token_A = self.token_A[keep_A]  # its size is the host's once the mask is applied (a GPU's one sync)
        dropped = self.expert_A.numel() - token_A.numel()
        kept = replace(
            self,
            token_A=token_A,
            expert_A=self.expert_A[keep_A],
            weight_A=self.weight_A[keep_A],
            # Nothing dropped: the rows are those of before. Some dropped: the rows may still happen
            # to be whole choices (every second choice dropped), which only the check can tell.
            choice_major_k=self.choice_major_k if dropped == 0 else None,
        )
        return kept, dropped

    def expert_counts(self, num_experts: int) -> torch.Tensor:
        """int64 `[E]`: rows per expert (`dispatch.count_per_expert`), computed once per routing:
        the layer's flow, its choices before capacity and the balance term's share all read it."""
        if self._counts_E is None:
            self._counts_E = dispatch.count_per_expert(self.expert_A, num_experts)
        return self._counts_E

    def _choices_per_token(self, num_tokens: int) -> int:
        """`dispatch.choices_per_token` of the rows, without the check where the gate said it."""
        if self.choice_major_k is not None and num_tokens == self.num_tokens:
            return self.choice_major_k
        return dispatch.choices_per_token(self.token_A, num_tokens)

    def _inverse_of(self, order_A: torch.Tensor) -> torch.Tensor:
        """`dispatch.inverse_permutation(order_A)`, computed once for the `rows` and `combine` of an order."""
        if self._inverse is None or self._inverse[0] is not order_A:
            self._inverse = (order_A, dispatch.inverse_permutation(order_A))
        return self._inverse[1]

    def rows(self, x_TD: torch.Tensor, order_A: torch.Tensor) -> torch.Tensor:
        """The rows to send `[A, D]`, in the order `order_A` (one gather for token rows; backward a
        gather and a sum over K for undropped token choices, a scatter otherwise)."""
        if self.slots is None:
            k = self._choices_per_token(self.num_tokens)
            if k:
                rows_AD = dispatch.gather_token_rows(x_TD, self.token_A, order_A, k, self._inverse_of(order_A))
            else:
                rows_AD = x_TD.index_select(0, self.token_A[order_A])
            return rows_AD * self.weight_A[order_A, None].to(rows_AD.dtype) if self.input_scaled else rows_AD
        return self.slots.dispatch_TA.index_select(1, order_A).t().to(x_TD.dtype) @ x_TD

    def combine(self, y_AD: torch.Tensor, order_A: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Each token's output `[T, D]` from the rows' outputs (in `order_A` order): the weighted sum
        of its rows (rows of dropped assignments are absent and add zero), or the mix of the slots."""
        if self.slots is None:
            weight_A = torch.ones_like(self.weight_A) if self.input_scaled else self.weight_A
            k = self._choices_per_token(num_tokens)
            if k:  # every token has its k rows: gather back and sum, no scatter
                return dispatch.sum_token_rows(y_AD, weight_A, order_A, k, self._inverse_of(order_A))
            weighted_AD = y_AD * weight_A[order_A, None].to(y_AD.dtype)
            out = torch.zeros((num_tokens, y_AD.shape[1]), dtype=y_AD.dtype, device=y_AD.device)
            return out.index_add(0, self.token_A[order_A], weighted_AD)
        return self.slots.combine_TA.index_select(1, order_A).to(y_AD.dtype) @ y_AD


@dataclass(frozen=True)
class RoutingLayout:
    """Where experts live, for gates that route by topology; passed by the layer every forward."""

    rank: int
    """This rank's index in the expert-parallel group."""
    owner_E: torch.Tensor
    """int64 `[E]`: rank owning each expert."""
    node_of: tuple[int, ...]
    """Node index of every rank of the group."""

    @classmethod
    def single(cls, num_experts: int) -> RoutingLayout:
        return cls(0, torch.zeros(num_experts, dtype=torch.int64), (0,))

    def local_experts_E(self) -> torch.Tensor:
        """bool `[E]`: experts owned by a rank on this rank's node."""
        node_W = torch.tensor(self.node_of, dtype=torch.int64)
        return node_W[self.owner_E] == self.node_of[self.rank]


def stable_topk(scores_TE: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores along the last dim, by descending score; ties go to the
    lower index.

    `torch.topk` does not promise an order among equal values; a stable descending sort does, but
    sorting all E scores of every token costs O(E log E) where the top-k costs O(E) — with 256
    fine-grained experts the sort was the gate's largest op. So: `topk`, then the k chosen ordered
    by (score, index) with a sort of k; rows where the k-th score ties a score outside the k (the
    chosen set itself is ambiguous: a zero router ties everything) take the full stable sort.
    Most batches have no tie at all: where the k + 1 largest of every row strictly decrease (no
    two equal, no NaN), the k chosen and their order are the only ones, and topk's own answer is
    the sort's prefix. Branching is a host decision, which on an accelerator waits for the device;
    there the top-k runs on a key without ties instead (`stable_topk_by_key`), or the full sort.
    """
    num = scores_TE.shape[-1]
    if k >= num or scores_TE.numel() == 0:
        return torch.sort(scores_TE, dim=-1, descending=True, stable=True).indices[..., :k]
    if scores_TE.device.type != "cpu":
        if scores_TE.dtype in _KEYED_DTYPES:
            return stable_topk_by_key(scores_TE, k)
        return torch.sort(scores_TE, dim=-1, descending=True, stable=True).indices[..., :k]
    top = torch.topk(scores_TE, k + 1, dim=-1)  # one more: does the k-th tie the next?
    if bool((top.values.narrow(-1, 0, k) > top.values.narrow(-1, 1, k)).all()):  # `>`: false for ±0, NaN
        return top.indices.narrow(-1, 0, k)
    kth = top.values[..., k - 1 : k]
    chosen = top.indices[..., :k].sort(dim=-1).values  # ascending ids (the first k are a top-k)
    order = torch.sort(scores_TE.gather(-1, chosen), dim=-1, descending=True, stable=True).indices
    out = chosen.gather(-1, order)
    ambiguous = (scores_TE >= kth).sum(-1) > k
    if bool(ambiguous.any()):
        rows = ambiguous.nonzero(as_tuple=True)
        out[rows] = torch.sort(scores_TE[rows], dim=-1, descending=True, stable=True).indices[..., :k]
    return out


def without_autocast(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast turned off for the routing math (fp32 whatever the caller's autocast state):
    entered only where autocast is on, since entering it costs a few microseconds every call."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


_KEYED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Score dtypes `stable_topk_by_key` orders exactly: each value is a float32 (its 32 bits a key)."""


def stable_topk_by_key(scores_TE: torch.Tensor, k: int) -> torch.Tensor:
    """`stable_topk` as one `topk` on int64 keys that tie nowhere (no host branch; for float32,
    float16 and bfloat16 scores, each exactly a float32).

    A float32's bits, read as an int32 with the 31 low bits of the negatives flipped, order as the
    floats do (−∞ < ... < −0 < +0 < ... < +∞ < NaN, NaN made positive and quiet first, −0 made +0
    first since the sort holds them equal). The key `order · 2³² + (E − 1 − e)` then orders by score,
    and equal scores by the lower expert id first; keys are distinct within a row, so the k largest
    in descending order are exactly the prefix of the stable descending sort.
    """
    num = scores_TE.shape[-1]
    scores = scores_TE.float()
    # −0 → +0 (IEEE: −0 + 0 = +0, and x + 0 = x for every other x) and every NaN (the one value
    # unequal to itself) → one NaN, above +∞ as in the sort: three kernels, where two `where`s took four.
    scores = torch.where(scores == scores, scores + 0.0, math.nan)
    bits = scores.view(torch.int32)
    order = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    below_E = torch.arange(num - 1, -1, -1, device=scores_TE.device)  # E − 1 − e: lower ids larger
    # `below_E + 2³² · order` in one op: the int32 order is widened to int64 before the product
    # (type promotion), as `order.to(int64) * 2**32 + below_E` computed it in three.
    return torch.topk(torch.add(below_E, order, alpha=2**32), k, dim=-1).indices


def token_choices(
    expert_TK, weight_TK, probs_TE, logits_TE, redirected: int = 0, input_scaled: bool = False
) -> Routing:
    """Token-choice routing from `[T, K]` choices, stored choice-major (all first choices, then all
    second choices, ...): the capacity priority order."""
    num_tokens, k = expert_TK.shape
    token_KT = torch.arange(num_tokens, device=expert_TK.device).expand(k, num_tokens)
    return Routing(
        expert_A=expert_TK.t().reshape(-1),
        weight_A=weight_TK.t().reshape(-1),
        probs_TE=probs_TE,
        logits_TE=logits_TE,
        num_tokens=num_tokens,
        token_A=token_KT.reshape(-1),
        redirected=redirected,
        input_scaled=input_scaled,
        choice_major_k=k if num_tokens else 0,  # `dispatch.choices_per_token` of these rows
    )
