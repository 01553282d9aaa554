"""Topology: parsing, routes, link traffic by hand, presets, JSON."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeflow.perf.topology import PRESETS, Topology


def names(links):
    return [str(lk) for lk in links]


def test_two_nodes_routes_and_node_of():
    t = Topology.from_spec([[0, 1], [2, 3]], level_bandwidth_bytes_per_s=[1e9, 1e10])
    assert t.num_devices == 4 and t.num_nodes == 2 and t.node_of == [0, 0, 1, 1]
    assert names(t.path(0, 1)) == ["d0->s0", "s0->d1"]
    assert names(t.path(0, 3)) == ["d0->s0", "s0->s", "s->s1", "s1->d3"]
    assert names(t.path(3, 0)) == ["d3->s1", "s1->s", "s->s0", "s0->d0"]  # the other direction
    assert t.path(2, 2) == []
    assert [lk.bandwidth_bytes_per_s for lk in t.path(0, 3)] == [1e10, 1e9, 1e9, 1e10]
    assert t.path_bandwidth(0, 3) == 1e9 and t.path_bandwidth(0, 1) == 1e10


def test_link_traffic_hand_worked():
    # 0 -> 3: 100 bytes, 1 -> 2: 50 bytes, 2 -> 0: 7 bytes, 0 -> 1: 5 bytes.
    t = Topology.from_spec("[[0,1],[2,3]]", 1.0)
    flow = np.zeros((4, 4))
    flow[0, 3], flow[1, 2], flow[2, 0], flow[0, 1] = 100, 50, 7, 5
    traffic = dict(zip(names(t.links), t.link_traffic(flow)))
    expect = {
        "d0->s0": 105,
        "s0->d1": 5,
        "d1->s0": 50,
        "s0->s": 150,
        "s->s1": 150,
        "s1->d3": 100,
        "s1->d2": 50,
        "d2->s1": 7,
        "s1->s": 7,
        "s->s0": 7,
        "s0->d0": 7,
    }
    for link, v in traffic.items():
        assert v == expect.get(link, 0), link
    # vectorised over leading dims
    batch = t.link_traffic(np.stack([flow, 2 * flow]))
    assert batch.shape == (2, len(t.links)) and np.allclose(batch[1], 2 * batch[0])


def test_asymmetric_tree_routes_through_lowest_common_switch():
    t = Topology.from_spec([[[0, 1], [2, 3]], [[4, 5]]], [1.0, 2.0, 3.0])
    assert t.node_of == [0, 0, 1, 1, 2, 2]
    assert names(t.path(0, 2)) == ["d0->s0.0", "s0.0->s0", "s0->s0.1", "s0.1->d2"]
    assert names(t.path(1, 5)) == ["d1->s0.0", "s0.0->s0", "s0->s", "s->s1", "s1->s1.0", "s1.0->d5"]
    assert [lk.level for lk in t.path(1, 5)] == [2, 1, 0, 0, 1, 2]


def test_families_and_ring_routing():
    h = Topology.homogeneous(4, 5e9)
    assert h.num_nodes == 1 and names(h.path(0, 3)) == ["d0->s", "s->d3"]
    r = Topology.ring([50e9, 25e9, 50e9, 25e9], uplink_bandwidth_bytes_per_s=10e9)
    assert names(r.path(0, 1)) == ["d0->d1"]
    assert names(r.path(0, 3)) == ["d0->d3"]  # shorter way round
    assert names(r.path(0, 2)) == ["d0->d1", "d1->d2"]  # tie: forward
    assert r.path_bandwidth(0, 2) == 25e9
    s = Topology.symmetric_tree([2, 3], [1e9, 1e10])
    assert s.spec == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("[[0,1],[2,2]]", "duplicated [2]"),
        ("[[0,1],[]]", "spec[1]=[]"),
        ('[[0,"a"]]', "spec[0][1]='a'"),
        ("[[0,1],[2,-1]]", "spec[1][1]=-1"),
        ("[[0,1],[3]]", "missing [2]"),
        ("[[0,1]", "not a JSON nested list"),
        ("[[0,true]]", "spec[0][1]=True"),
    ],
)
def test_parse_errors_name_the_element(spec, needle):
    with pytest.raises(ValueError, match="topology") as exc:
        Topology.from_spec(spec)
    assert needle in str(exc.value)


def test_bad_levels_and_paths():
    with pytest.raises(ValueError, match="level_bandwidth_bytes_per_s"):
        Topology.from_spec([[0, 1], [2, 3]], [1e9])
    with pytest.raises(ValueError, match=r"level_bandwidth_bytes_per_s\[0\]=-1.0"):
        Topology.from_spec([[0, 1], [2, 3]], [-1, 1])
    with pytest.raises(ValueError, match="j=9"):
        Topology.homogeneous(2, 1.0).path(0, 9)
    with pytest.raises(ValueError, match="preset='nope'"):
        Topology.preset("nope")


def test_presets_cite_sources_and_roundtrip_json(tmp_path):
    for name in PRESETS:
        t = Topology.preset(name)
        assert t.source and t.name == name
        again = Topology.from_json(t.to_json(tmp_path / f"{name}.json"))
        assert again.to_dict() == t.to_dict()
        assert np.array_equal(again.routes_PL, t.routes_PL)
    assert Topology.preset("johnny").num_devices == 16 and Topology.preset("johnny").num_nodes == 2
    assert Topology.preset("johnny").level_bandwidth()[0] == 50e9 / 8  # 50 Gb/s IB (FasterMoE §5.1)
    trevor = Topology.preset("trevor")
    assert trevor.num_devices == 64 and trevor.num_nodes == 16
    assert trevor.path_bandwidth(0, 1) == 50e9 and trevor.path_bandwidth(1, 2) == 25e9  # doubled NVLink edges
    assert trevor.path_bandwidth(0, 4) == 100e9 / 8


@st.composite
def trees(draw):
    """Random nested-list specs (1-3 levels, groups of 1-3) with their device count."""
    counter = iter(range(10_000))

    def group(depth):
        n = draw(st.integers(1, 3))
        if depth == 0:
            return [next(counter) for _ in range(n)]
        return [group(depth - 1) for _ in range(n)]

    return group(draw(st.integers(0, 2)))


@settings(max_examples=40, deadline=None)
@given(spec=trees(), seed=st.integers(0, 2**31 - 1))
def test_traffic_conservation_property(spec, seed):
    # Every byte leaves its source on the source's uplink and enters its destination on the
    # destination's downlink exactly once; routes are mirror images of each other.
    t = Topology.from_spec(spec, 1.0)
    W = t.num_devices
    flow = np.random.default_rng(seed).integers(0, 100, (W, W)).astype(float)
    traffic = t.link_traffic(flow)
    off = flow - np.diag(np.diag(flow))
    for d in range(W):
        up = [i for i, lk in enumerate(t.links) if lk.src == f"d{d}"]
        down = [i for i, lk in enumerate(t.links) if lk.dst == f"d{d}"]
        assert traffic[up].sum() == off[d].sum() and traffic[down].sum() == off[:, d].sum()
    for i in range(W):
        for j in range(W):
            there = [(lk.src, lk.dst) for lk in t.path(i, j)]
            back = [(lk.dst, lk.src) for lk in t.path(j, i)][::-1]
            assert there == back


def _route_by_walking(t: Topology, i: int, j: int) -> list[str]:
    """The route as the links' names say it, found by walking (the definition `route_WWH` is built
    array-wise from): round a ring node the shorter way (ties forward), else up to the lowest
    common switch and down."""
    if i == j:
        return []
    node = t.node_of
    ring = any(lk.kind == "ring" for lk in t.links)
    if ring and node[i] == node[j]:
        members = t.nodes[node[i]]
        m, a, b = len(members), members.index(i), members.index(j)
        step = 1 if (b - a) % m <= (a - b) % m else -1
        out, pos = [], a
        while pos != b:
            out.append(f"d{members[pos]}->d{members[(pos + step) % m]}")
            pos = (pos + step) % m
        return out
    device_parent = {lk.src: lk.dst for lk in t.links if lk.kind == "tree" and lk.src.startswith("d")}

    def chain(v):  # the device and its switches up to the root ("s0.1" -> "s0" -> "s")
        out = [v, device_parent[v]]
        while out[-1] != "s":
            out.append(out[-1].rsplit(".", 1)[0] if "." in out[-1] else "s")
        return out

    up, down = chain(f"d{i}"), chain(f"d{j}")
    common = next(v for v in up if v in down)
    hops_up = up[: up.index(common) + 1]
    hops_down = down[: down.index(common) + 1][::-1]
    return [f"{a}->{b}" for a, b in zip(hops_up, hops_up[1:])] + [f"{a}->{b}" for a, b in zip(hops_down, hops_down[1:])]


@settings(max_examples=40, deadline=None)
@given(spec=trees(), seed=st.integers(0, 2**31 - 1))
def test_route_table_is_the_walked_route_and_traffic_its_sum(spec, seed):
    t = Topology.from_spec(spec, [float(2 + k) for k in range(Topology.from_spec(spec, 1.0).depth)])
    _check_routes(t, seed)


@pytest.mark.parametrize("name", ["trevor", "prophet_hpnv", "prophet_hpwnv", "johnny@32"])
def test_route_table_on_rings_and_three_levels(name):
    _check_routes(Topology.preset(name), 0)


def _check_routes(t: Topology, seed: int) -> None:
    W = t.num_devices
    flow = np.random.default_rng(seed).integers(0, 100, (W, W)).astype(float)
    expect = np.zeros(len(t.links))
    index = {str(lk): k for k, lk in enumerate(t.links)}
    for i in range(W):
        for j in range(W):
            walked = _route_by_walking(t, i, j)
            assert names(t.path(i, j)) == walked, (i, j)
            for hop in walked:
                expect[index[hop]] += flow[i, j]
            lat = sum(t.links[index[h]].latency_s for h in walked)
            assert t.path_latency_WW[i, j] == pytest.approx(lat)
    np.testing.assert_allclose(t.link_traffic(flow), expect)
    pairs = np.flatnonzero(flow.reshape(-1) > 50)
    np.testing.assert_allclose(
        t.pair_traffic(flow.reshape(-1)[pairs], pairs), t.link_traffic(np.where(flow > 50, flow, 0.0))
    )


def test_presets_scale_to_other_sizes_with_the_same_link_classes():
    big = Topology.preset("johnny@64")
    assert big.num_devices == 64 and big.num_nodes == 8 and big.name == "johnny@64"
    assert big.level_bandwidth() == Topology.preset("johnny").level_bandwidth()
    ring = Topology.preset("trevor@8")
    assert ring.num_nodes == 2 and ring.path_bandwidth(0, 1) == 50e9
    with pytest.raises(ValueError, match="num_devices=12: must be a positive multiple of the 8 devices per node"):
        Topology.preset("johnny@12")
    with pytest.raises(ValueError, match="NAME@DEVICES"):
        Topology.preset("johnny@x")


def test_two_level_sums_equal_the_routes_incidence():
    """`perf.two_level`: where every node hangs from the root, the links' bytes by row, column and
    node-block sums are the incidence product's — bit for bit on integer bytes, to rounding on
    others — for nodes of consecutive and of scattered devices; rings inside a node are refused."""
    from moeflow.perf.two_level import two_level_links

    rng = np.random.default_rng(3)
    for topo in (
        Topology.from_spec([[0, 2, 5], [1, 3], [4, 6, 7]], [1e9, 1e10], [5e-6, 1e-6]),
        Topology.preset("johnny@16"),
        Topology.preset("hecate_b@256"),
    ):
        W = topo.num_devices
        two = two_level_links(topo.route_WWH, topo.leave_W2, topo.enter_W2, topo.node_of, len(topo.links))
        assert two is not None and (topo._two_level is not None) == (W >= 128)
        for shape in ((W, W), (3, W, W)):
            whole, part = rng.integers(0, 10**6, shape) * 2048.0, rng.random(shape)
            for x in (whole, part):
                want = np.asarray(topo._links_csr @ x.reshape(-1, W * W).T).T.reshape(*shape[:-2], -1)
                got = two.traffic(x)
                assert np.array_equal(got, want) if x is whole else np.allclose(got, want, rtol=1e-12, atol=0)
                np.testing.assert_allclose(topo.link_traffic(x), want, rtol=1e-12)
    ring = Topology.preset("trevor")
    assert two_level_links(ring.route_WWH, ring.leave_W2, ring.enter_W2, ring.node_of, len(ring.links)) is None
