"""Money as invariants, on SQLite and PostgreSQL, without Ray: a tenant's budget is a hard
limit at placement and while its jobs run, billing starts when a job runs, the ledger is
append-only in the database and its sums are exact.

Placement is the real reconcile pass (`place_pending`) over real rows; a run is a real
`RunHandle` fed real `Progress` reports, which the launcher's own loop (`Launcher.tick`)
flushes, checks and settles, as in tests/controller/test_settle.py.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from sqlalchemy import event as sa_event
from sqlalchemy import func, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

import scheduler
from api.processes import wait_until
from controller.jobs import lifecycle
from controller.jobs.request import spec_of
from controller.jobs.service import cancel
from controller.loop.launcher import Launcher
from controller.loop.placement import place_pending, plan_for
from controller.loop.policy import Decision, Stop, StopReason, decide, next_state, stop_requested
from controller.loop.ray_run import LauncherConfig, train_spec_of
from controller.loop.runs import RunHandle
from controller.money import budget
from controller.money.metering import from_micros, micros, tenant_spend, unbilled
from controller.network.allocations import Slot, reserve
from controller.network.resources import declare_link
from controller.network.snapshot import build_world
from controller.store.db import is_sqlite, make_engine, make_sessionmaker
from controller.store.models import (
    QOS_CLASSES,
    Allocation,
    Cluster,
    ClusterGpus,
    EgressPrice,
    GpuPrice,
    Job,
    JobEvent,
    LedgerEntry,
    Tenant,
    Usage,
    utcnow,
)
from controller.values.plan import plan_of
from grammar.states import JobState
from training import Progress, WanBytes
from wire.spec import JobSpec

REPLICA = "replica-a"
GPU_PRICE = Decimal("2.5")
EGRESS_PER_GB = Decimal("1.0")


@dataclass
class Books:
    sessions: sessionmaker[Session]
    launcher: Launcher
    url: str


@pytest.fixture
def books(db_url: str, tmp_path: Path) -> Iterator[Books]:
    """Clusters a and b (4 A100 each, 2.50 per GPU-hour, 1.00 per GB between them)."""
    engine = make_engine(db_url)
    sessions = make_sessionmaker(engine)
    an_hour_ago = utcnow() - timedelta(hours=1)
    with sessions() as s, s.begin():
        ids = {}
        for name in ("a", "b"):
            c = Cluster(name=name, region=name, state="READY")
            s.add(c)
            s.flush()
            ids[name] = c.id
            s.add(ClusterGpus(cluster_id=c.id, model="A100", memory_gib=80, count=4, allocatable=4))
            for qos_class in QOS_CLASSES:
                s.add(
                    GpuPrice(
                        cluster_id=c.id,
                        gpu_model="A100",
                        qos_class=qos_class,
                        price_per_gpu_hour=GPU_PRICE,
                        effective_from=an_hour_ago,
                    )
                )
        for src, dst in (("a", "b"), ("b", "a")):
            declare_link(
                s, src, dst, bandwidth_gbps=100, rtt_ms=2, loss=0.0,
                egress_price_per_gb=float(EGRESS_PER_GB),
            )  # fmt: skip
            s.add(
                EgressPrice(
                    src_cluster_id=ids[src],
                    dst_cluster_id=ids[dst],
                    price_per_gb=EGRESS_PER_GB,
                    effective_from=an_hour_ago,
                )
            )
    config = LauncherConfig(replica_id=REPLICA, checkpoint_root=tmp_path, max_attempts=3)
    yield Books(sessions, Launcher(sessions, config), db_url)
    engine.dispose()


def tenant(books: Books, name: str, limit: str | None) -> str:
    with books.sessions() as s, s.begin():
        t = Tenant(name=name, budget=None if limit is None else float(limit))
        s.add(t)
        s.flush()
        return t.id


def set_budget(books: Books, tenant_id: str, limit: str) -> None:
    with books.sessions() as s, s.begin():
        t = s.get(Tenant, tenant_id)
        assert t is not None
        t.budget = float(limit)


def submit(books: Books, tenant_id: str, name: str, gpus: int = 2, steps: int = 100) -> str:
    spec = JobSpec(name=name, task="builtin:mnist1d-mlp", gpus=gpus, steps=steps)
    with books.sessions() as s, s.begin():
        job = Job(
            tenant_id=tenant_id,
            name=name,
            spec=spec.model_dump(mode="json"),
            gpus_min=gpus,
            gpus_max=gpus,
        )
        s.add(job)
        s.flush()
        lifecycle.created(s, job, "submitted")
        return job.id


def job(books: Books, job_id: str) -> Job:
    with books.sessions() as s:
        row = s.get(Job, job_id)
        assert row is not None
        s.expunge(row)
        return row


def cheapest(books: Books, job_id: str) -> Decimal:
    """What the planner's cheapest plan for the job costs now."""
    with books.sessions() as s:
        row = s.get(Job, job_id)
        assert row is not None
        world = build_world(s, row.qos_class)
        result = plan_for(world, row, None, utcnow(), max_cost=1e12)
        assert isinstance(result, scheduler.Plan)
        return budget.as_money(result.estimate.cost)


def open_allocations(books: Books, job_id: str) -> list[Allocation]:
    with books.sessions() as s:
        return list(
            s.scalars(
                select(Allocation).where(Allocation.job_id == job_id, Allocation.ended_at.is_(None))
            )
        )


def start(books: Books, job_id: str) -> RunHandle:
    """What `controller.loop.ray_run` does before Ray: RUNNING, and a handle for the launcher."""
    with books.sessions() as s, s.begin():
        row = s.get(Job, job_id)
        assert row is not None and row.state is JobState.SCHEDULED and row.owner == REPLICA
        lifecycle.transition(s, row, JobState.RUNNING, "launched")
    clusters: dict[str, int] = {}
    with books.sessions() as s:
        for name, gpus in s.execute(
            select(Cluster.name, Allocation.gpus)
            .join(Cluster, Cluster.id == Allocation.cluster_id)
            .where(Allocation.job_id == job_id, Allocation.ended_at.is_(None))
        ):
            clusters[name] = clusters.get(name, 0) + gpus
    handle = RunHandle(
        job_id=job_id,
        clusters=clusters,
        gpu_models=dict.fromkeys(clusters, "A100"),
        flops_per_step=1e9,
        predicted_step_s=None,
    )
    books.launcher.handles[job_id] = handle
    return handle


def progress(step: int, wan_bytes: int) -> Progress:
    return Progress(
        step=step,
        total_steps=100,
        loss=1.0,
        accuracy=None,
        wall_s=0.01 * step,
        compute_s=0.005 * step,
        comm_s=0.002 * step,
        wan_bytes=WanBytes({("a", "b"): wan_bytes}),
        wan_bytes_total=wan_bytes,
        compression_ratio=1.0,
        compression="none",
    )


# ---- the pure rules -------------------------------------------------------------------------


def test_the_budget_rules() -> None:
    committed = budget.Commitment(charged=Decimal("3"), held=Decimal("5"))
    assert budget.refusal(Decimal("10"), committed, Decimal("2")) is None  # exactly fits
    why = budget.refusal(Decimal("10"), committed, Decimal("2.01"))
    assert why is not None and "has 2.00 of its budget of 10.00 left" in why
    assert "3.00 charged, 5.00 held by its running jobs" in why
    assert budget.as_money(0.01) == Decimal("0.01")  # not the float's binary expansion
    assert budget.reached(Decimal("1"), Decimal("1")) and not budget.reached(
        Decimal("1"), Decimal(0)
    )
    assert not budget.reached(Decimal("0"), Decimal("0"))  # nothing spent reaches nothing
    assert decide(StopReason.BUDGET, 0, 3) is Decision.FAIL
    assert next_state(StopReason.BUDGET, Decision.FAIL) is JobState.FAILED
    row = {"job_state": JobState.RUNNING, "preempted_by": "j2", "down_cluster": "b"}
    assert stop_requested(owned=True, over_budget="spent 2 of 1", **row) == Stop(  # type: ignore[arg-type]
        StopReason.BUDGET, "spent 2 of 1"
    )
    assert stop_requested(owned=False, over_budget="spent", **row) == Stop(StopReason.ADOPTED)  # type: ignore[arg-type]


# ---- placement ------------------------------------------------------------------------------


def test_a_job_over_the_budget_stays_pending_and_is_never_placed(books: Books) -> None:
    poor = tenant(books, "poor", "0.01")
    expensive = submit(books, poor, "big", gpus=8, steps=10**9)
    assert cheapest(books, expensive) > 100  # "estimated in the hundreds"
    for _ in range(3):  # pass after pass: it waits, it is never placed
        assert place_pending(books.sessions, REPLICA) == []
        row = job(books, expensive)
        assert row.state is JobState.PENDING and row.placement is None
        assert row.reason.startswith("waiting: the plan costs")
        assert "has 0.01 of its budget of 0.01 left" in row.reason
        assert open_allocations(books, expensive) == []
    with books.sessions() as s:
        assert sum(s.scalars(select(ClusterGpus.in_use))) == 0
    # An admin raises the budget: it is placed on the next pass.
    set_budget(books, poor, "1000000000")
    assert [p.job_id for p in place_pending(books.sessions, REPLICA)] == [expensive]


def test_jobs_placed_in_one_pass_count_against_each_other(books: Books) -> None:
    t = tenant(books, "t", None)
    first = submit(books, t, "first", steps=10**7)
    second = submit(books, t, "second", steps=10**7)
    cost = cheapest(books, first)
    set_budget(books, t, str(cost + cost / 2))  # room for one, not two
    placed = [p.job_id for p in place_pending(books.sessions, REPLICA)]
    assert len(placed) == 1
    waiting = job(books, second if placed == [first] else first)
    assert waiting.state is JobState.PENDING
    assert "held by its running jobs" in waiting.reason
    with books.sessions() as s:
        committed = budget.commitment(s, t, utcnow())
    assert committed.charged == 0 and committed.held == budget.estimate_of(
        job(books, placed[0]).placement
    )


def test_a_cheaper_plan_is_taken_when_the_fastest_does_not_fit(books: Books) -> None:
    """b's GPUs cost ten times a's: the fastest plan spreads over both, the cheapest stays on
    a; with a budget between the two, the cheapest is placed instead of waiting."""
    t = tenant(books, "t", None)
    with books.sessions() as s, s.begin():
        b = s.scalars(select(Cluster).where(Cluster.name == "b")).one()
        for qos_class in QOS_CLASSES:
            s.add(
                GpuPrice(
                    cluster_id=b.id,
                    gpu_model="A100",
                    qos_class=qos_class,
                    price_per_gpu_hour=GPU_PRICE * 10,
                    effective_from=utcnow() - timedelta(minutes=1),
                )
            )
    job_id = submit(books, t, "j", gpus=4, steps=10**6)
    with books.sessions() as s:
        row = s.get(Job, job_id)
        assert row is not None
        fastest = plan_for(build_world(s, "standard"), row, None, utcnow())
    assert isinstance(fastest, scheduler.Plan)
    cheap = cheapest(books, job_id)
    assert cheap < budget.as_money(fastest.estimate.cost)
    room = cheap + Decimal("0.01")  # (cheap is rounded to 6 places; the plan is not)
    set_budget(books, t, str(room))
    assert [p.job_id for p in place_pending(books.sessions, REPLICA)] == [job_id]
    placed = job(books, job_id).placement
    assert placed is not None and budget.estimate_of(placed) <= room
    assert [(c.cluster, c.gpus) for c in placed.clusters] == [("a", 4)]


def _pg_only(url: str) -> None:
    if is_sqlite(url):
        pytest.skip("SQLite runs one controller replica; this race needs two (PostgreSQL)")


def test_a_placement_waits_for_another_replicas_placement_of_the_same_tenant(
    books: Books,
) -> None:
    """Replica A holds the tenant's row while it places a job; replica B's placement of the
    tenant's other job waits for A's commit, then sees A's job and leaves its own waiting."""
    _pg_only(books.url)
    t = tenant(books, "t", None)
    first = submit(books, t, "first", steps=10**7)
    second = submit(books, t, "second", steps=10**7)
    cost = cheapest(books, first)
    set_budget(books, t, str(cost + cost / 2))
    outcome: list[object] = []
    with books.sessions() as a:
        a.begin()
        try:
            assert budget.lock_terms(a, t).budget is not None  # A: tenant row locked
            row = a.get(Job, first)
            assert row is not None
            world = build_world(a, "standard")
            result = plan_for(world, row, None, utcnow())
            assert isinstance(result, scheduler.Plan)
            reserve(a, row, [Slot(*world.origins[x.cluster], x.gpus) for x in result.placement])
            row.placement = plan_of(result, world.snapshot, world.origins, "standard")
            budget.hold(a, row, row.placement)  # as a placement holds its estimate
            row.owner = "replica-a"
            lifecycle.transition(a, row, JobState.SCHEDULED, "placed by A")
            a.flush()

            replica_b = threading.Thread(
                target=lambda: outcome.append(place_pending(books.sessions, "replica-b"))
            )
            replica_b.start()
            watcher = make_engine(books.url)
            try:

                def b_waits_on_a_lock() -> bool:
                    with watcher.connect() as conn:
                        return bool(
                            conn.execute(
                                text(
                                    "SELECT count(*) FROM pg_stat_activity WHERE datname = "
                                    "current_database() AND wait_event_type = 'Lock'"
                                )
                            ).scalar()
                        )

                wait_until(b_waits_on_a_lock, timeout=60, what="replica B waiting on a lock")
            finally:
                watcher.dispose()
            a.commit()
        finally:
            if a.in_transaction():
                a.rollback()
    replica_b.join(timeout=60)
    assert outcome == [[]]  # B placed nothing
    assert job(books, first).state is JobState.SCHEDULED
    waiting = job(books, second)
    assert waiting.state is JobState.PENDING and "held by its running jobs" in waiting.reason


def test_concurrent_replicas_never_spend_more_than_the_budget(books: Books) -> None:
    _pg_only(books.url)
    t = tenant(books, "t", None)
    jobs = [submit(books, t, f"j{i}", gpus=1, steps=10**7) for i in range(6)]
    cost = cheapest(books, jobs[0])
    set_budget(books, t, str(cost * 2 + cost / 2))  # room for two of the six
    start_line = threading.Barrier(3)
    results: list[int] = []

    def replica(owner: str) -> None:
        start_line.wait()
        results.append(len(place_pending(books.sessions, owner)))

    threads = [threading.Thread(target=replica, args=(f"replica-{i}",)) for i in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert sum(results) == 2
    with books.sessions() as s:
        held = budget.commitment(s, t, utcnow())
    assert held.total <= cost * 2 + cost / 2


def test_a_deleted_tenants_pending_job_fails_instead_of_being_placed(books: Books) -> None:
    t = tenant(books, "gone", None)
    job_id = submit(books, t, "late")
    with books.sessions() as s, s.begin():
        gone = s.get(Tenant, t)
        assert gone is not None
        gone.deleted_at = utcnow()
    assert place_pending(books.sessions, REPLICA) == []
    row = job(books, job_id)
    assert row.state is JobState.FAILED and "its tenant was deleted" in row.reason


# ---- the running totals ---------------------------------------------------------------------


def _books_agree(books: Books, tenant_id: str) -> Decimal:
    """The tenant's running totals equal its books summed afresh; returns what it holds."""
    with books.sessions() as s:
        row = s.get(Tenant, tenant_id)
        assert row is not None
        assert row.charged_micros == micros(tenant_spend(s, tenant_id))
        holding = s.scalars(
            select(Job).where(
                Job.tenant_id == tenant_id,
                Job.id.in_(select(Allocation.job_id).where(Allocation.ended_at.is_(None))),
            )
        ).all()
        assert {j.id for j in holding} == set(
            s.scalars(
                select(Job.id).where(Job.tenant_id == tenant_id, Job.held_micros.is_not(None))
            )
        )
        assert row.held_micros == sum(micros(budget.estimate_of(j.placement)) for j in holding)
        return from_micros(row.held_micros)


def test_the_running_totals_equal_the_books_summed_afresh(books: Books) -> None:
    """Placed, cancelled before running, run and billed, charged by hand: at every step the
    tenant row's totals are what the ledger and the jobs holding GPUs add up to."""
    t = tenant(books, "t", "1000")
    jobs = [submit(books, t, f"j{i}", gpus=2) for i in range(3)]
    assert _books_agree(books, t) == 0
    assert len(place_pending(books.sessions, REPLICA)) == 3
    held = _books_agree(books, t)
    assert held > 0
    with books.sessions() as s, s.begin():  # cancelled before it ran: nothing billed
        row = s.get(Job, jobs[0])
        assert row is not None
        cancel(s, row, "no")
    assert _books_agree(books, t) < held
    start(books, jobs[1])
    with books.sessions() as s, s.begin():  # ran for an hour, then cancelled: billed
        for alloc in s.scalars(select(Allocation).where(Allocation.job_id == jobs[1])):
            alloc.billed_from = utcnow() - timedelta(hours=1)
    with books.sessions() as s, s.begin():
        row = s.get(Job, jobs[1])
        assert row is not None
        cancel(s, row, "enough")
    with books.sessions() as s, s.begin():  # a second end of the same run holds nothing back
        row = s.get(Job, jobs[1])
        assert row is not None
        lifecycle.end_run(s, row)
    _one_charge(books, t, "0.123457")  # written straight into the ledger: the trigger counts it
    _books_agree(books, t)
    with books.sessions() as s:
        committed = budget.commitment(s, t, utcnow())
        assert committed.charged >= Decimal("5.123457")
        row = s.get(Job, jobs[2])
        assert row is not None
        assert committed.held == budget.estimate_of(row.placement)


def test_a_run_past_its_estimated_end_holds_what_it_cost_beyond_its_estimate(
    books: Books,
) -> None:
    t = tenant(books, "t", "1000")
    job_id = submit(books, t, "j", gpus=2)
    place_pending(books.sessions, REPLICA)
    start(books, job_id)
    with books.sessions() as s, s.begin():  # an hour at 2 x 2.50, estimated at far less
        for alloc in s.scalars(select(Allocation).where(Allocation.job_id == job_id)):
            alloc.billed_from = utcnow() - timedelta(hours=1)
        row = s.get(Job, job_id)
        assert row is not None
        estimate = budget.estimate_of(row.placement)
        assert estimate < 5
    with books.sessions() as s:
        assert budget.commitment(s, t, utcnow()).held == estimate  # not yet past its end
    with books.sessions() as s, s.begin():
        row = s.get(Job, job_id)
        assert row is not None
        row.ends_at = utcnow() - timedelta(minutes=1)
    with books.sessions() as s:
        assert Decimal("5") <= budget.commitment(s, t, utcnow()).held < Decimal("5.01")


def test_a_budget_check_reads_the_same_rows_however_many_jobs_the_tenant_runs(
    books: Books,
) -> None:
    """The check is a few statements whatever the tenant's active jobs: re-summing them made
    each placement's cost grow with the tenant's backlog, a pass quadratically."""
    t = tenant(books, "t", "1000")
    statements: list[str] = []

    def count(_conn: object, _cursor: object, statement: str, *_: object) -> None:
        statements.append(statement)

    def check() -> int:
        statements.clear()
        with books.sessions() as s:
            engine = s.get_bind()
            sa_event.listen(engine, "before_cursor_execute", count)
            try:
                budget.commitment(s, t, utcnow())
            finally:
                sa_event.remove(engine, "before_cursor_execute", count)
        return len(statements)

    submit(books, t, "first", gpus=1)
    place_pending(books.sessions, REPLICA)
    one = check()
    for i in range(7):
        submit(books, t, f"j{i}", gpus=1)
    assert len(place_pending(books.sessions, REPLICA)) == 7
    assert check() == one <= 3


# ---- while jobs run -------------------------------------------------------------------------


def test_billing_starts_when_the_job_runs_not_when_gpus_are_reserved(books: Books) -> None:
    t = tenant(books, "t", None)
    waiting, running = submit(books, t, "waiting"), submit(books, t, "running")
    assert len(place_pending(books.sessions, REPLICA)) == 2
    # A job cancelled before it ran held GPUs, and is billed nothing.
    with books.sessions() as s, s.begin():
        row = s.get(Job, waiting)
        assert row is not None and row.state is JobState.SCHEDULED
        cancel(s, row, "changed my mind")
    with books.sessions() as s:
        assert s.scalar(select(func.count()).where(Usage.job_id == waiting)) == 0
    # A job that ran is billed from the moment it ran, not from its reservation.
    reserved_at = max(a.started_at for a in open_allocations(books, running))
    before_run = utcnow()
    assert before_run > reserved_at
    start(books, running)
    for alloc in open_allocations(books, running):
        assert alloc.billed_from is not None and alloc.billed_from >= before_run
    with books.sessions() as s, s.begin():
        row = s.get(Job, running)
        assert row is not None
        cancel(s, row, "enough")  # ends the run on the books: metered, priced
    with books.sessions() as s:
        usage = list(s.scalars(select(Usage).where(Usage.job_id == running)))
        allocs = list(s.scalars(select(Allocation).where(Allocation.job_id == running)))
    assert usage and all(u.kind == "gpu_seconds" for u in usage)
    assert {u.period_start for u in usage} == {a.billed_from for a in allocs}
    assert min(u.period_start for u in usage) >= before_run


def test_a_running_job_whose_wan_traffic_crosses_the_budget_is_stopped(books: Books) -> None:
    t = tenant(books, "t", "5")
    job_id = submit(books, t, "j", gpus=8)  # 4 on a, 4 on b: its gradients cross the WAN
    assert [p.job_id for p in place_pending(books.sessions, REPLICA)] == [job_id]
    handle = start(books, job_id)

    handle.on_progress(progress(10, 1_000_000))  # 1 MB: 0.001 of egress, well within
    books.launcher.tick()
    assert handle.stop is None
    handle.on_progress(progress(20, 6_000_000_000))  # 6 GB in all: 6.00 > 5.00
    books.launcher.tick()
    assert handle.stop is not None and handle.stop.reason is StopReason.BUDGET
    assert re.fullmatch(r"the tenant spent 6\.\d\d of its budget of 5\.00", handle.stop.detail)

    handle.done.set()  # the run checkpoints and stops
    books.launcher.tick()
    row = job(books, job_id)
    assert row.state is JobState.FAILED and row.attempts == 0
    assert row.reason.startswith("budget exhausted: the tenant spent 6.")
    assert "stopped at step 20 (checkpointed)" in row.reason
    assert open_allocations(books, job_id) == []
    with books.sessions() as s:
        assert tenant_spend(s, t) >= Decimal("6")
        usage = list(s.scalars(select(Usage).where(Usage.job_id == job_id)))
        assert usage and all(u.priced for u in usage)
        event = s.scalars(
            select(JobEvent)
            .where(JobEvent.job_id == job_id, JobEvent.kind == "state")
            .order_by(JobEvent.id.desc())
        ).first()
    assert event is not None and event.data == {"step": 20, "stop": "budget"}


def test_a_run_whose_gpu_time_reaches_the_budget_is_stopped(books: Books) -> None:
    """An hour on 2 GPUs at 2.50 costs 5.00; with 4.00 of budget its run is stopped."""
    t = tenant(books, "t", None)
    job_id = submit(books, t, "j", gpus=2)
    place_pending(books.sessions, REPLICA)
    handle = start(books, job_id)
    books.launcher.tick()
    assert handle.stop is None
    with books.sessions() as s, s.begin():  # the run has been going for an hour
        for alloc in s.scalars(select(Allocation).where(Allocation.job_id == job_id)):
            alloc.billed_from = utcnow() - timedelta(hours=1)
    with books.sessions() as s:
        row = s.get(Job, job_id)
        assert row is not None
        assert Decimal("5") <= unbilled(s, row, utcnow()) < Decimal("5.01")
    books.launcher.tick()
    assert handle.stop is None  # no budget, no limit
    set_budget(books, t, "4")
    books.launcher.tick()
    assert handle.stop is not None and handle.stop.reason is StopReason.BUDGET
    handle.done.set()
    books.launcher.tick()
    row = job(books, job_id)
    assert row.state is JobState.FAILED and row.reason.startswith("budget exhausted")
    with books.sessions() as s:
        assert Decimal("5") <= tenant_spend(s, t) < Decimal("5.01")


# ---- the ledger -----------------------------------------------------------------------------


def _one_charge(books: Books, tenant_id: str, amount: str) -> tuple[int, int]:
    """A usage row and its ledger entry; (usage id, ledger id)."""
    now = utcnow()
    job_id = submit(books, tenant_id, f"j{amount}{now.timestamp()}")
    with books.sessions() as s, s.begin():
        usage = Usage(
            tenant_id=tenant_id,
            job_id=job_id,
            kind="wan_bytes",
            cluster="a",
            dst_cluster="b",
            quantity=Decimal(1),
            period_start=now,
            period_end=now,
            priced=True,
        )
        s.add(usage)
        s.flush()
        entry = LedgerEntry(
            tenant_id=tenant_id,
            job_id=job_id,
            usage_id=usage.id,
            kind="egress",
            description="WAN a -> b",
            quantity=Decimal(1),
            unit_price=Decimal(amount),
            amount=Decimal(amount),
            period_start=now,
            period_end=now,
        )
        s.add(entry)
        s.flush()
        return usage.id, entry.id


def test_the_ledger_refuses_update_and_delete_in_the_database(books: Books) -> None:
    t = tenant(books, "t", None)
    usage_id, entry_id = _one_charge(books, t, "1.25")
    statements = [
        f"UPDATE ledger SET amount = 0 WHERE id = {entry_id}",
        f"DELETE FROM ledger WHERE id = {entry_id}",
        "DELETE FROM ledger",
    ]
    if not is_sqlite(books.url):  # CASCADE: its postings refer to it (they refuse it too)
        statements.append("TRUNCATE ledger CASCADE")
    for statement in statements:
        refused = pytest.raises(IntegrityError, match="append-only")
        with refused, books.sessions() as s, s.begin():
            s.execute(text(statement))
    with books.sessions() as s:  # and through the ORM
        row = s.get(LedgerEntry, entry_id)
        assert row is not None
        row.amount = Decimal(0)
        with pytest.raises(IntegrityError, match="append-only"):
            s.commit()
    # A usage row is charged once: a second entry for it is refused.
    with pytest.raises(IntegrityError), books.sessions() as s, s.begin():
        first = s.get(LedgerEntry, entry_id)
        assert first is not None
        s.add(
            LedgerEntry(
                tenant_id=t,
                job_id=first.job_id,
                usage_id=usage_id,
                kind="egress",
                description="twice",
                quantity=Decimal(1),
                unit_price=Decimal(1),
                amount=Decimal(1),
                period_start=first.period_start,
                period_end=first.period_end,
            )
        )
    # Deleting the tenant or the job outright is refused too: the money trail stays.
    for statement in (f"DELETE FROM tenants WHERE id = '{t}'", "DELETE FROM jobs"):
        with pytest.raises(IntegrityError), books.sessions() as s, s.begin():
            s.execute(text(statement))
    with books.sessions() as s:
        entry = s.get(LedgerEntry, entry_id)
        assert entry is not None and entry.amount == Decimal("1.25")


def test_ledger_sums_are_exact_decimals(books: Books) -> None:
    t = tenant(books, "t", None)
    for _ in range(10):
        _one_charge(books, t, "0.1")
    _one_charge(books, t, "123456789.000001")
    with books.sessions() as s:
        assert tenant_spend(s, t) == Decimal("123456790.000001")
    assert sum([0.1] * 10) != 1.0  # what a float sum would have said


# ---- typed arguments ------------------------------------------------------------------------


def test_a_job_stored_with_old_free_form_args_loads_and_runs_as_0016_left_it(
    books: Books,
) -> None:
    from tests.controller.test_plan import REVISION_0016

    t = tenant(books, "t", None)
    job_id = submit(books, t, "old")
    old = {
        "name": "old",
        "task": "builtin:mnist1d-mlp",
        "args": {"eval_every": -1, "lr": 0.05, "momentum_typo": 0.9, "seed": "7"},
        "gpus": 2,
        "steps": 100,
        "qos": {"qos_class": "standard", "priority": 0},
        "compression": "auto",
        "sync": "auto",
    }
    with books.sessions() as s, s.begin():  # the row an older cpn stored, as 0016 rewrote it
        s.execute(
            text("UPDATE jobs SET spec = :spec WHERE id = :id"),
            {"spec": json.dumps(REVISION_0016._typed_args(old)), "id": job_id},
        )
    assert [p.job_id for p in place_pending(books.sessions, REPLICA)] == [job_id]
    with books.sessions() as s:
        row = s.get(Job, job_id)
        assert row is not None
        spec = spec_of(row)
        assert spec.args.lr == 0.05 and spec.args.eval_every is None and spec.args.seed is None
        clusters = {"a": 2}
        train = train_spec_of(books.launcher.config, row, spec, clusters)
    assert train.lr == 0.05 and train.eval_every == 0 and train.seed == 0  # runtime defaults
    assert train.checkpoint_every == 10


def test_typed_args_reach_the_runtime(books: Books) -> None:
    t = tenant(books, "t", None)
    spec = JobSpec.model_validate(
        {
            "name": "typed",
            "task": "builtin:mnist1d-mlp",
            "gpus": 2,
            "steps": 100,
            "args": {
                "batch_size": 64,
                "lr": 0.2,
                "seed": 3,
                "eval_every": 5,
                "checkpoint_every": 0,
                "outer_lr": 1.0,
                "outer_momentum": 0.0,
            },
        }
    )
    with books.sessions() as s, s.begin():
        row = Job(
            tenant_id=t, name="typed", spec=spec.model_dump(mode="json"), gpus_min=2, gpus_max=2
        )
        s.add(row)
        s.flush()
        train = train_spec_of(books.launcher.config, row, spec_of(row), {"a": 2})
    assert (train.batch_size, train.lr, train.seed, train.eval_every) == (64, 0.2, 3, 5)
    assert (train.checkpoint_every, train.outer_lr, train.outer_momentum) == (0, 1.0, 0.0)
    train.validate()
