"""The 2D-hierarchical all-to-all's arithmetic (FSMoE §3.1, Tutel's 2DH), without processes: which
bytes each stage carries and how the dispatcher prices them. Its numerics under real collectives
are in tests/multirank_fsmoe.py (`check_hierarchical_dispatch`)."""

from __future__ import annotations

import numpy as np
import pytest

from moeflow.perf.alpha_beta import AlphaBeta
from moeflow.perf.costmodel import CostModel
from moeflow.perf.topology import Topology
from moeflow.strategies import DISPATCHERS
from moeflow.strategies.hierarchical_a2a import NodeGrid, hierarchical_bytes


def test_stages_by_hand_on_two_nodes_of_two():
    """Ranks 0, 1 | 2, 3; one byte from every rank to every other. Stage 1 (inside the node): rank
    (n, l) hands its node-mate everything for ranks of the mate's local index; stage 2 (across
    nodes, equal local index): (n, l) carries node n's bytes for (m, l)."""
    ones = np.ones((4, 4)) - np.eye(4)
    stage1, stage2 = hierarchical_bytes(ones, NodeGrid.of([0, 0, 1, 1]))
    # rank 0 -> mate 1: its bytes for ranks 1 and 3; rank 2 -> mate 3: for ranks 1 and 3.
    expected1 = np.zeros((4, 4))
    expected1[0, 1] = expected1[1, 0] = expected1[2, 3] = expected1[3, 2] = 2
    expected2 = np.zeros((4, 4))
    expected2[0, 2] = expected2[2, 0] = expected2[1, 3] = expected2[3, 1] = 2  # ranks 0, 1 for 2 (resp. 3)
    np.testing.assert_array_equal(stage1, expected1)
    np.testing.assert_array_equal(stage2, expected2)


@pytest.mark.parametrize("node_of", [[0, 0, 1, 1], [0, 1, 0, 1], [0, 0, 0, 1, 1, 1]])
def test_every_byte_crosses_nodes_once_and_arrives(node_of):
    """Cross-node bytes equal the plain exchange's (all in stage 2); stage 1 stays inside nodes."""
    W = len(node_of)
    rng = np.random.default_rng(W)
    b = rng.integers(0, 100, (W, W)).astype(np.float64)
    np.fill_diagonal(b, 0)
    stage1, stage2 = hierarchical_bytes(b, NodeGrid.of(node_of))
    node = np.asarray(node_of)
    cross = node[:, None] != node[None, :]
    assert stage1[cross].sum() == 0
    assert stage2[~cross].sum() == 0
    assert stage2.sum() == b[cross].sum()


def test_unequal_nodes_are_refused_naming_the_layout():
    with pytest.raises(ValueError, match=r"node_of=\[0, 0, 1\].*\[2, 1\]"):
        NodeGrid.of([0, 0, 1])


def test_price_is_both_stages_plus_three_layout_passes():
    topo = Topology.from_spec([[0, 1], [2, 3]], [1e8, 1e10])
    plain = CostModel(topo, 1e11)
    with_passes = CostModel(topo, 1e11, fits={"elementwise": AlphaBeta(1e-5, 1e-9, "byte")})
    b = np.full((4, 4), 1e6) - np.diag([1e6] * 4)
    hier = DISPATCHERS.build("hierarchical", None)
    stage1, stage2 = hierarchical_bytes(b, NodeGrid.of(topo.node_of))
    stages = plain.a2a_time(stage1, peers=1) + plain.a2a_time(stage2, peers=1)
    assert hier.price(plain, b) == pytest.approx(stages)  # no elementwise fit: passes are free
    assert hier.price(with_passes, b) == pytest.approx(stages + 3 * (1e-5 + 1e-9 * 3e6))
