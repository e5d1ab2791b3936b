"""The control loop's decisions, fast: on SQLite and PostgreSQL, without Ray.

The same decisions `tests/e2e/test_control_loop.py` makes end to end (minutes, real Ray),
taken here by the real code over a migrated database in well under a second each: the
reconcile pass (`place_pending`) places and reserves, orders the queue by priority and
fairness, and preempts; the lease check moves a silent cluster to DOWN; the launcher's pass
stops the runs that must stop and settles them (`settle` -> `lifecycle.end_run`); the
controller loop adopts the jobs of a dead replica. A run's end is what a run's thread hands
the loop: a real `TrainReport`, `Progress` reports or an exception (see `world.py`).

How each single ending is settled is pinned in `test_settle.py` and the stop policy in
`test_policy.py`; this file follows jobs through several passes of the loop, and checks the
books (GPUs in use = open allocations; every usage row priced once) at every step.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import select

from controller.jobs import lifecycle
from controller.jobs.request import job_request
from controller.jobs.service import cancel
from controller.loop.controller import Controller, ReplicaConflict, check_single_replica
from controller.loop.policy import Decision, Stop, StopReason
from controller.loop.settle import settle
from controller.store.db import is_sqlite
from controller.store.models import Job, JobEvent, Replica, utcnow
from controller.values.errors import Conflict
from grammar.states import TERMINAL, TRANSITIONS, JobState
from scheduler import Wait, reference_run_s
from tests.controller.world import MAX_ATTEMPTS, REPLICA, Net, progress, report, spec
from wire.spec import DataSpec


@pytest.fixture
def net(db_url: str, tmp_path: Path) -> Iterator[Net]:
    """Clusters east (4 A100) and west (4 A100, dearer) joined by a fast link; no jobs."""
    n = Net(db_url, tmp_path)
    n.cluster("east", gpus=4, price="2.5")
    n.cluster("west", gpus=4, price="3.0")
    n.link("east", "west")
    yield n
    n.close()


# ---- placement -----------------------------------------------------------------------------


def test_a_pending_job_is_placed_and_its_gpus_reserved(net: Net) -> None:
    tenant = net.tenant("acme")
    job_id = net.submit(tenant, spec("a", gpus=4))
    assert net.place() == [job_id]
    job = net.job(job_id)
    assert job.state is JobState.SCHEDULED and job.owner == REPLICA
    assert job.placement is not None and job.placement.gpus == 4
    held = net.held(job_id)
    assert sum(held.values()) == 4
    assert {(s.cluster, s.gpus, s.gpu_model) for s in job.placement.clusters} == {
        (c, n, "A100") for c, n in held.items()
    }
    assert job.reason == "placed: " + ", ".join(f"{c}:{n}" for c, n in held.items())
    assert net.books().in_use == {"east": 0, "west": 0} | held
    assert net.states(job_id) == [JobState.PENDING, JobState.SCHEDULED]
    assert net.place() == []  # placed once: the next pass has nothing to do


@pytest.mark.parametrize(
    ("long_waited", "first"),
    [(0.5, "short"), (4.0, "long")],
    ids=["short-passes-long", "long-has-aged"],
)
def test_a_tenants_jobs_go_by_response_ratio(net: Net, long_waited: float, first: str) -> None:
    """Both need every GPU. The short job (~100 s) has waited its size (ratio 2); the long one
    (~10,000 s) `long_waited` times its size: the short passes it, unless it has aged past."""
    tenant = net.tenant("acme")
    specs = {"long": spec("long", gpus=8, steps=1000, heavy=True)}
    specs["short"] = spec("short", gpus=8, steps=10, heavy=True)
    size = {k: reference_run_s(job_request(v, tenant)) for k, v in specs.items()}
    assert size["long"] > 50 * size["short"]
    now = utcnow()
    ids = {
        "long": net.submit(
            tenant, specs["long"], at=now - timedelta(seconds=long_waited * size["long"])
        ),
        "short": net.submit(tenant, specs["short"], at=now - timedelta(seconds=size["short"])),
    }
    assert net.place() == [ids[first]]


def test_jobs_too_large_at_the_head_of_the_queue_do_not_stop_the_pass(net: Net) -> None:
    """70 gangs of 9 GPUs (the network has 8) come first in the order (least work per GPU,
    waited longest); a pass tries 64 jobs, yet the 1-GPU job behind them is placed: after
    the first gang fails for capacity, the others of at least its size are not tried."""
    tenant = net.tenant("acme")
    gangs = [net.submit(tenant, spec(f"gang-{i}", gpus=9, steps=10)) for i in range(70)]
    small = net.submit(tenant, spec("small", gpus=1, steps=100_000))
    assert net.place() == [small]
    first = net.job(gangs[0])
    assert first.reason == "waiting: 8 free GPUs where the job may run; it needs 9"
    assert net.job(gangs[-1]).state is JobState.PENDING


def test_a_job_kept_to_its_data_does_not_hold_back_one_free_to_go(net: Net) -> None:
    """East's 4 GPUs, where the first job's data is, cannot take 6 (a capacity failure); the
    pass still tries the same size with no such limit."""
    tenant = net.tenant("acme")
    local = DataSpec(residency="local", clusters=["east"])
    kept_spec = spec("kept", gpus=6, steps=10).model_copy(update={"data": local})
    kept = net.submit(tenant, kept_spec)
    free = net.submit(tenant, spec("free", gpus=6, steps=100_000))
    assert net.place() == [free]
    assert net.job(kept).reason == "waiting: 4 free GPUs where the job may run; it needs 6"


def test_a_job_that_does_not_fit_waits_with_the_reason(net: Net) -> None:
    tenant = net.tenant("acme", priority_ceiling=1)
    # the first goes first and runs for long: what it holds is not worth waiting for
    # (`scheduler.waiting`), so the third takes what is left rather than wait for it
    first = net.submit(tenant, spec("first", gpus=6, steps=10**7, qos={"priority": 1}))
    second = net.submit(tenant, spec("second", gpus=4))
    third = net.submit(tenant, spec("third", gpus=2))
    # One pass: the second waits, and the third, which fits, is not held up behind it.
    assert net.place() == [first, third]
    assert sum(net.held(first).values()) == 6 and sum(net.held(third).values()) == 2
    waiting = net.job(second)
    assert waiting.state is JobState.PENDING and waiting.placement is None
    assert waiting.reason == "waiting: 2 free GPUs where the job may run; it needs 4"
    assert net.held(second) == {}
    assert net.books().in_use == {"east": 4, "west": 4}
    # The next pass keeps the reason current.
    assert net.place() == []
    assert net.job(second).reason == "waiting: 0 free GPUs where the job may run; it needs 4"


@pytest.mark.parametrize(("first_steps", "worth_waiting"), [(10, True), (10**7, False)])
def test_a_job_waits_for_fast_gpus_handed_back_soon_rather_than_take_slow_ones(
    db_url: str, tmp_path: Path, first_steps: int, worth_waiting: bool
) -> None:
    """4 H100s and 4 T4s. The first job takes the H100s; the second would run ~15x slower on
    the T4s than on the H100s: it waits for them when the first is expected to end soon (and
    takes them once it has), and takes the T4s when the first holds them for ages."""
    net = Net(db_url, tmp_path)
    try:
        net.cluster("fast", gpus=4, model="H100", price="3.0")
        net.cluster("slow", gpus=4, model="T4", price="0.4")
        tenant = net.tenant("acme")
        first = net.submit(tenant, spec("first", gpus=4, steps=first_steps, heavy=True))
        assert net.place() == [first]
        placed = net.job(first)
        assert placed.placement is not None and placed.ends_at is not None
        assert net.held(first) == {"fast": 4}
        # its end is the moment it was placed (after its submission, before its state change
        # was written) plus its plan's run time
        start = placed.ends_at - timedelta(seconds=placed.placement.estimate.total_time_s)
        tick = timedelta(milliseconds=1)  # the stored times' rounding
        assert placed.created_at - tick <= start <= placed.updated_at + tick
        second = net.submit(tenant, spec("second", gpus=4, steps=1000, heavy=True))
        if not worth_waiting:
            assert net.place() == [second] and net.held(second) == {"slow": 4}
            return
        waits: dict[str, Wait] = {}
        assert net.place(waits=waits) == []
        held = net.job(second)
        assert held.state is JobState.PENDING and net.held(second) == {}
        assert held.reason.startswith("waiting: for 4 GPUs on fast, expected free at ")
        assert held.reason.endswith("sooner than on any GPUs free now")
        assert net.books().in_use == {"fast": 4, "slow": 0}
        assert waits[second].cluster == "fast"
        assert waits[second].at_s == pytest.approx(placed.ends_at.timestamp())
        weighed = waits[second]
        assert net.place(waits=waits) == []  # not weighed again before the H100s are due...
        assert waits[second] is weighed
        # ...unless they come back sooner: the first ends early, the second takes them
        net.finish(net.start(first), report=report(first_steps, net.held(first)))
        assert utcnow().timestamp() < waits[second].at_s
        assert net.place(waits=waits) == [second] and net.held(second) == {"fast": 4}
    finally:
        net.close()


@pytest.mark.parametrize(("fast_price", "worth_waiting"), [("3.0", True), ("60.0", False)])
def test_a_job_with_a_deadline_waits_only_when_that_costs_no_more(
    db_url: str, tmp_path: Path, fast_price: str, worth_waiting: bool
) -> None:
    """As the job without one does (above), a job with a deadline waits for the H100s due back
    when that finishes it sooner, but only at no more cost than the T4s free now: at 3 $/h
    (~2x less per FLOP than the T4s at 0.4) it waits, at 60 $/h it takes the T4s (placed for
    cost within its deadline, it was held again each time the H100s came back)."""
    net = Net(db_url, tmp_path)
    try:
        net.cluster("fast", gpus=4, model="H100", price=fast_price)
        net.cluster("slow", gpus=4, model="T4", price="0.4")
        tenant = net.tenant("acme")
        first = net.submit(tenant, spec("first", gpus=4, steps=10, heavy=True))
        assert net.place() == [first] and net.held(first) == {"fast": 4}
        deadline = {"deadline": utcnow() + timedelta(days=2)}
        second = net.submit(tenant, spec("second", gpus=4, steps=1000, heavy=True, qos=deadline))
        waits: dict[str, Wait] = {}
        if not worth_waiting:
            assert net.place(waits=waits) == [second] and net.held(second) == {"slow": 4}
            assert waits == {}
            return
        assert net.place(waits=waits) == []
        held = net.job(second)
        assert held.reason.startswith("waiting: for 4 GPUs on fast, expected free at ")
        assert "sooner than on the GPUs free now (slow:4)" in held.reason
        assert waits[second].frugal
        net.finish(net.start(first), report=report(10, net.held(first)))
        assert net.place(waits=waits) == [second] and net.held(second) == {"fast": 4}
    finally:
        net.close()


def test_higher_priority_is_placed_first_as_far_as_it_is_granted(net: Net) -> None:
    granted = net.tenant("granted", priority_ceiling=5)
    ungranted = net.tenant("ungranted")  # ceiling 0: priority is granted, not chosen
    # Submitted in this order (one second apart): the last, of higher priority, goes first.
    low = net.submit(granted, spec("low", gpus=8))
    asks = net.submit(ungranted, spec("asks", gpus=8, qos={"priority": 9}))
    high = net.submit(granted, spec("high", gpus=8, qos={"priority": 5}))
    assert net.place() == [high]
    # Neither is preemptible (standard class): the others wait and nothing is preempted.
    for job_id in (low, asks):
        job = net.job(job_id)
        assert job.state is JobState.PENDING and job.reason.startswith("waiting: ")
    assert net.job(high).preempted_by is None
    # Once it is done, the job that asked for 9 counts as its tenant's 0, the same as `low`,
    # which was submitted first and goes first.
    net.finish(net.start(high), report=report(100, net.held(high)))
    assert net.place() == [low]
    assert net.job(asks).state is JobState.PENDING


def test_tenants_share_fairly_within_a_priority(net: Net) -> None:
    busy, idle = net.tenant("busy"), net.tenant("idle")
    t0 = utcnow() - timedelta(minutes=10)

    def at(seconds: int) -> datetime:
        return t0 + timedelta(seconds=seconds)

    a1 = net.submit(busy, spec("a1", gpus=4), at=at(0))
    assert net.place() == [a1]
    # GPUs a tenant holds count: idle's job goes before busy's earlier one.
    a2 = net.submit(busy, spec("a2", gpus=4), at=at(1))
    b1 = net.submit(idle, spec("b1", gpus=4), at=at(2))
    assert net.place() == [b1]
    assert net.job(a2).state is JobState.PENDING
    for job_id in (a1, b1):
        net.finish(net.start(job_id), report=report(100, net.held(job_id)))
    # Progressive filling within one pass: busy's first job, then idle's (it holds nothing
    # more) before busy's second, although that one was submitted earlier.
    a3 = net.submit(busy, spec("a3", gpus=4), at=at(3))
    b2 = net.submit(idle, spec("b2", gpus=4), at=at(4))
    assert net.place() == [a2, b2]
    assert net.job(a3).state is JobState.PENDING


def test_a_tenant_over_its_quota_is_held_with_the_reason(net: Net) -> None:
    tenant = net.tenant("capped", gpu_quota=4)
    first = net.submit(tenant, spec("first", gpus=4))
    second = net.submit(tenant, spec("second", gpus=2))
    assert net.place() == [first]
    assert net.job(second).reason == f"waiting: tenant {tenant!r} quota 4 GPUs would be exceeded"
    assert net.books().in_use["east"] + net.books().in_use["west"] == 4


def test_a_held_quote_is_placed_as_quoted(net: Net) -> None:
    net.cluster("south", gpus=4, model="L4", price="0.2")
    net.link("east", "south")
    net.link("west", "south")
    tenant = net.tenant("acme")
    ask = spec("quoted", gpus=4)
    options = net.quote(tenant, ask)
    cheapest, fastest = options["cost"], options["time"]
    assert {s.cluster for s in cheapest.clusters} != {s.cluster for s in fastest.clusters}
    held = net.submit(tenant, ask, held=cheapest)
    plain = net.submit(tenant, spec("plain", gpus=4))
    placed = net.place()
    assert placed == [held, plain]
    assert net.held(held) == {s.cluster: s.gpus for s in cheapest.clusters}
    assert net.held(plain) == {s.cluster: s.gpus for s in fastest.clusters}


def test_a_job_whose_deadline_passed_fails_instead_of_waiting(net: Net) -> None:
    tenant = net.tenant("acme")
    late = net.submit(tenant, spec("late", gpus=2, qos={"deadline": utcnow() - timedelta(hours=1)}))
    assert net.place() == []
    job = net.job(late)
    assert job.state is JobState.FAILED and job.finished_at is not None
    assert job.reason.startswith("cannot be placed: qos.deadline ")
    assert job.reason.endswith("is in the past; give a future time")
    assert net.books().held == {}


def test_a_job_that_fails_amid_a_group_of_placements_leaves_the_others_placed(net: Net) -> None:
    """A pass commits its placements in groups of 1, 2, 4, ...: a job failed in the middle of
    a group (its deadline passed) is failed alone, the jobs before and after it in the same
    transaction are placed, and the books hold exactly their GPUs."""
    tenant = net.tenant("acme")
    ids = [net.submit(tenant, spec(f"j{i}", gpus=1)) for i in range(2)]
    late = net.submit(tenant, spec("late", gpus=1, qos={"deadline": utcnow() - timedelta(hours=1)}))
    ids += [net.submit(tenant, spec(f"j{i}", gpus=1)) for i in range(2, 6)]
    assert net.place() == ids
    assert net.job(late).state is JobState.FAILED
    for job_id in ids:
        assert net.job(job_id).state is JobState.SCHEDULED
        assert sum(net.held(job_id).values()) == 1
    books = net.books()
    assert sum(books.in_use.values()) == len(ids) and net.held(late) == {}


# ---- preemption ----------------------------------------------------------------------------


def test_a_higher_priority_job_preempts_a_preemptible_one(net: Net) -> None:
    tenant = net.tenant("acme", priority_ceiling=10)
    low = net.submit(tenant, spec("low", gpus=8, qos={"qos_class": "spot"}))
    assert net.place() == [low]
    run = net.start(low)
    run.on_progress(progress(30, run.clusters))
    high = net.submit(tenant, spec("high", gpus=2, qos={"priority": 10}))

    # The pass names the victim and leaves the GPUs where they are until its run stops.
    assert net.place() == []
    assert net.job(low).preempted_by == high
    assert net.job(high).reason.startswith("waiting: preempting ")
    assert net.books().in_use == {"east": 4, "west": 4}
    assert net.place() == []  # asked once: a second pass changes nothing
    assert net.job(high).state is JobState.PENDING

    # The launcher's pass asks the run to stop; the run checkpoints and ends; it is settled.
    net.launcher.tick()
    assert run.stop == Stop(StopReason.PREEMPTED, high)
    victim = net.finish(run, report=report(30, run.clusters, stopped=True))
    assert victim.state is JobState.PENDING and victim.preempted_by is None
    assert victim.attempts == 0 and victim.checkpoint_step == 30
    assert victim.reason == "preempted by a higher-priority job; checkpointed, resumes later"
    books = net.books(low)
    assert books.held == {} and books.usage_rows > 0 and books.charged > 0

    # Now the high job is placed; the victim waits for GPUs (it may not preempt it back).
    assert net.place() == [high]
    assert net.job(low).state is JobState.PENDING and net.job(high).preempted_by is None
    assert net.job(low).reason.startswith("waiting: ")
    charged_low = net.books(low).charged
    net.finish(net.start(high), report=report(100, net.held(high)))
    assert net.books(high).charged > 0

    # And the victim resumes; each run was billed once, to its own job.
    assert net.place() == [low]
    assert net.books(low).charged == charged_low
    assert net.states(low) == [
        JobState.PENDING,
        JobState.SCHEDULED,
        JobState.RUNNING,
        JobState.PENDING,
        JobState.SCHEDULED,
    ]
    assert net.states(high) == [
        JobState.PENDING,
        JobState.SCHEDULED,
        JobState.RUNNING,
        JobState.SUCCEEDED,
    ]


def test_jobs_that_are_not_preemptible_or_not_lower_are_never_victims(net: Net) -> None:
    tenant = net.tenant("acme", priority_ceiling=10)
    standard = net.submit(tenant, spec("standard", gpus=4, qos={"priority": 0}))
    peer = spec("spot-peer", gpus=4, qos={"qos_class": "spot", "priority": 10})
    spot_peer = net.submit(tenant, peer)
    assert sorted(net.place()) == sorted([standard, spot_peer])
    high = net.submit(tenant, spec("high", gpus=2, qos={"priority": 10}))
    assert net.place() == []
    assert net.job(standard).preempted_by is None and net.job(spot_peer).preempted_by is None
    assert net.job(high).reason == "waiting: 0 free GPUs where the job may run; it needs 2"


# ---- failover ------------------------------------------------------------------------------


def test_a_cluster_going_down_moves_its_jobs_and_they_are_placed_on_what_is_left(
    net: Net,
) -> None:
    net.cluster("south", gpus=2, model="L4", price="0.8")
    net.link("east", "south")
    net.link("west", "south")
    tenant = net.tenant("acme")
    elastic = net.submit(tenant, spec("elastic", min_gpus=2, max_gpus=8, heavy=True))
    assert net.place() == [elastic]
    assert net.held(elastic) == {"east": 4, "west": 4}  # as many as it may take
    spare = net.submit(tenant, spec("spare", gpus=2))
    assert net.place() == [spare]
    assert net.held(spare) == {"south": 2}
    runs = {job_id: net.start(job_id) for job_id in (elastic, spare)}
    for run in runs.values():
        run.on_progress(progress(40, run.clusters))
    net.launcher.tick()

    assert net.lose("west") == [("west", "READY", "DOWN")]
    net.launcher.tick()
    assert runs[elastic].stop == Stop(StopReason.CLUSTER_DOWN, "west")
    assert runs[spare].stop is None  # not on west: runs on
    moved = net.finish(runs[elastic], report=report(40, runs[elastic].clusters, stopped=True))
    assert moved.state is JobState.RESCHEDULING and moved.attempts == 0
    assert moved.reason == "cluster west is DOWN; placing again on what is left"
    assert net.books().held == {"south": 2}

    # Placed again on what is left, shrunk within its range; west is not used while DOWN.
    assert net.place() == [elastic]
    job = net.job(elastic)
    assert job.state is JobState.SCHEDULED and net.held(elastic) == {"east": 4}
    assert job.placement is not None and job.placement.gpus == 4
    assert net.states(elastic)[-2:] == [JobState.RESCHEDULING, JobState.SCHEDULED]
    # it resumes from its checkpoint: expected to end when the steps left are done
    assert job.checkpoint_step == 40 and job.ends_at is not None
    assert (job.ends_at - job.updated_at).total_seconds() == pytest.approx(
        0.6 * job.placement.estimate.total_time_s, abs=1.0
    )
    assert net.books().in_use == {"east": 4, "west": 0, "south": 2}


def test_a_moved_job_with_nowhere_to_go_waits_until_the_cluster_returns(net: Net) -> None:
    tenant = net.tenant("acme")
    job_id = net.submit(tenant, spec("wide", gpus=8))
    assert net.place() == [job_id]
    run = net.start(job_id)
    net.lose("east")
    net.launcher.tick()
    assert net.finish(run, report=report(10, run.clusters, stopped=True)).state is (
        JobState.RESCHEDULING
    )
    assert net.place() == []
    job = net.job(job_id)
    assert job.state is JobState.RESCHEDULING
    assert job.reason.startswith("waiting: 4 free GPUs") and "needs 8" in job.reason
    net.beat("east", at=net.clock)  # its agent is back: READY at the next heartbeat
    assert net.place() == [job_id]
    assert net.held(job_id) == {"east": 4, "west": 4}


# ---- settlement ----------------------------------------------------------------------------


@pytest.mark.parametrize("ending", ["success", "failure", "cancel"])
def test_each_ending_releases_the_gpus_and_bills_once_even_when_settled_twice(
    net: Net, ending: str
) -> None:
    tenant = net.tenant("acme")
    job_id = net.submit(tenant, spec("j", gpus=8))
    net.place()
    run = net.start(job_id)
    if ending == "failure":
        with net.sessions() as s, s.begin():
            row = s.get(Job, job_id)
            assert row is not None
            row.attempts = MAX_ATTEMPTS - 1  # this is its last attempt
    run.on_progress(progress(50, run.clusters))
    net.launcher.tick()
    if ending == "cancel":
        with net.sessions() as s, s.begin():
            row = s.get(Job, job_id)
            assert row is not None
            cancel(s, row, "cancelled by tenant")
        assert net.books().held == {}  # GPUs back before the workers stop
        net.launcher.tick()
        assert run.stop == Stop(StopReason.CANCELLED)
    run.on_progress(progress(60, run.clusters))
    ended = net.finish(
        run,
        report=report(100, run.clusters) if ending == "success" else None,
        error=RuntimeError("actor died") if ending == "failure" else None,
    )
    expected = {
        "success": JobState.SUCCEEDED,
        "failure": JobState.FAILED,
        "cancel": JobState.CANCELLED,
    }[ending]
    assert ended.state is expected and ended.finished_at is not None
    books = net.books(job_id)
    assert books.held == {} and books.in_use == {"east": 0, "west": 0}
    gpu_rows = 2  # one per allocation (east, west): one price span each
    wan_rows = 2 * 2  # east->west and west->east, for each of the two flushes (new bytes only)
    assert books.usage_rows == books.ledger_rows == gpu_rows + wan_rows
    assert books.charged > 0

    # Settling the same run again charges nothing more and moves nothing: a finished job is
    # refused by the state machine (its transaction rolls back); a cancelled one, which
    # moves nowhere, only closes the run's books again, and they are closed.
    if ending == "cancel":
        assert settle(net.sessions, run, REPLICA, MAX_ATTEMPTS) is Decision.DONE
    else:
        with pytest.raises(Conflict, match="cannot become"):
            settle(net.sessions, run, REPLICA, MAX_ATTEMPTS)
    assert net.books(job_id) == books
    assert net.job(job_id).state is expected
    assert net.job(job_id).attempts == ended.attempts


def test_a_failed_attempt_is_placed_again_and_counted(net: Net) -> None:
    tenant = net.tenant("acme")
    job_id = net.submit(tenant, spec("flaky", gpus=4))
    for attempt in range(1, MAX_ATTEMPTS + 1):
        assert net.place() == [job_id]
        run = net.start(job_id)
        ended = net.finish(run, error=RuntimeError(f"actor died {attempt}"))
        assert ended.attempts == attempt
        assert net.books().held == {}
    assert ended.state is JobState.FAILED
    assert ended.reason == f"failed {MAX_ATTEMPTS} times: RuntimeError: actor died {MAX_ATTEMPTS}"
    assert net.place() == []
    assert net.books(job_id).usage_rows == MAX_ATTEMPTS  # each attempt billed once


# ---- replicas ------------------------------------------------------------------------------


def test_the_jobs_of_a_dead_replica_are_adopted_once(net: Net) -> None:
    tenant = net.tenant("acme")
    orphan = net.submit(tenant, spec("orphan", gpus=4))
    kept = net.submit(tenant, spec("kept", gpus=4))
    assert sorted(net.place()) == sorted([orphan, kept])
    run = net.start(orphan)
    with net.sessions() as s, s.begin():
        s.add(Replica(id=REPLICA, seen_at=utcnow() - timedelta(minutes=5)))  # went silent
        s.add(Replica(id="replica-live"))
        row = s.get(Job, kept)
        assert row is not None
        row.owner = "replica-live"
    before = net.books()

    survivor = Controller(net.sessions, sqlite=is_sqlite(str(net.engine.url)), launch=False)
    survivor.tick()
    assert net.job(orphan).owner == survivor.id and net.job(orphan).state is JobState.RUNNING
    assert net.job(kept).owner == "replica-live"
    assert (
        f"adopted by replica {survivor.id} (owner {REPLICA} is gone); restarting from the "
        "last checkpoint"
    ) in net.messages(orphan)
    assert net.books() == before  # same GPUs, not reserved a second time

    other = Controller(net.sessions, sqlite=False, launch=False)
    other.tick()  # the survivor is alive: nothing for a second replica to adopt
    assert net.job(orphan).owner == survivor.id
    with net.sessions() as s:
        adoptions = s.scalars(
            select(JobEvent.id).where(
                JobEvent.job_id == orphan, JobEvent.message.startswith("adopted by")
            )
        ).all()
    assert len(adoptions) == 1

    # The old replica comes back: its run is no longer its to settle; books stay as they are.
    net.launcher.tick()
    assert run.stop == Stop(StopReason.ADOPTED)
    left = net.finish(run, error=RuntimeError("stopped"))
    assert left.state is JobState.RUNNING and left.owner == survivor.id
    assert net.books() == before


def test_a_second_live_replica_is_refused_on_one_database(net: Net) -> None:
    first = Controller(net.sessions, sqlite=True, launch=False)
    first.tick()
    with pytest.raises(ReplicaConflict, match="another cpn serve"):
        check_single_replica(net.sessions, first.replica_ttl_s, me="replica-b")
    check_single_replica(net.sessions, first.replica_ttl_s, me=first.id)


# ---- the state machine ---------------------------------------------------------------------


def test_every_transition_the_table_forbids_is_refused_on_the_database(net: Net) -> None:
    tenant = net.tenant("acme")
    pairs = [(a, b) for a in JobState for b in JobState]
    stored = spec("j", gpus=1).model_dump(mode="json")
    with net.sessions() as s, s.begin():
        jobs = [
            Job(tenant_id=tenant, name="j", spec=stored, gpus_min=1, gpus_max=1, state=a)
            for a, _ in pairs
        ]
        s.add_all(jobs)
        s.flush()
        for job, (a, b) in zip(jobs, pairs, strict=True):
            if b in TRANSITIONS[a]:
                lifecycle.transition(s, job, b, "allowed")
            else:
                with pytest.raises(Conflict, match=f"is {a} and cannot become {b}") as refused:
                    lifecycle.transition(s, job, b, "refused")
                assert refused.value.field == "state"
        ids = [job.id for job in jobs]
    with net.sessions() as s:
        rows = {j.id: j for j in s.scalars(select(Job).where(Job.id.in_(ids)))}
        events = dict(
            s.execute(
                select(JobEvent.job_id, JobEvent.to_state).where(JobEvent.job_id.in_(ids))
            ).all()
        )
    for job_id, (a, b) in zip(ids, pairs, strict=True):
        allowed = b in TRANSITIONS[a]
        row = rows[job_id]
        assert row.state is (b if allowed else a), (a, b)
        assert (row.finished_at is not None) == (allowed and b in TERMINAL), (a, b)
        assert events.get(job_id) == (b if allowed else None), (a, b)
