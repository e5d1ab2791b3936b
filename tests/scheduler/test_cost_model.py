"""The cost model against values worked out by hand (the arithmetic is in the comments)."""

from __future__ import annotations

import math

import pytest

from scheduler import (
    Assignment,
    CostModel,
    JobRequest,
    Plan,
    Port,
    QoS,
    Snapshot,
    compressor_model,
    estimate,
    plan,
    ring_allreduce_time,
    sync_model,
)
from tests.scheduler.builders import cluster, job, link

# H100 peak 989 TFLOPS x efficiency 0.5 = 494.5e12 FLOP/s per GPU.
RATE = 494.5e12
PARAMS = 100_000_000  # 4e8 bytes of fp32 gradients


def test_one_cluster_has_no_wan_term() -> None:
    snap = Snapshot((cluster("a", 4, intra_bandwidth_gbps=100.0, price_per_gpu_hour=3.0),))
    # compute 0.3 s on 4 GPUs: W = 0.3 * 4 * 494.5e12
    j = job(4, flops_per_step=0.3 * 4 * RATE, steps=1000)
    est = estimate(snap, j, [Assignment("a", 4)])
    # intra ring: 2*3*10us + 2*3/4 * 4e8 B / 12.5e9 B/s = 6e-5 + 0.048 = 0.04806 s
    assert est.intra_s == pytest.approx(0.04806)
    assert est.compute_s == pytest.approx(0.3)
    # no overlap (the runtime all-reduces after the backward pass): 0.3 + 0.04806
    assert est.step_time_s == pytest.approx(0.34806)
    assert est.wan_s == 0 and est.wan_bytes == 0 and est.egress_cost == 0
    assert est.total_time_s == pytest.approx(348.06)
    # 4 GPUs x $3/h x 348.06 s / 3600
    assert est.cost == pytest.approx(4 * 3 * 348.06 / 3600)


def test_one_cluster_comm_bound_step() -> None:
    # 8 GPUs, 10 Gb/s inside: ring 2*7*1e-5 + 2*7/8 * 4e8/1.25e9 = 1.4e-4 + 0.56 = 0.56014 s
    snap = Snapshot((cluster("a", 8, intra_bandwidth_gbps=10.0),))
    j = job(8, flops_per_step=0.3 * 8 * RATE)
    est = estimate(snap, j, [Assignment("a", 8)])
    assert est.step_time_s == pytest.approx(0.3 + 0.56014)


def test_workers_sharing_one_machines_cores_compute_as_many_times_slower() -> None:
    """On the embedded default every worker is a CPU slot of one machine: 6 workers on 2
    cores compute each step 3 times as long as on their own GPUs; up to 2 run unslowed."""
    alone = Snapshot((cluster("a", 6), cluster("b", 6)), (link("a", "b", gbps=10.0),))
    shared = Snapshot(alone.clusters, alone.links, host_cores=2)
    for gpus, placement, times in (
        (6, [Assignment("a", 6)], 3.0),
        (6, [Assignment("a", 3), Assignment("b", 3)], 3.0),
        (2, [Assignment("a", 2)], 1.0),
    ):
        j = job(gpus, flops_per_step=0.3 * gpus * RATE, steps=10)
        for sync in ("every-step", "local-sgd:8", "partial:8"):
            if len(placement) == 1 and sync != "every-step":
                continue
            base = estimate(alone, j, placement, "none", sync)
            got = estimate(shared, j, placement, "none", sync)
            assert base.compute_s is not None and got.compute_s is not None
            assert got.compute_s == pytest.approx(times * base.compute_s)
            assert got.total_time_s >= base.total_time_s + 10 * (times - 1) * base.compute_s - 1e-9
    with pytest.raises(ValueError, match="host_cores"):
        Snapshot(alone.clusters, host_cores=-1)


def _two() -> tuple[Snapshot, JobRequest]:
    snap = Snapshot(
        (cluster("a", 1, price_per_gpu_hour=3.0), cluster("b", 1, price_per_gpu_hour=3.0)),
        (link("a", "b", gbps=1.0, rtt_ms=20.0, egress=0.05),),
    )
    # compute 0.6 s on 2 GPUs
    return snap, job(2, flops_per_step=0.6 * 2 * RATE, steps=100)


def test_two_clusters_without_compression() -> None:
    snap, j = _two()
    est = estimate(snap, j, [Assignment("a", 1), Assignment("b", 1)], "none", "every-step")
    # D=2 ring all-reduce: 2 rounds of n/D = 2e8 B; a = 10 ms, B = 1.25e8 B/s
    # T_wan = 2 * (0.01 + 1.6) = 3.22 s
    assert est.wan_s == pytest.approx(3.22)
    # step = 0.6 + 3.22 = 3.82 s (the exchange after the backward pass); 100 steps
    assert est.step_time_s == pytest.approx(3.82)
    assert est.total_time_s == pytest.approx(382.0)
    # bytes per exchange = D * rounds * chunk = 2 * 2 * 2e8 = 8e8
    assert est.wan_bytes == 8e8 * 100
    # egress: each edge carries 4e8 B = 0.4 GB at $0.05 -> $0.04 per exchange, $4 in all
    assert est.egress_cost == pytest.approx(4.0)
    # GPUs: 2 x $3/h x 382 s
    assert est.cost == pytest.approx(4.0 + 2 * 3 * 382 / 3600)
    assert est.ring == ("a", "b") and est.bottleneck == ("a", "b")


def test_two_clusters_with_fp16_and_int8() -> None:
    snap, j = _two()
    pl = [Assignment("a", 1), Assignment("b", 1)]
    fp16 = estimate(snap, j, pl, "fp16", "every-step")
    # ratio 0.5: chunk 1e8 B -> T_wan = 2 * (0.01 + 0.8) = 1.62 s
    assert fp16.wan_s == pytest.approx(1.62)
    # overhead: 2 FLOPs/param * 1e8 / 494.5e12 on the leader
    assert fp16.overhead_s == pytest.approx(2 * PARAMS / RATE)
    assert fp16.step_time_s == pytest.approx(0.6 + 1.62 + 2 * PARAMS / RATE)
    assert fp16.wan_bytes == 4e8 * 100
    int8 = estimate(snap, j, pl, "int8", "every-step")
    # int8 runs in the compressed ring like fp16: 2 rounds of n'/D, n' = 4e8 * (0.25 + 1/1024)
    assert int8.wan_s == pytest.approx(2 * (0.01 + 1.00390625e8 / 2 / 1.25e8))
    # top-k with DGC momentum is all-gathered: D-1 = 1 round of its whole payload
    topk = estimate(snap, j, pl, "topk:0.01", "every-step")
    assert topk.wan_s == pytest.approx(0.01 + 4e8 * 0.015 / 1.25e8)
    # the steps the run takes; int8's quality cost (grammar.quality) is weighed apart
    assert int8.effective_steps == pytest.approx(100.0)
    assert int8.total_time_s == pytest.approx(100.0 * int8.step_time_s)
    assert int8.quality_cost == pytest.approx(0.01)


def test_local_sgd_exchanges_every_h_steps() -> None:
    snap, j = _two()
    est = estimate(snap, j, [Assignment("a", 1), Assignment("b", 1)], "none", "local-sgd:4")
    # step = 0.6 + 3.22 / 4 = 1.405 s
    assert est.step_time_s == pytest.approx(1.405)
    # 100 steps, 25 exchanges; quality cost 0.02 * log2(4) = 0.04
    assert est.total_time_s == pytest.approx(100 * 1.405)
    assert est.wan_bytes == round(25 * 8e8)
    assert est.quality_cost == pytest.approx(0.04)


def test_stale_hides_its_exchange_behind_a_step_not_behind_another_exchange() -> None:
    """The runtime's leader runs one exchange at a time: a step takes the longer of its
    local part and a whole exchange (latency too), whatever the staleness."""
    snap, j = _two()
    for sync in ("stale:1", "stale:4"):
        est = estimate(snap, j, [Assignment("a", 1), Assignment("b", 1)], "none", sync)
        # max(local 0.6, latency + overhead + bandwidth 3.22) = 3.22
        assert est.step_time_s == pytest.approx(3.22)
    s0 = estimate(snap, j, [Assignment("a", 1), Assignment("b", 1)], "none", "stale:0")
    assert s0.step_time_s == pytest.approx(3.82)


def test_ring_order_avoids_the_slowest_links() -> None:
    # 4 clusters: a fast square a-b-c-d-a (10 Gb/s), slow diagonals a-c, b-d (0.1 Gb/s)
    names = "abcd"
    fast = {("a", "b"), ("b", "c"), ("c", "d"), ("a", "d")}
    links = tuple(
        link(x, y, gbps=10.0 if (x, y) in fast else 0.1)
        for i, x in enumerate(names)
        for y in names[i + 1 :]
    )
    snap = Snapshot(tuple(cluster(n, 1) for n in names), links)
    est = estimate(snap, job(4), [Assignment(n, 1) for n in names], "none", "every-step")
    ring = est.ring
    edges = {frozenset(e) for e in zip(ring, ring[1:] + ring[:1], strict=True)}
    assert edges == {frozenset(e) for e in fast}
    # 2(D-1) = 6 rounds of 1e8 B over 10 Gb/s (1.25e9 B/s) + 10 ms each
    assert est.wan_s == pytest.approx(6 * (0.01 + 1e8 / 1.25e9))


def test_ring_allreduce_formula() -> None:
    assert ring_allreduce_time(1, 1e9, 1e-5, 1e9) == 0
    assert ring_allreduce_time(4, 4e8, 1e-5, 1e9) == pytest.approx(6e-5 + 1.5 * 0.4)


def test_compressor_models() -> None:
    assert compressor_model("none").ratio == 1
    assert compressor_model("bf16").ratio == 0.5
    # a kept value and its index gap (`grammar.compression.value_bytes`, the runtime's too)
    assert compressor_model("topk:0.01").ratio == pytest.approx(0.01 * (4 + 2) / 4)
    assert compressor_model("sign").ratio == pytest.approx(1 / 32)
    # PowerSGD from layer shapes: a 1000x1000 matrix at rank 4 sends 4*(1000+1000) numbers,
    # a bias of 1000 travels dense
    m = compressor_model("powersgd:4", 1_001_000, ((1000, 1000), (1000, 1)))
    assert m.ratio == pytest.approx((8000 + 1000) / 1_001_000)
    # without shapes: d = sqrt(params / 64); 64e6 params -> d = 1000 -> 2r/d
    assert compressor_model("powersgd:4", 64_000_000).ratio == pytest.approx(0.008)
    assert (
        compressor_model("powersgd:16").steps_factor < compressor_model("powersgd:2").steps_factor
    )
    for bad in ("zip", "topk:0", "topk:2", "powersgd:0", "powersgd:x"):
        with pytest.raises(ValueError, match="compression"):
            compressor_model(bad)
    assert sync_model("local-sgd:8").period == 8
    for bad in ("local-sgd:0", "sometimes", "stale:-1"):
        with pytest.raises(ValueError, match="sync"):
            sync_model(bad)


def test_step_time_from_reference_gpu() -> None:
    # 1.2 s per step of the whole batch on one H100 at the default efficiency; 4 H100s with the
    # same efficiency take 0.3 s of compute.
    snap = Snapshot((cluster("a", 4, efficiency=None),))
    j = job(4, flops_per_step=None, step_time_s_ref=1.2, ref_gpu="H100")
    est = CostModel(snap, j).estimate((Assignment("a", 4),), "none", "every-step")
    assert est.compute_s == pytest.approx(0.3)
    assert math.isfinite(est.total_time_s)


def test_batch_shares_follow_throughput_and_class_prices_apply() -> None:
    # H100 (989 TFLOPS) x2 and A100 (312) x4 at the same efficiency: shares 1978 : 1248
    snap = Snapshot(
        (
            cluster("a", 2, class_prices=(("spot", 0.5),)),
            cluster("b", 4, gpu_model="A100"),
        ),
        (link("a", "b"),),
    )
    pl = [Assignment("a", 2), Assignment("b", 4)]
    est = estimate(snap, job(6), pl)
    shares = dict(est.batch_shares)
    assert shares["a"] == pytest.approx(1978 / 3226)
    assert shares["b"] == pytest.approx(1248 / 3226)
    # the spot class prices a's GPUs at $0.5 instead of $2 (b has no spot price: list price)
    spot = estimate(snap, job(6, qos=QoS(qos_class="spot")), pl)
    hours = est.total_time_s / 3600
    assert est.gpu_cost == pytest.approx((2 * 2.0 + 4 * 2.0) * hours)
    assert spot.gpu_cost == pytest.approx((2 * 0.5 + 4 * 2.0) * hours)


def test_links_are_symmetric_unless_both_directions_are_given() -> None:
    one_way = Snapshot((cluster("a", 1), cluster("b", 1)), (link("a", "b", gbps=10.0),))
    back = one_way.link("b", "a")
    assert back is not None and back.bandwidth_gbps == 10.0
    both = Snapshot(
        (cluster("a", 1), cluster("b", 1)),
        (link("a", "b", gbps=10.0), link("b", "a", gbps=1.0)),
    )
    ab, ba = both.link("a", "b"), both.link("b", "a")
    assert ab is not None and ba is not None
    assert (ab.bandwidth_gbps, ba.bandwidth_gbps) == (10.0, 1.0)
    # the D=2 ring uses both directions, so the slow one bounds each round:
    # 2 rounds x (10 ms + 2e8 B / 1.25e8 B/s)
    est = estimate(both, job(2), [Assignment("a", 1), Assignment("b", 1)], "none", "every-step")
    assert est.wan_s == pytest.approx(2 * (0.01 + 1.6))
    assert est.bottleneck == ("b", "a")


def test_the_tree_is_priced_hop_by_hop_and_taken_only_where_it_is_faster() -> None:
    """Three clusters, 1 Gbit/s and 100 ms RTT each way: a ring all-reduce takes 4 rounds of
    a third of the payload, a tree (rooted at `a`, the first of equals) 2 hops of all of it."""
    names = "abc"
    links = tuple(
        link(x, y, gbps=1.0, rtt_ms=100.0) for i, x in enumerate(names) for y in names[i + 1 :]
    )
    snap = Snapshot(tuple(cluster(n, 1) for n in names), links)
    where = [Assignment(n, 1) for n in names]
    # 1 MB a copy: ring 4 x (0.05 + 1e6 / 3 / 1.25e8) = 0.2107 s; tree 2 x (0.05 + 0.008)
    small = estimate(snap, job(3, params=250_000, steps=10), where)
    assert small.tree == (("b", "a"), ("c", "a"))
    assert small.wan_s == pytest.approx(2 * (0.05 + 1e6 / 1.25e8))
    assert small.wan_bytes == 10 * 2 * 2 * 1_000_000  # each edge a whole copy, up and down
    # 100 MB a copy: ring 4 x (0.05 + 0.2667) = 1.267 s against the tree's 2 x 0.85 = 1.7 s
    large = estimate(snap, job(3, params=25_000_000, steps=10), where)
    assert large.tree == ()
    assert large.wan_s == pytest.approx(4 * (0.05 + 1e8 / 3 / 1.25e8))
    # two clusters: one hop either way, the ring
    pair = estimate(snap, job(2, params=250_000), [Assignment("a", 1), Assignment("b", 1)])
    assert pair.tree == ()


def test_a_trees_copies_through_one_declared_port_share_it() -> None:
    """Three clusters, 1 Gbit/s and 100 ms RTT each way, 10 MB a copy: edge by edge the tree
    (2 hops of it) beats the ring (4 rounds of a third); but a parent's two children send
    into its downlink at once, and it answers both out of its uplink: where those ports are
    declared at the links' 1 Gbit/s, each hop carries two copies through one port, and the
    ring, whose rounds put one message out of and into each cluster, is faster."""
    names = "abc"
    links = tuple(
        link(x, y, gbps=1.0, rtt_ms=100.0) for i, x in enumerate(names) for y in names[i + 1 :]
    )
    where = [Assignment(n, 1) for n in names]
    request = job(3, params=2_500_000, steps=10)
    free = Snapshot(tuple(cluster(n, 1) for n in names), links)
    edgewise = estimate(free, request, where)
    assert edgewise.tree == (("b", "a"), ("c", "a"))
    assert edgewise.wan_s == pytest.approx(2 * (0.05 + 1e7 / 1.25e8))  # 0.26 s
    ported = Snapshot(free.clusters, links, ports=tuple(Port(n, 1.0, 1.0) for n in names))
    # the tree now: 2 x (0.05 + 2 x 0.08) = 0.42 s; the ring 4 x (0.05 + 0.0267) = 0.307 s
    shared = estimate(ported, request, where)
    assert shared.tree == ()
    assert shared.wan_s == pytest.approx(4 * (0.05 + 1e7 / 3 / 1.25e8))
    # a gossip round: each cluster sends to both others at once, through its uplink
    model = CostModel(ported, request)
    one = CostModel(free, request).gossip_wan(tuple(names), "none")
    two = model.gossip_wan(tuple(names), "none")
    assert one.bandwidth_s == pytest.approx(1e7 / 1.25e8)
    assert two.bandwidth_s == pytest.approx(2 * 1e7 / 1.25e8)
    with pytest.raises(ValueError, match="unknown cluster 'z'"):
        Snapshot(free.clusters, links, ports=(Port("z", 1.0, 1.0),))


def test_a_hub_takes_the_exchange_off_the_spokes_slow_links() -> None:
    """Four datacenters, three of them joined to each other by 10 Mbit/s links and each to
    `h` at 10 Gbit/s: every ring crosses two slow links, the binary tree hangs one spoke under
    another; the hub's star through `h` uses only fast links, 2 hops, and is planned and
    explained as one. With every link fast and the RTT small, the ring stays."""
    spokes = "abc"
    slow = tuple(link(x, y, gbps=0.01, rtt_ms=20.0) for i, x in enumerate(spokes)
                 for y in spokes[i + 1 :])  # fmt: skip
    fast = tuple(link(x, "h", gbps=10.0, rtt_ms=20.0) for x in spokes)
    snap = Snapshot(tuple(cluster(n, 1) for n in "habc"), slow + fast)
    where = [Assignment(n, 1) for n in "habc"]
    est = estimate(snap, job(4, params=250_000, steps=10), where)
    assert dict(est.tree) == {"a": "h", "b": "h", "c": "h"}
    # up and down one level, each as slow as a fast edge: 2 x (10 ms + 1 MB at 10 Gbit/s)
    assert est.wan_s == pytest.approx(2 * (0.01 + 1e6 / 1.25e9))
    got = plan(snap, job(4, params=250_000, steps=10, compression="none", sync="every-step"))
    assert isinstance(got, Plan)
    assert any("WAN hub all-reduce from h" in line for line in got.explanation)
    even = Snapshot(
        tuple(cluster(n, 1) for n in "habc"),
        tuple(link(x, y, gbps=10.0, rtt_ms=1.0) for i, x in enumerate("habc")
              for y in "habc"[i + 1 :]),
    )  # fmt: skip
    assert estimate(even, job(4, params=25_000_000, steps=10), where).tree == ()


def test_reserved_bandwidth_is_priced_as_the_placement_reserves_it() -> None:
    """A split plan's cost holds the WAN rate each member reserves (its share of the bytes
    over the steps' time, `wan_rate_kbps`) for the whole run at its price per Gbit/s-hour;
    without prices, or without bytes crossing, it costs nothing."""
    from dataclasses import replace

    from scheduler.bandwidth import wan_rate_kbps
    from scheduler.cost import reserved_cost

    a = cluster("a", 4, price_per_gpu_hour=1.0, bandwidth_price_per_gbps_hour=3.0)
    b = cluster("b", 4, price_per_gpu_hour=1.0, bandwidth_price_per_gbps_hour=1.0)
    snap = Snapshot((a, b), (link("a", "b", gbps=1.0, rtt_ms=10.0),))
    j = job(8, params=50_000_000, steps=1000, compression="none", sync="every-step")
    split = (Assignment("a", 4), Assignment("b", 4))
    est = estimate(snap, j, split, "none", "every-step")
    rates = wan_rate_kbps(est.wan_bytes, est.total_time_s - est.setup_s, ["a", "b"])
    held = rates["a"] / 1e6 * 3.0 + rates["b"] / 1e6 * 1.0  # $ per hour
    assert est.bandwidth_cost == pytest.approx(held * est.total_time_s / 3600, rel=1e-3)
    assert est.bandwidth_cost > 0
    assert est.cost == pytest.approx(est.gpu_cost + est.egress_cost + est.bandwidth_cost)
    assert reserved_cost(4.0, 2, 0.0, 10.0, 1.0) == 0.0
    unpriced = Snapshot(
        tuple(replace(c, bandwidth_price_per_gbps_hour=0.0) for c in (a, b)), snap.links
    )
    assert estimate(unpriced, j, split, "none", "every-step").bandwidth_cost == 0.0
