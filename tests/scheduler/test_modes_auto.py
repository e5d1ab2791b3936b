"""Issue 17 in the planner, as issue 47 left it: the batch is split by throughput (what the
runtime runs), so a slower cluster takes less of it instead of `partial`/`async-ps` running
ahead; those split equally and run ahead when asked for; gossip when links are uneven;
`cpn plan` says why, and a given placement is re-checked against the job's data residency."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grammar.auto import GRADIENT_SYNCS, LOCAL_SYNCS
from grammar.quality import SLACK, SPEED_BOUND, quality_cost
from scheduler import (
    Assignment,
    CostModel,
    Infeasible,
    JobRequest,
    Plan,
    Snapshot,
    evaluate,
    plan,
)
from scheduler.calibrate import fit_steps_factor
from scheduler.optimizer import _Search
from tests.scheduler.builders import cluster, job, link

# H100 at efficiency 0.5 = 494.5 TFLOP/s a GPU; c at 0.125 is exactly 4x slower
RATE = 989e12 * 0.5
FAST_A, FAST_B, SLOW_C = cluster("a", 8), cluster("b", 8), cluster("c", 8, efficiency=0.125)
TRIANGLE = (link("a", "b"), link("b", "c"), link("a", "c"))
# compute-bound: 1e16 FLOPs a step, 10 M parameters over 10 Gb/s
BIG_STEP = job(24, params=10_000_000, flops_per_step=1e16)


AUTO_SYNCS_ = (*GRADIENT_SYNCS, *LOCAL_SYNCS)


def _plan(snap: Snapshot, j: JobRequest, slack: float = SLACK) -> Plan:
    r = plan(snap, j, "time", slack=slack)
    assert isinstance(r, Plan), r
    return r


def test_the_batch_is_split_by_throughput_and_running_ahead_is_bounded() -> None:
    snap = Snapshot((FAST_A, FAST_B, SLOW_C), TRIANGLE)
    model = CostModel(snap, BIG_STEP)
    pl = (Assignment("a", 8), Assignment("b", 8), Assignment("c", 8))
    every = model.estimate(pl, "none", "every-step")
    # split by throughput (what the runtime runs): 16 x r + 8 x r/4, no cluster waits
    assert every.compute_s == pytest.approx(1e16 / (18 * RATE))
    assert dict(every.batch_shares) == pytest.approx({"a": 8 / 18, "b": 8 / 18, "c": 2 / 18})
    partial = model.estimate(pl, "none", "partial:8")
    # running ahead splits equally: a and b take 4 steps per step of c, (8x4 + 8x4 + 8x1) / 24
    # = 3x the samples a second of c's pace: exactly what the split gives every mode
    assert dict(partial.batch_shares) == pytest.approx({"a": 1 / 3, "b": 1 / 3, "c": 1 / 3})
    assert partial.compute_s == pytest.approx(1e16 / (24 * RATE / 4))
    local = model.estimate(pl, "none", "local-sgd:8")
    # local SGD splits equally too (a split changes what its local steps learn) and waits
    # for c. The run takes the job's steps in steps of c (ticks) under both: partial's
    # running ahead buys 3x the samples, not a shorter run or fewer exchanges
    assert dict(local.batch_shares) == pytest.approx({"a": 1 / 3, "b": 1 / 3, "c": 1 / 3})
    assert partial.step_time_s == pytest.approx(local.step_time_s)
    assert partial.effective_steps == local.effective_steps == BIG_STEP.steps
    assert partial.wan_bytes == local.wan_bytes
    # 8x slower: still only SPEED_BOUND steps per step of the slowest
    slower = Snapshot((FAST_A, FAST_B, replace(SLOW_C, efficiency=0.0625)), TRIANGLE)
    assert CostModel(slower, BIG_STEP).pace(("a", "b", "c"))[1] == {
        "a": SPEED_BOUND,
        "b": SPEED_BOUND,
        "c": 1,
    }
    # 1.5x faster fits no second step (the runtime rounds down): nothing to gain
    near = Snapshot((FAST_A, FAST_B, replace(SLOW_C, efficiency=0.5 / 1.5)), TRIANGLE)
    assert not CostModel(near, BIG_STEP).speeds_differ(("a", "b", "c"))


def test_a_4x_slower_cluster_is_given_less_of_the_batch_not_a_mode_that_runs_ahead() -> None:
    """The split by throughput keeps every cluster busy exactly: running ahead (partial,
    async-ps) would buy no samples a second and costs quality, so auto keeps a plain mode
    and says how the batch is split."""
    snap = Snapshot((FAST_A, FAST_B, SLOW_C), TRIANGLE)
    got = _plan(snap, BIG_STEP)
    assert got.sync in AUTO_SYNCS_
    why = "\n".join(got.explanation)
    assert "the batch is split by throughput (a 44%, b 44%, c 11%)" in why
    # asked for a mode that runs ahead, the planner keeps it and explains its pace
    fixed = _plan(snap, replace(BIG_STEP, sync="partial:16"))
    assert fixed.sync == "partial:16"
    assert any("up to 4 steps per step of c" in line for line in fixed.explanation)


def test_async_ps_is_priced_where_the_runtime_puts_its_servers() -> None:
    """One region: every leader waits each step for its push and pull to the server at the
    best-connected cluster (a, `grammar.graph.ps_host`), the slowest such round trip, and
    both non-hosts send the payload there and back. One cluster a region: the pushes stay
    local and each region's server exchanges apart, one in flight, every as many ticks as
    one lasts and one."""
    params, steps = 10_000_000, 100
    j = job(24, params=params, steps=steps, flops_per_step=1e14)
    links = (link("a", "b", 10.0, 20.0), link("a", "c", 10.0, 40.0), link("b", "c", 1.0, 20.0))
    payload = 4.0 * params  # fp32, uncompressed
    pl = (Assignment("a", 8), Assignment("b", 8), Assignment("c", 8))

    flat = CostModel(Snapshot((FAST_A, FAST_B, replace(FAST_A, name="c")), links), j)
    local = flat.estimate(pl, "none", "local-sgd:8")
    est = flat.estimate(pl, "none", "async-ps:2")
    wait = 0.040 + 2 * payload / (10e9 / 8)  # c's round trip to a: the slower of the two
    assert est.wan_s == pytest.approx(wait)
    assert est.step_time_s == pytest.approx(local.compute_s + local.intra_s + wait)
    assert est.wan_bytes == pytest.approx(steps * 2 * 2 * payload)

    apart = (FAST_A, replace(FAST_B, region="eu"), replace(FAST_A, name="c", region="ap"))
    regions = CostModel(Snapshot(apart, links), j)
    est = regions.estimate(pl, "none", "async-ps:2")
    assert est.wan_s == 0.0
    step = local.compute_s + local.intra_s
    assert est.step_time_s == pytest.approx(step)
    # the regions' servers at b and c exchange with the global one at a, each on its own
    # link, one in flight: each region every as many ticks as its exchange lasts, region by
    # region (at the farthest one's pace for both, the near one's bytes were missed:
    # promise.md), the plan's number, which the run keeps to
    near = 0.020 + 2 * payload / (10e9 / 8)
    # (and one spare tick for the landing); the last exchange is the flush after the run
    every = {"ap": math.ceil(wait / step) + 1, "eu": math.ceil(near / step) + 1}
    assert every["ap"] > every["eu"] > 2
    assert dict(est.relay_ticks) == every
    sent = sum(steps // t + 1 for t in every.values())
    assert est.wan_bytes == pytest.approx(sent * 2 * payload)
    # each call to a server blocks its caller for a fixed cost (`ps_push_s`, fitted from
    # finished runs), local pushes included: a longer tick, in which more exchanges fit
    push = 0.01
    pushed = CostModel(Snapshot(apart, links, ps_push_s=push), j)
    est = pushed.estimate(pl, "none", "async-ps:2")
    assert est.step_time_s == pytest.approx(step + push)
    longer = {r: math.ceil((t + push) / (step + push)) + 1 for r, t in (("ap", wait), ("eu", near))}
    assert dict(est.relay_ticks) == longer and longer["ap"] < every["ap"]
    sent = sum(steps // t + 1 for t in longer.values())
    assert est.wan_bytes == pytest.approx(sent * 2 * payload)
    # one region: no region exchanges to plan
    assert flat.estimate(pl, "none", "async-ps:2").relay_ticks == ()


def test_uneven_links_make_auto_consider_gossip_and_even_ones_do_not() -> None:
    four = tuple(cluster(n, 8) for n in "abcd")
    ring = tuple(link(a, b, 10.0, 20.0) for a, b in ("ab", "bc", "cd", "da"))
    uneven = Snapshot(four, (*ring, link("a", "c", 1.0, 150.0), link("b", "d", 1.0, 150.0)))
    wan_bound = job(32, params=100_000_000, flops_per_step=1e14, compression="none")
    # the fastest with a global exchange hides it by streaming, as gossip does; among the
    # modes that block on their exchange, gossip's graph is the fastest
    fixed = replace(wan_bound, sync="gossip:8")
    got = plan(uneven, fixed, "time", slack=0.0)
    assert isinstance(got, Plan) and got.sync.startswith("gossip:")
    search = _Search(CostModel(uneven, wan_bound), wan_bound, "time", 1, 32)
    assert any(s.startswith("gossip:") for _, s in search.combos(("a", "b", "c", "d")))
    # the graph the cost model priced: the slow diagonals are no chords, degree 2 each
    assert any(
        "exchanges only with its neighbours in the gossip graph (degree a 2, b 2, c 2, d 2" in line
        for line in got.explanation
    ), got.explanation
    even = Snapshot(four, tuple(link(a, b) for a, b in itertools.combinations("abcd", 2)))
    assert not _plan(even, wan_bound).sync.startswith("gossip:")
    search = _Search(CostModel(even, wan_bound), wan_bound, "time", 1, 32)
    assert not any(s.startswith("gossip:") for _, s in search.combos(("a", "b", "c", "d")))


@st.composite
def equal_speed_instances(draw: st.DrawFn) -> tuple[Snapshot, JobRequest]:
    n = draw(st.integers(1, 3))
    names = [f"c{i}" for i in range(n)]
    model = draw(st.sampled_from(["H100", "A100", "L4"]))
    clusters = tuple(
        cluster(
            name,
            draw(st.integers(1, 3)),
            gpu_model=model,
            price_per_gpu_hour=draw(st.sampled_from([1.0, 2.0])),
        )
        for name in names
    )
    links = tuple(link(a, b) for a, b in itertools.combinations(names, 2))
    gpus = draw(st.integers(1, sum(c.gpus_free for c in clusters)))
    j = job(
        gpus,
        params=draw(st.sampled_from([10_000_000, 300_000_000])),
        flops_per_step=draw(st.sampled_from([1e14, 1e16])),
    )
    return Snapshot(clusters, links), j


@settings(max_examples=25, deadline=None, derandomize=True)
@given(equal_speed_instances())
def test_equal_speeds_keep_the_existing_choice(inst: tuple[Snapshot, JobRequest]) -> None:
    """Equal GPUs and even links: the equal split is the throughput split, and auto picks
    among the modes it always had, the best of them."""
    snap, j = inst
    got = _plan(snap, j, slack=0.0)  # the fastest (quality weighed: tests/grammar)
    assert got.sync in AUTO_SYNCS_
    best = min(
        _plan(snap, replace(j, sync=s), slack=0.0).estimate.total_time_s for s in AUTO_SYNCS_
    )
    assert got.estimate.total_time_s == pytest.approx(best, rel=1e-9)
    rate = sum(a.gpus * snap.by_name[a.cluster].peak_tflops * 0.5e12 for a in got.placement)
    assert got.estimate.compute_s == pytest.approx(j.flops_per_step / rate)  # type: ignore[operator]


def test_a_given_placement_is_rechecked_against_data_residency() -> None:
    snap = Snapshot((FAST_A, FAST_B, SLOW_C), TRIANGLE)
    local = job(16, data_clusters=("a", "b"))
    outside = evaluate(snap, local, (Assignment("a", 8), Assignment("c", 8)))
    assert isinstance(outside, Infeasible)
    assert outside.constraint == "data"
    assert "'c' does not hold the job's data" in outside.reason
    inside = evaluate(snap, local, (Assignment("a", 8), Assignment("b", 8)))
    assert isinstance(inside, Plan)


def test_a_modes_quality_penalty_is_fitted_from_observed_runs() -> None:
    assert fit_steps_factor([1.1, 1.3, 1.2, float("nan")]) == pytest.approx(1.2)
    assert fit_steps_factor([0.9]) == 1.0  # one lucky run does not make a mode better
    assert fit_steps_factor([]) == 1.0


def test_a_fitted_penalty_reaches_the_planner() -> None:
    """A mode observed to need 3.5x the samples costs that in the plan's quality."""
    snap = Snapshot((FAST_A, FAST_B, SLOW_C), TRIANGLE)
    fixed = replace(BIG_STEP, sync="partial:16", compression="none")
    prior = _plan(snap, fixed).estimate.quality_cost
    fitted = {kind: fit_steps_factor([3.5]) for kind in ("partial", "async-ps")}
    got = plan(snap, fixed, "time", steps_factors=fitted)
    assert isinstance(got, Plan) and got.sync == "partial:16"
    assert got.estimate.quality_cost == pytest.approx(fitted["partial"] - 1.0)
    assert got.estimate.quality_cost > prior


def test_local_data_weighs_what_each_mode_costs_there() -> None:
    """On local data a mode's quality cost adds what its drift costs there
    (`grammar.quality.LOCAL_DATA_COST`); every-step's does not change; streaming's whole model
    in one fragment costs less there than fragments synced at staggered steps."""
    snap = Snapshot((cluster("a", 8), cluster("b", 8)), (link("a", "b"),))
    assert quality_cost("none", "streaming:16:f1:d3", local_data=True) < quality_cost(
        "none", "streaming:16:f4:d3", local_data=True
    )
    for sync in ("local-sgd:16", "gossip:16", "every-step", "streaming:16:f1:d3"):
        shared = job(16, compression="none", sync=sync)
        local = replace(shared, data_clusters=("a", "b"))
        a, b = _plan(snap, shared).estimate, _plan(snap, local).estimate
        assert b.quality_cost == pytest.approx(quality_cost("none", sync, local_data=True)), sync
        assert (b.quality_cost > a.quality_cost) == (sync != "every-step"), sync


def test_a_periodic_mode_counts_the_exchange_of_its_last_part_period() -> None:
    # 300 steps at H=8: 37 periods and the last 4 steps, which the runtime averages too
    snap = Snapshot((FAST_A, FAST_B), (link("a", "b"),))
    pl = (Assignment("a", 8), Assignment("b", 8))
    for steps, exchanges in ((300, 38), (320, 40)):
        model = CostModel(snap, replace(BIG_STEP, steps=steps))
        every = model.estimate(pl, "int8", "every-step")
        for sync in ("local-sgd:8", "partial:8"):
            est = model.estimate(pl, "int8", sync)
            assert est.wan_bytes == pytest.approx(every.wan_bytes / steps * exchanges, rel=1e-6)
