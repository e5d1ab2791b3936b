"""Smoke tests of the trace-driven simulator (`python -m bench.sim`)."""

from __future__ import annotations

import json
import math

import pytest

import scheduler
from bench.sim.__main__ import POLICIES, main
from bench.sim.engine import Cpn, kueue, simulate
from bench.sim.network import Network, build_network
from bench.sim.trace import TraceJob, synthetic
from controller.network.snapshot import World
from scheduler.rules import QueuedJob, order_queue

KEYS = (
    "mean_jct_s",
    "p95_jct_s",
    "queue_s",
    "utilisation",
    "cost",
    "wan_bytes",
    "deadline_misses",
    "fairness",
)


def test_quick_json_has_every_metric_for_every_policy(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--quick", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert set(out["policies"]) == set(POLICIES)
    for name, metrics in out["policies"].items():
        for key in KEYS:
            assert key in metrics, (name, key)
            assert math.isfinite(metrics[key]), (name, key, metrics[key])
        assert metrics["finished"] == 40, name


def test_trace_and_network_are_seeded() -> None:
    net = build_network(30, seed=3)
    assert net == build_network(30, seed=3)
    a, b = synthetic(200, net.capacity, seed=3), synthetic(200, net.capacity, seed=3)
    assert a == b
    assert [j.arrival_s for j in a] == sorted(j.arrival_s for j in a)
    assert sum(1 for j in a if j.gpus == 1) > len(a) / 2  # most jobs take one GPU


def test_order_queue_is_fair_share_and_scales() -> None:
    """The heap ordering alternates tenants by GPUs given, and orders 20,000 jobs (which the
    quadratic scan could not in a test's time)."""
    queue = [QueuedJob(id=f"a{i}", tenant="a", gpus=2, submitted_at=float(i)) for i in range(3)] + [
        QueuedJob(id=f"b{i}", tenant="b", gpus=1, submitted_at=float(10 + i)) for i in range(4)
    ]
    order = order_queue(queue, quotas={"a": 4})
    assert [j.id for j in order.order] == ["a0", "b0", "b1", "a1", "b2", "b3"]
    assert [j.id for j, _ in order.held] == ["a2"]
    big = [
        QueuedJob(id=f"j{i}", tenant=f"t{i % 50}", gpus=1, submitted_at=i) for i in range(20_000)
    ]
    assert len(order_queue(big).order) == 20_000


def test_cpn_cost_takes_the_cheapest_plan_within_its_slack_of_the_fastest() -> None:
    """`cpn-cost` drives the real planner twice per job ("time", then "cost-within-deadline"
    at 1.1x that time): on the same world each decision costs no more than the loop's fastest
    and runs at most 10 % longer, and a pass over 40 jobs costs less in all."""
    net = build_network(12, seed=0)
    jobs = [j for j in synthetic(200, net.capacity, seed=0) if j.deadline_s is None][:40]
    world = World(net.snapshot, {})
    for job in jobs[:10]:
        (fast,) = Cpn(net)._pass(0.0, [job], world)
        (cheap,) = Cpn(net, slack=0.1)._pass(0.0, [job], world)
        assert cheap.estimate.cost <= fast.estimate.cost + 1e-9, job.id
        assert cheap.estimate.total_time_s <= 1.1 * fast.estimate.total_time_s + 1e-6, job.id
    fast_pass = Cpn(net)._pass(0.0, jobs, world)
    cheap_pass = Cpn(net, slack=0.1)._pass(0.0, jobs, world)
    assert len(cheap_pass) == len(fast_pass)
    assert sum(d.estimate.cost for d in cheap_pass) < sum(d.estimate.cost for d in fast_pass)


def test_cpn_holds_a_job_for_fast_gpus_due_back_and_finishes_it_sooner() -> None:
    """8 H100s and 8 T4s; a short job takes the H100s, then a long one arrives: the loop's
    hold (`scheduler.soonest_wait`) keeps it for the H100s instead of the T4s free now, and it
    ends sooner than on the T4s (what first-fit and a planner without the hold give it)."""
    fast = scheduler.Cluster("fast", "r0", "H100", 8, 400.0, 3.0)
    slow = scheduler.Cluster("slow", "r0", "T4", 8, 25.0, 0.4)
    net = Network(scheduler.Snapshot(clusters=(fast, slow)), regions=1)
    trace = [
        TraceJob("short", "t00", 0.0, 8, 600.0, 10**8, None),
        TraceJob("long", "t00", 1.0, 8, 36_000.0, 10**8, None),
    ]
    held = {r.job.id: r for r in simulate(Cpn(net), net, trace).runs}
    first_fit = {r.job.id: r for r in simulate(kueue(), net, trace).runs}
    assert held["short"].start_s == 0.0 and first_fit["long"].start_s == 1.0
    assert held["long"].start_s == held["short"].finish_s  # waited for the H100s
    assert held["long"].finish_s < 0.5 * first_fit["long"].finish_s
