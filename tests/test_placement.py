"""Placement, dispatch plan and permutations: pure functions, property-tested."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moeflow.core.dispatch import assignment_destinations, inverse_permutation, source_major_to_expert_major
from moeflow.core.expert_shape import ExpertShape
from moeflow.core.placement import (
    Placement,
    broadcast_tree,
    copies_by_tree,
    copy_tree,
    dispatch_counts,
    plain_ep_owners,
    tree_edges,
)
from moeflow.core.registry import LayerContext
from moeflow.core.sparse_collectives import bundles_of
from moeflow.strategies import PLANNERS


@st.composite
def placements_and_flows(draw):
    world = draw(st.integers(1, 6))
    experts = world * draw(st.integers(1, 3))
    base = Placement.expert_parallel(experts, world)
    extra = np.array(draw(st.lists(st.booleans(), min_size=experts * world, max_size=experts * world)))
    placement = base.with_holders(extra.reshape(experts, world))
    flow = np.array(draw(st.lists(st.integers(0, 20), min_size=world * experts, max_size=world * experts)))
    nodes = draw(st.integers(1, world))
    node_of = [r * nodes // world for r in range(world)]
    return placement, flow.reshape(world, experts), node_of


@settings(max_examples=150, deadline=None)
@given(placements_and_flows())
def test_every_assignment_reaches_exactly_one_holder(case):
    placement, flow, node_of = case
    plan = dispatch_counts(flow, placement, node_of)
    assert plan.shape == (*flow.shape, placement.world_size)
    np.testing.assert_array_equal(plan.sum(-1), flow)  # nothing lost, nothing duplicated
    assert (plan[:, ~placement.holders_EW] == 0).all() if plan.size else True
    world = placement.world_size
    node = np.asarray(node_of)
    for s in range(world):
        for e in range(placement.num_experts):
            row, held = plan[s, e], placement.holders_EW[e]
            if held[s]:
                assert row[s] == flow[s, e]  # local first
                continue
            near = held & (node == node[s])
            cand = near if near.any() else held
            assert (row[~cand] == 0).all()
            assert row[cand].max() - row[cand].min() <= 1  # spread evenly


@settings(max_examples=100, deadline=None)
@given(placements_and_flows(), st.integers(0, 10**6))
def test_assignment_destinations_follow_the_plan(case, seed):
    placement, flow, node_of = case
    plan = dispatch_counts(flow, placement, node_of)
    rng = np.random.default_rng(seed)
    source = int(rng.integers(placement.world_size))
    expert_A = torch.as_tensor(rng.permutation(np.repeat(np.arange(placement.num_experts), flow[source])))
    dest = assignment_destinations(expert_A, plan[source])
    got = np.zeros_like(plan[source])
    np.add.at(got, (expert_A.numpy(), dest.numpy()), 1)
    np.testing.assert_array_equal(got, plan[source])


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 5), st.integers(1, 5), st.integers(0, 10**6))
def test_regroup_is_a_permutation_to_expert_major_and_inverts(sources, experts, seed):
    counts = np.random.default_rng(seed).integers(0, 4, size=(sources, experts))
    labels = np.concatenate([np.full(counts[s, e], s * experts + e) for s in range(sources) for e in range(experts)])
    perm = source_major_to_expert_major(counts)
    if perm is None:  # identity: at most one source sent rows
        assert np.count_nonzero(counts.sum(1)) <= 1
        perm = np.arange(labels.size)
    assert sorted(perm.tolist()) == list(range(labels.size))
    regrouped = labels[perm]
    expected = np.concatenate([np.full(counts[s, e], s * experts + e) for e in range(experts) for s in range(sources)])
    np.testing.assert_array_equal(regrouped, expected)
    x = torch.randn(labels.size, 3)
    t = torch.as_tensor(perm)
    torch.testing.assert_close(x[t][inverse_permutation(t)], x)


def test_expert_parallel_placement_and_validation():
    p = Placement.expert_parallel(6, 3)
    assert p.owner_E.tolist() == [0, 0, 1, 1, 2, 2] and p.is_owners_only()
    plan = dispatch_counts(np.array([[1, 2, 3, 4, 5, 6]] * 3), p)
    assert plan[:, :, 1].sum() == 3 * (3 + 4)
    with pytest.raises(ValueError, match="num_experts=5"):
        Placement.expert_parallel(5, 2)
    with pytest.raises(ValueError, match=r"experts \[1\] are not held by their owner"):
        Placement(np.array([0, 1]), np.array([[True, False], [True, False]]))
    with pytest.raises(ValueError, match="outside"):
        Placement(np.array([0, 3]), np.ones((2, 2), bool))
    with pytest.raises(ValueError, match="flow_WE shape"):
        dispatch_counts(np.zeros((2, 6)), p)


def test_copied_experts_are_those_held_beyond_their_owner():
    """`Placement.copied_E` (kept on the placement, read by `PlacementPricer.of_placements`) against
    the holders compared with the owners alone; `held_everywhere` gives it without a pass."""
    rng = np.random.default_rng(2)
    for _ in range(60):
        world = int(rng.integers(1, 9))
        experts = world * int(rng.integers(1, 4))
        owner = rng.integers(0, world, experts)
        alone = Placement.owners_only(owner, world)
        placement = alone.with_holders(rng.random((experts, world)) < rng.choice([0.0, 0.05, 0.3]))
        want = np.flatnonzero((placement.holders_EW != alone.holders_EW).any(1))
        np.testing.assert_array_equal(placement.copied_E, want)
        shadows = rng.integers(0, experts, int(rng.integers(0, 4)))
        everywhere = Placement.held_everywhere(owner, world, shadows)
        assert everywhere == alone.with_holders(np.isin(np.arange(experts), shadows)[:, None])
        np.testing.assert_array_equal(
            everywhere.copied_E, np.flatnonzero((everywhere.holders_EW != alone.holders_EW).any(1))
        )
        assert everywhere.copied_E.dtype == np.int64


def test_planner_registry_and_the_one_plain_ep_owner_formula():
    ctx = LayerContext(4, 1, ExpertShape(8, 8))
    p = Placement.expert_parallel(4, 2).with_holders(np.ones((4, 2), bool))
    assert PLANNERS.build("ep", ctx)(np.ones((2, 4)), p) == Placement.expert_parallel(4, 2)
    with pytest.raises(ValueError, match=r"strategy='magic'.*'ep'"):
        PLANNERS.build("magic", ctx)
    assert plain_ep_owners(8, 4).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert np.array_equal(Placement.expert_parallel(8, 4).owner_E, plain_ep_owners(8, 4))
    with pytest.raises(ValueError, match="num_experts=6 must be a positive multiple of the expert-parallel size 4"):
        plain_ep_owners(6, 4)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=9), st.data())
def test_broadcast_tree_reaches_every_rank_once_and_crosses_each_node_once(node_of, data):
    owner = data.draw(st.integers(0, len(node_of) - 1))
    first, second = broadcast_tree(owner, node_of)
    have = {owner}
    for stage in (first, second):
        received = [dst for _, dst in stage]
        assert all(src in have for src, _ in stage), "a rank forwards only what it already has"
        assert not set(received) & have and len(set(received)) == len(received)
        have |= set(received)
    assert have == set(range(len(node_of)))
    assert all(src == owner for src, _ in first)
    assert all(node_of[src] == node_of[dst] for src, dst in second), "stage 2 stays inside nodes"
    remote = [dst for _, dst in first if node_of[dst] != node_of[owner]]
    assert sorted(node_of[d] for d in remote) == sorted(set(node_of) - {node_of[owner]}), "one copy per node"
    assert copies_by_tree(node_of, "gloo") == (len(set(node_of)) > 1)
    assert not copies_by_tree(node_of, "nccl") and not copies_by_tree(None, "gloo")


def test_broadcast_tree_leaders_never_pair_up_in_opposite_directions():
    # 2 nodes x 2 ranks: the leader has the owner's local index shifted by the owner's node.
    assert broadcast_tree(1, [0, 0, 1, 1]) == [[(1, 0), (1, 3)], [(3, 2)]]  # node 0: no shift
    assert broadcast_tree(2, [0, 0, 1, 1]) == [[(2, 3), (2, 1)], [(1, 0)]]  # node 1: shifted by one
    inter = {e for owner in range(4) for e in broadcast_tree(owner, [0, 0, 1, 1])[0] if e[0] // 2 != e[1] // 2}
    assert inter == {(0, 2), (1, 3), (2, 1), (3, 0)}
    assert not any((dst, src) in inter for src, dst in inter)


def _random_dispatch_case(rng):
    """A flow with ties (equal columns), zero rows, and holders anywhere, on nodes of any size."""
    world = int(rng.choice([1, 2, 3, 4, 6, 8, 16]))
    experts = world * int(rng.integers(1, 4))
    flow = rng.integers(0, 30, (world, experts))
    flow[rng.random(world) < 0.2] = 0  # silent sources
    flow[:, rng.random(experts) < 0.3] = rng.integers(0, 30)  # equal loads
    base = Placement.owners_only(rng.integers(0, world, experts), world)
    placement = base.with_holders(rng.random((experts, world)) < rng.choice([0.0, 0.1, 0.5, 0.9]))
    per_node = int(rng.choice([d for d in range(1, world + 1) if world % d == 0]))
    node_of = list(rng.permutation(np.arange(world) // per_node)) if rng.random() < 0.3 else None
    return flow, placement, node_of if node_of is not None else [r // per_node for r in range(world)]


def test_dispatch_plan_and_loads_equal_the_loop_version_on_random_cases():
    """`dispatch_entries` (runs of candidates, one binary search per source) against the plan
    built by rotating every source's destinations (tests/reference_planners.py), 400 cases."""
    from moeflow.core.placement import dispatch_loads

    from .reference_planners import dispatch_counts as reference

    rng = np.random.default_rng(39)
    for _ in range(400):
        flow, placement, node_of = _random_dispatch_case(rng)
        plan = dispatch_counts(flow, placement, node_of)
        np.testing.assert_array_equal(plan, reference(flow, placement, node_of))
        send, computed = dispatch_loads(flow, placement, node_of)
        np.testing.assert_array_equal(send, plan.sum(1))
        np.testing.assert_array_equal(computed, plan.sum(0).T)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=2, max_size=9), st.data())
def test_copy_tree_enters_each_node_once_and_reaches_exactly_the_holders(node_of, data):
    W = len(node_of)
    owner = data.draw(st.integers(0, W - 1))
    holders = sorted(data.draw(st.sets(st.sampled_from([r for r in range(W) if r != owner]))))
    first, second = copy_tree(owner, holders, node_of)
    have = {owner}
    for stage in (first, second):
        assert all(src in have for src, _ in stage), "a relay forwards only what it already has"
        have |= {dst for _, dst in stage}
    assert have == {owner, *holders} and len(first) + len(second) == len(holders)
    remote = [dst for _, dst in first if node_of[dst] != node_of[owner]]
    assert sorted(node_of[d] for d in remote) == sorted({node_of[h] for h in holders} - {node_of[owner]})
    assert all(node_of[src] == node_of[dst] for src, dst in second)
    assert copy_tree(owner, holders, None) == [[(owner, h) for h in holders], []]
    if len(holders) == W - 1:
        assert copy_tree(owner, holders, node_of) == broadcast_tree(owner, node_of)


def test_bundles_group_experts_by_owner_and_holders():
    holders = np.zeros((6, 3), dtype=bool)
    holders[[0, 1], 2] = True  # rank 0's two experts to rank 2: one bundle
    holders[2, 1] = True  # the owner itself: no copy
    holders[3, 0] = True
    holders[4, :] = True
    bundles = bundles_of(Placement.expert_parallel(6, 3).with_holders(holders))
    assert [(b.owner, b.experts, b.holders, b.everywhere) for b in bundles] == [
        (0, (0, 1), (2,), False),
        (1, (3,), (0,), False),
        (2, (4,), (0, 1), True),
    ]


def test_tree_edges_are_copy_tree_row_by_row():
    rng = np.random.default_rng(3)
    for _ in range(40):
        W = int(rng.integers(2, 10))
        node_of = list(rng.integers(0, 3, W)) if rng.random() < 0.8 else None
        K = int(rng.integers(1, 6))
        owner = rng.integers(0, W, K)
        holders = rng.random((K, W)) < 0.5
        k, src, dst, stage = tree_edges(holders, owner, node_of)
        for r in range(K):
            mine = [h for h in range(W) if holders[r, h] and h != owner[r]]
            want = copy_tree(int(owner[r]), mine, node_of)
            for s in (0, 1):
                got = sorted(zip(src[(k == r) & (stage == s)].tolist(), dst[(k == r) & (stage == s)].tolist()))
                assert got == sorted(want[s]), (r, s, node_of)


def _entries_plan_and_loads(flow, placement, node_of):
    """The NumPy computation: the plan's entries (`dispatch_entries`) written into the dense plan
    and summed into (send, computed), int64."""
    from moeflow.core.placement import dispatch_entries

    world, experts = flow.shape
    k, src, dst, count = dispatch_entries(flow, placement.holders_EW, node_of)
    plan = np.zeros((world, experts, world), dtype=np.int64)
    plan[src, k, dst] = count
    send = np.zeros((world, world), dtype=np.int64)
    np.add.at(send, (src, dst), count)
    computed = np.zeros((world, experts), dtype=np.int64)
    np.add.at(computed, (dst, k), count)
    return plan, send, computed


def _edge_dispatch_case(rng):
    """Owner-only experts, holders everywhere or anywhere, counts below the candidates (remainders),
    silent ranks and experts without tokens, holder sets missing the source's node; nodes None, in
    blocks, interleaved ([0, 1, 0, 1]) or any ids in any order."""
    world = int(rng.choice([1, 2, 3, 4, 5, 6, 8, 12, 16]))
    experts = int(rng.integers(1, 3 * world + 2))
    owner = rng.integers(0, world, experts)
    holders = rng.random((experts, world)) < rng.choice([0.0, 0.05, 0.2, 0.5, 0.9])
    holders[rng.random(experts) < 0.2] = True  # held everywhere
    holders[rng.random(experts) < 0.2] = False  # the owner alone
    placement = Placement.owners_only(owner, world).with_holders(holders)
    flow = rng.integers(0, int(rng.choice([2, 4, 30, 1000])), (world, experts))
    flow[rng.random(world) < 0.2] = 0  # silent ranks
    flow[:, rng.random(experts) < 0.2] = 0  # experts with no tokens
    nodes = int(rng.integers(1, world + 1))
    layout = int(rng.integers(4))
    if layout == 0:
        node_of = None
    elif layout == 1:
        node_of = [r * nodes // world for r in range(world)]
    elif layout == 2:
        node_of = [r % nodes for r in range(world)]
    else:
        node_of = list(rng.integers(0, nodes, world) * 7 + 3)
    return flow, placement, node_of


def test_compiled_dispatch_equals_the_entries_on_random_and_edge_cases():
    """`dispatch_counts` and `dispatch_loads` (compiled: `core.dispatch_kernels`) against the plan's
    NumPy entries (`dispatch_entries`): the same int64 values on 500 cases, and on 64 ranks in 8
    nodes (blocks and interleaved) with sparse, dense and everywhere holders."""
    from moeflow.core.placement import dispatch_loads

    rng = np.random.default_rng(41)
    cases = [_edge_dispatch_case(rng) for _ in range(500)]
    for density in (0.02, 0.2, 1.0):
        holders = rng.random((128, 64)) < density
        flow = rng.integers(0, 40, (64, 128)) * (rng.random((64, 128)) < 0.7)
        placement = Placement.expert_parallel(128, 64).with_holders(holders)
        cases += [(flow, placement, [r // 8 for r in range(64)]), (flow, placement, [r % 8 for r in range(64)])]
    for flow, placement, node_of in cases:
        plan, send, computed = _entries_plan_and_loads(flow, placement, node_of)
        got_plan = dispatch_counts(flow, placement, node_of)
        got_send, got_computed = dispatch_loads(flow, placement, node_of)
        assert got_plan.dtype == got_send.dtype == got_computed.dtype == np.int64
        np.testing.assert_array_equal(got_plan, plan)
        np.testing.assert_array_equal(got_send, send)
        np.testing.assert_array_equal(got_computed, computed)


def test_compiled_dispatch_raises_what_the_entries_raise():
    """A node layout of the wrong length, and an expert with tokens and no holder (a placement's
    holders are read-only: only one forced past its checks has such), fail as `dispatch_entries` does."""
    from moeflow.core.placement import dispatch_entries, dispatch_loads

    placement = Placement(np.array([0, 1, 1]), np.array([[1, 1], [0, 1], [1, 1]], dtype=bool))
    flow = np.ones((2, 3), dtype=np.int64)
    for dispatch in (dispatch_counts, dispatch_loads):
        with pytest.raises(ValueError, match=r"^node_of has 1 entries, expected one per rank \(2\)$"):
            dispatch(flow, placement, [0])
    with pytest.raises(ValueError, match="read-only"):
        placement.holders_EW[1, 1] = False
    holders = placement.holders_EW.copy()
    holders[1, 1] = False
    object.__setattr__(placement, "holders_EW", holders)
    message = r"^dispatch: experts \[1\] have tokens and no holder$"
    with pytest.raises(ValueError, match=message):
        dispatch_entries(flow, placement.holders_EW)
    with pytest.raises(ValueError, match=message):
        dispatch_counts(flow, placement)
