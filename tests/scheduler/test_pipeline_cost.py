"""The pipeline plan's time and price (`scheduler.pipeline_cost`), against hand computation."""

from __future__ import annotations

import pytest

from scheduler.memory import Layer, ModelProfile, plan_parallelism
from scheduler.pipeline_cost import (
    MICRO_BATCH_OVERHEAD_S,
    SCHEDULES,
    StageWork,
    bubble_fraction,
    estimate_pipeline,
    estimate_whole_pipelines,
    fit_micro_overhead,
    wan_ring_all_reduce_s,
)
from tests.scheduler.builders import cluster, link

EAST = cluster("east", gpus=2, gpu_model="A100", price_per_gpu_hour=2.0)
WEST = cluster("west", gpus=1, gpu_model="A100", price_per_gpu_hour=3.0)
CLUSTERS = {"east": EAST, "west": WEST}
LINKS = {("east", "west"): link("east", "west", gbps=1.0, rtt_ms=20.0, egress=0.05)}


def test_three_stages_over_two_clusters_by_hand() -> None:
    stages = [
        StageWork("east", 0.10, 10e6),
        StageWork("east", 0.12, 20e6),
        StageWork("west", 0.08, 0.0),
    ]
    est = estimate_pipeline(stages, CLUSTERS, LINKS, micro_batches=4, steps=100)
    # east->east: 10 MB over the 100 Gbit/s fabric; east->west: 20 MB over 1 Gbit/s, its
    # 20 ms RTT paid once a step (filling and draining), not a micro-batch
    hop, wan = 10e6 * 8 / 100e9, 0.160
    assert est.link_s == pytest.approx((hop, wan))
    assert est.latency_s == pytest.approx(0.020)
    # GPipe: every forward (a third of a stage's work), then every backward; each phase is
    # one micro-batch through the stages and links plus 3 more of its slowest, the WAN link
    # (activations in the forward phase, their gradients in the backward one)
    forward = (0.10 + 0.12 + 0.08) / 3 + hop + wan + 3 * wan
    backward = 2 * (0.10 + 0.12 + 0.08) / 3 + hop + wan + 3 * wan
    assert est.step_s == pytest.approx(forward + backward + 0.02)  # 1.60 s
    assert est.bottleneck_s == pytest.approx((forward + backward) / 6)
    assert est.bubble == pytest.approx(2 / 6)
    total = 100 * est.step_s
    assert est.total_time_s == pytest.approx(total)
    # 4 micro-batches of 20 MB forward, their gradients back; the in-cluster hop is free
    assert est.wan_bytes_per_step == (("east", "west", 80e6), ("west", "east", 80e6))
    assert est.wan_bytes == pytest.approx(160e6 * 100)
    assert est.gpu_cost == pytest.approx((2.0 + 2.0 + 3.0) * total / 3600)
    assert est.egress_cost == pytest.approx(16.0 * 0.05)
    assert est.cost == pytest.approx(7 * total / 3600 + 0.8)


def test_whole_pipeline_replicas_all_reduce_over_the_wan_by_hand() -> None:
    """Pipelines (a, b) and (c, d), each fast inside, slow between: every replica runs its
    micro-batches, then each stage's two replicas all-reduce over the WAN, 2(R - 1) = 2
    rounds of half the gradient, each a one-way latency plus the chunk."""
    names = ("a", "b", "c", "d")
    clusters = {n: cluster(n, gpus=1, gpu_model="A100", price_per_gpu_hour=1.0) for n in names}
    links = {
        ("a", "b"): link("a", "b", gbps=1.0, rtt_ms=20.0),
        ("c", "d"): link("c", "d", gbps=1.0, rtt_ms=20.0),
        ("a", "c"): link("a", "c", gbps=0.1, rtt_ms=40.0, egress=0.01),
        ("b", "d"): link("b", "d", gbps=0.1, rtt_ms=40.0),
    }

    def replica(first: str, second: str) -> list[StageWork]:
        return [
            StageWork(first, 0.1, 10e6, grad_bytes=100e6),
            StageWork(second, 0.1, 0.0, grad_bytes=50e6),
        ]

    est = estimate_whole_pipelines(
        [replica("a", "b"), replica("c", "d")], clusters, links, micro_batches=4, steps=10
    )
    # a replica's step: each phase one micro-batch through both stages and the 80 ms link,
    # then 3 more of the link; its boundary's RTT once
    one = (0.2 / 3 + 0.08 + 3 * 0.08) + (0.4 / 3 + 0.08 + 3 * 0.08) + 0.02
    sync = 2 * (0.02 + 50e6 * 8 / 0.1e9)  # stage 0's ring, the slower: 2 rounds of 50 MB
    assert est.sync_s == pytest.approx(sync)
    assert est.step_s == pytest.approx(one + sync) and est.total_time_s == pytest.approx(
        10 * (one + sync)
    )
    per_step = {(a, b): n for a, b, n in est.wan_bytes_per_step}
    assert per_step == pytest.approx(
        {("a", "b"): 40e6, ("b", "a"): 40e6, ("c", "d"): 40e6, ("d", "c"): 40e6,
         ("a", "c"): 100e6, ("c", "a"): 100e6, ("b", "d"): 50e6, ("d", "b"): 50e6}
    )  # fmt: skip
    assert est.gpu_cost == pytest.approx(4 * 1.0 * est.total_time_s / 3600)
    assert est.egress_cost == pytest.approx(200e6 * 10 / 1e9 * 0.01)
    # one replica is a plain pipeline; unequal depths are refused
    alone = estimate_whole_pipelines([replica("a", "b")], clusters, links, 4, 10)
    assert alone == estimate_pipeline(replica("a", "b"), clusters, links, 4, 10)
    with pytest.raises(ValueError, match="same number of stages"):
        estimate_whole_pipelines([replica("a", "b"), replica("c", "d")[:1]], clusters, links, 4, 1)
    # a ring inside one cluster moves nothing over the WAN
    took, moved = wan_ring_all_reduce_s(8e6, ["a", "a"], clusters, links)
    assert moved == {} and took == pytest.approx(2 * 4e6 * 8 / (EAST.intra_bandwidth_gbps * 1e9))
    with pytest.raises(ValueError, match="no link between 'a' and 'd'"):
        wan_ring_all_reduce_s(8e6, ["a", "d"], clusters, links)


def test_compute_bound_hybrid_counts_every_replica() -> None:
    stages = [StageWork("east", 0.5, 1e3, gpus=2), StageWork("west", 0.25, 0.0, gpus=2)]
    est = estimate_pipeline(stages, CLUSTERS, LINKS, micro_batches=8, steps=10, qos_class="x")
    link = 1e3 * 8 / 1e9
    # each phase: a micro-batch through both stages, then 7 more of the slower stage
    passes = (0.75 / 3 + link + 7 * 0.5 / 3) + (1.5 / 3 + link + 7 * 1.0 / 3)
    assert est.step_s == pytest.approx(passes + 0.02) and est.bubble == pytest.approx(1 / 9)
    assert est.bottleneck_s == pytest.approx(passes / 9)
    assert est.gpu_cost == pytest.approx((2 * 2.0 + 2 * 3.0) * est.total_time_s / 3600)


def test_one_stage_has_no_bubble_and_no_wan() -> None:
    est = estimate_pipeline([StageWork("west", 0.3, 0.0)], CLUSTERS, LINKS, 4, 1)
    assert est.bubble == 0.0 and est.step_s == pytest.approx(4 * 0.3)
    assert est.wan_bytes == 0.0 and est.egress_cost == 0.0
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)


@pytest.mark.parametrize(
    ("stages", "micro", "steps", "field"),
    [
        ([], 4, 1, "stages"),
        ([StageWork("east", 0.1, 0.0)], 0, 1, "micro_batches"),
        ([StageWork("east", 0.1, 0.0)], 1, 0, "steps"),
        ([StageWork("mars", 0.1, 0.0)], 1, 1, "stages"),
        ([StageWork("east", -1.0, 0.0)], 1, 1, "stages"),
        ([StageWork("east", 0.1, 1.0), StageWork("north", 0.1, 0.0)], 1, 1, "stages"),
    ],
)
def test_bad_input_names_the_field(
    stages: list[StageWork], micro: int, steps: int, field: str
) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        estimate_pipeline(stages, CLUSTERS, LINKS, micro, steps)


def test_unlinked_clusters_are_refused() -> None:
    north = cluster("north", gpus=1)
    with pytest.raises(ValueError, match="links: no link between 'east' and 'north'"):
        estimate_pipeline(
            [StageWork("east", 0.1, 1.0), StageWork("north", 0.1, 0.0)],
            {**CLUSTERS, "north": north},
            LINKS,
            1,
            1,
        )


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("gbps", [0.5, 100.0])
def test_agrees_with_the_memory_planners_step(schedule: str, gbps: float) -> None:
    """The planner's pipeline step (scheduler.memory) is the estimate's, from its own stages
    and the micro-batch cost it weighed, for either schedule, link-bound (0.5 Gbit/s: the
    cost paces a link's slot too) and bound by the stages (100 Gbit/s: a cost counted twice
    would show)."""
    profile = ModelProfile(tuple(Layer(f"l{i}", 3_000_000_000, 1e9, 4e6, 1e6) for i in range(4)))
    small = [cluster(n, gpus=2, gpu_model="A100") for n in ("a", "b")]
    links = [link("a", "b", gbps=gbps, rtt_ms=30.0)]
    got = plan_parallelism(profile, small, links, batch=16, schedule=schedule)
    assert len(got.stages) >= 2
    mb = -(-16 // got.micro_batches)
    work = [
        StageWork(
            st.cluster,
            st.compute_s,
            profile.layers[st.layers[1] - 1].activation_bytes * mb
            if i < len(got.stages) - 1
            else 0,
        )
        for i, st in enumerate(got.stages)
    ]
    est = estimate_pipeline(
        work,
        {c.name: c for c in small},
        {(x.a, x.b): x for x in links},
        got.micro_batches,
        1,
        micro_overhead_s=MICRO_BATCH_OVERHEAD_S,
        schedule=schedule,
    )
    assert est.step_s == pytest.approx(got.step_s, rel=1e-12)
    assert est.bubble == pytest.approx(got.bubble)


def test_1f1b_keeps_s_in_flight_so_a_long_links_round_trip_bounds_its_slot() -> None:
    """GPipe sends every forward before the first backward: the link's RTT is paid once a
    step. 1F1B keeps at most S micro-batches in flight, so a slot is at least a micro-batch's
    round trip (both stages' work, the transfers both ways and the RTT) over S."""
    stages = [StageWork("east", 0.002, 1e3), StageWork("west", 0.002, 0.0)]
    gpipe = estimate_pipeline(stages, CLUSTERS, LINKS, micro_batches=32, steps=1)
    one = estimate_pipeline(stages, CLUSTERS, LINKS, 32, 1, schedule="1f1b")
    transfer = 1e3 * 8 / 1e9  # 1 kB over 1 Gbit/s
    assert gpipe.bottleneck_s == pytest.approx(0.002, rel=1e-3)
    assert one.bottleneck_s == pytest.approx((0.004 + 2 * transfer + 0.020) / 2)
    assert one.step_s == pytest.approx(33 * one.bottleneck_s + 0.020)
    assert one.step_s > 4 * gpipe.step_s
    # where the stages' work dwarfs the RTT the two schedules take about as long
    slow = [StageWork("east", 1.0, 1e3), StageWork("west", 1.0, 0.0)]
    both = [estimate_pipeline(slow, CLUSTERS, LINKS, 8, 1, schedule=x).step_s for x in SCHEDULES]
    assert both[0] <= both[1] == pytest.approx(both[0], rel=0.02)
    with pytest.raises(ValueError, match="schedule"):
        estimate_pipeline(stages, CLUSTERS, LINKS, 4, 1, schedule="zigzag")


def test_a_split_stage_pays_four_all_reduces_a_block() -> None:
    """Tensor parallelism's cost: a ring all-reduce (2(T-1) rounds of 1/T of the bytes, each
    paying the latency) four times a block; nothing unsplit."""
    from scheduler.pipeline_cost import ALPHA_TENSOR_S, tensor_collective_s

    assert tensor_collective_s(1e6, 2, 1, 100.0) == 0.0
    assert tensor_collective_s(1e6, 0, 4, 100.0) == 0.0
    one = 2 * ALPHA_TENSOR_S + 1e6 * 8 / 100e9  # T = 2: 2 rounds of half the bytes
    assert tensor_collective_s(1e6, 3, 2, 100.0) == pytest.approx(4 * 3 * one)
    # more GPUs: more rounds, each of a smaller slice; the bytes term tends to 2n/B
    assert tensor_collective_s(1e6, 1, 8, 100.0) > tensor_collective_s(1e6, 1, 2, 100.0)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_fitted_micro_batch_cost_gives_a_link_bound_runs_step_back(schedule: str) -> None:
    """The micro-batch cost fitted from a run whose slots a link paces, planned again with that
    cost, is the run's step: the cost is the slot's whichever bounds it (counted on the stages
    alone, a link-bound plan would absorb it under the link's time and stay short)."""
    clusters = {c.name: c for c in (cluster("a", gpus=1), cluster("b", gpus=1))}
    links = {("a", "b"): link("a", "b", gbps=0.1, rtt_ms=20.0)}
    work = [StageWork("a", 0.004, 400_000), StageWork("b", 0.004, 0)]  # link: 32 ms a slot

    def step(cost: float) -> float:
        return estimate_pipeline(
            work, clusters, links, 4, 1, micro_overhead_s=cost, schedule=schedule
        ).step_s

    planned = step(MICRO_BATCH_OVERHEAD_S)
    measured = planned * 1.3
    fitted = fit_micro_overhead(measured, planned, 4, 2, MICRO_BATCH_OVERHEAD_S)
    assert fitted > MICRO_BATCH_OVERHEAD_S
    assert step(fitted) == pytest.approx(measured, rel=1e-9)
