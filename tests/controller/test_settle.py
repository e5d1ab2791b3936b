"""Job states, the end of a run and settlement, on SQLite and PostgreSQL, without Ray.

A run is a real `RunHandle` given what a run's thread gives it (a `TrainReport`, an
exception, `Progress` reports); the launcher's own loop (`Launcher.tick`) flushes, asks the run
to stop and settles it through the real session factory.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from controller.jobs import lifecycle
from controller.jobs.service import cancel
from controller.loop.launcher import Launcher, LauncherConfig
from controller.loop.policy import Decision, Stop, StopReason
from controller.loop.runs import RunHandle
from controller.loop.settle import settle
from controller.network.allocations import Slot, reserve
from controller.store.db import make_engine, make_sessionmaker
from controller.store.models import (
    Allocation,
    Cluster,
    ClusterGpus,
    GpuPrice,
    Job,
    JobEvent,
    LedgerEntry,
    Tenant,
    Usage,
    utcnow,
)
from controller.values.errors import Conflict
from grammar.states import TERMINAL, TRANSITIONS, ClusterState, JobState
from training import Progress, TrainReport, WanBytes

REPLICA = "replica-1"
SPEC = {"name": "j", "task": "builtin:mnist1d-mlp", "gpus": 2, "steps": 100}


@dataclass
class Plane:
    sessions: sessionmaker[Session]
    launcher: Launcher


@pytest.fixture
def plane(db_url: str, tmp_path: Path) -> Iterator[Plane]:
    engine = make_engine(db_url)
    sessions = make_sessionmaker(engine)
    with sessions() as s, s.begin():
        for name in ("a", "b"):
            c = Cluster(name=name, region="r", state="READY")
            s.add(c)
            s.flush()
            s.add(ClusterGpus(cluster_id=c.id, model="A100", memory_gib=80, count=4, allocatable=4))
            s.add(
                GpuPrice(
                    cluster_id=c.id,
                    gpu_model="A100",
                    qos_class="standard",
                    price_per_gpu_hour=Decimal("2.5"),
                    effective_from=utcnow() - timedelta(hours=1),
                )
            )
        s.add(Tenant(id="t1", name="t1"))
    config = LauncherConfig(replica_id=REPLICA, checkpoint_root=tmp_path, max_attempts=3)
    yield Plane(sessions, Launcher(sessions, config))
    engine.dispose()


def running_job(plane: Plane, attempts: int = 0) -> RunHandle:
    """A job placed on a:1 and b:1, RUNNING under this replica, and its run's handle."""
    with plane.sessions() as s, s.begin():
        job = Job(tenant_id="t1", name="j", spec=SPEC, gpus_min=2, gpus_max=2, owner=REPLICA)
        job.attempts = attempts
        s.add(job)
        s.flush()
        lifecycle.created(s, job, "submitted")
        reserve(s, job, [Slot("a", "A100", 1), Slot("b", "A100", 1)])
        lifecycle.transition(s, job, JobState.SCHEDULED, "placed")
        lifecycle.transition(s, job, JobState.RUNNING, "launched")
        job_id = job.id
    handle = RunHandle(
        job_id=job_id,
        clusters={"a": 1, "b": 1},
        gpu_models={"a": "A100", "b": "A100"},
        flops_per_step=1e9,
        predicted_step_s=None,
    )
    plane.launcher.handles[job_id] = handle
    return handle


def report(steps: int = 100) -> TrainReport:
    return TrainReport(
        task="builtin:mnist1d-mlp",
        clusters={"a": 1, "b": 1},
        compression="none",
        sync="every-step",
        steps=steps,
        final_loss=0.5,
        final_accuracy=0.875,
        wall_s=2.0,
        compute_s=1.0,
        comm_s=0.5,
        wan_s=0.5,
        wan_bytes=WanBytes({("a", "b"): 4000, ("b", "a"): 4000}),
        wan_bytes_total=8000,
        compression_ratio=1.0,
        wan_emulated=True,
        links=[],
        restarts=0,
        resumed_from_step=None,
        stopped=False,
        history=[],
    )


def progress(step: int, wan: int) -> Progress:
    return Progress(
        step=step,
        total_steps=100,
        loss=1.0 / step,
        accuracy=None,
        wall_s=0.01 * step,
        compute_s=0.005 * step,
        comm_s=0.002 * step,
        wan_bytes=WanBytes({("a", "b"): wan, ("b", "a"): wan}),
        wan_bytes_total=2 * wan,
        compression_ratio=1.0,
        compression="none",
        compute_by_cluster={"a": 0.005 * step, "b": 0.006 * step},
    )


def finish(plane: Plane, handle: RunHandle) -> Job:
    """The run's thread ends; the next pass of the loop settles it."""
    handle.done.set()
    plane.launcher.tick()
    assert handle.job_id not in plane.launcher.handles
    with plane.sessions() as s:
        job = s.get(Job, handle.job_id)
        assert job is not None
        s.expunge(job)
        return job


def gpus_in_use(plane: Plane) -> int:
    with plane.sessions() as s:
        return sum(s.scalars(select(ClusterGpus.in_use)))


def open_allocations(plane: Plane, job_id: str) -> int:
    with plane.sessions() as s:
        rows = s.scalars(
            select(Allocation).where(Allocation.job_id == job_id, Allocation.ended_at.is_(None))
        )
        return len(list(rows))


def last_state_event(plane: Plane, job_id: str) -> JobEvent:
    with plane.sessions() as s:
        event = s.scalars(
            select(JobEvent)
            .where(JobEvent.job_id == job_id, JobEvent.kind == "state")
            .order_by(JobEvent.id.desc())
        ).first()
        assert event is not None
        return event


def assert_settled(plane: Plane, job_id: str) -> None:
    """GPUs back, every allocation metered to its end, every usage row priced."""
    assert open_allocations(plane, job_id) == 0
    assert gpus_in_use(plane) == 0
    with plane.sessions() as s:
        usage = list(s.scalars(select(Usage).where(Usage.job_id == job_id)))
        ledger = list(s.scalars(select(LedgerEntry).where(LedgerEntry.job_id == job_id)))
        allocs = list(s.scalars(select(Allocation).where(Allocation.job_id == job_id)))
    assert usage and all(u.priced for u in usage)
    assert len(ledger) == len(usage)
    assert all(a.metered_until == a.ended_at for a in allocs)


# ---- the state machine ---------------------------------------------------------------------


def test_the_transition_table_is_closed_and_ends_in_terminal_states() -> None:
    assert set(TRANSITIONS) == set(JobState)
    assert {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED} == TERMINAL
    assert all(TRANSITIONS[s] for s in JobState if s not in TERMINAL)
    # the stored strings are the names they always were
    assert [str(s) for s in JobState] == [
        "PENDING",
        "SCHEDULED",
        "RUNNING",
        "RESCHEDULING",
        "SUCCEEDED",
        "FAILED",
        "CANCELLED",
    ]


def test_illegal_transitions_are_refused_and_change_nothing(plane: Plane) -> None:
    with plane.sessions() as s, s.begin():
        job = Job(tenant_id="t1", name="j", spec=SPEC, gpus_min=2, gpus_max=2)
        s.add(job)
        s.flush()
        lifecycle.created(s, job, "submitted")
        job_id = job.id
    for to in (JobState.RUNNING, JobState.SUCCEEDED, JobState.RESCHEDULING):
        with plane.sessions() as s, s.begin():
            row = s.get(Job, job_id)
            assert row is not None
            with pytest.raises(Conflict, match="PENDING and cannot become") as exc:
                lifecycle.transition(s, row, to, "no")
            assert exc.value.field == "state"
    with plane.sessions() as s, s.begin():
        row = s.get(Job, job_id)
        assert row is not None and row.state is JobState.PENDING
        lifecycle.transition(s, row, JobState.CANCELLED, "by tenant")
    with plane.sessions() as s, s.begin():
        row = s.get(Job, job_id)
        assert row is not None and row.state is JobState.CANCELLED and row.finished_at
        for to in JobState:
            with pytest.raises(Conflict, match=r"nothing \(it has ended\)"):
                lifecycle.transition(s, row, to, "no")


# ---- how runs end --------------------------------------------------------------------------


def test_a_completed_run_succeeds_and_is_billed(plane: Plane) -> None:
    handle = running_job(plane)
    handle.on_progress(progress(50, 1000))
    plane.launcher.tick()  # flushed while running: metrics, WAN bytes metered
    handle.on_progress(progress(100, 4000))
    handle.report = report()
    job = finish(plane, handle)
    assert job.state is JobState.SUCCEEDED and job.checkpoint_step == 100
    event = last_state_event(plane, job.id)
    assert event.message == "finished 100 steps: accuracy 0.8750"
    assert event.data["report"]["wan_bytes_total"] == 8000
    assert event.data["report"]["wan_setup_bytes"] == report().wan_setup_bytes
    assert_settled(plane, job.id)
    with plane.sessions() as s:
        wan = list(s.scalars(select(Usage).where(Usage.kind == "wan_bytes")))
    # only new bytes are metered: 1000 then 3000 more, per direction
    assert sum(int(u.quantity) for u in wan) == 8000


def test_a_run_that_fell_from_its_best_succeeds_with_a_warning(plane: Plane) -> None:
    handle = running_job(plane)
    handle.on_progress(progress(100, 4000))
    warning = "the run's evaluation diverged: final accuracy 0.2170 against its best 0.3400"
    handle.report = replace(report(), best_step=50, best_accuracy=0.34, warning=warning)
    job = finish(plane, handle)
    assert job.state is JobState.SUCCEEDED
    event = last_state_event(plane, job.id)
    assert "its best evaluation: accuracy 0.3400 at step 50" in event.message
    assert event.data["report"]["best_step"] == 50
    with plane.sessions() as s:
        kinds = {
            e.kind: e.message for e in s.scalars(select(JobEvent).where(JobEvent.job_id == job.id))
        }
    assert kinds["warning"] == warning


def test_errors_retry_then_fail(plane: Plane) -> None:
    handle = running_job(plane)
    handle.error = RuntimeError("actor died")
    job = finish(plane, handle)
    assert job.state is JobState.RESCHEDULING and job.attempts == 1
    assert job.reason == "attempt 1 failed; retrying from the last checkpoint"
    assert_settled(plane, job.id)

    handle = running_job(plane, attempts=2)
    handle.error = RuntimeError("actor died")
    job = finish(plane, handle)
    assert job.state is JobState.FAILED and job.attempts == 3
    assert job.reason == "failed 3 times: RuntimeError: actor died"
    assert_settled(plane, job.id)


def test_a_task_that_cannot_run_fails_at_once(plane: Plane) -> None:
    handle = running_job(plane)
    handle.error = ValueError("unknown builtin task")
    job = finish(plane, handle)
    assert job.state is JobState.FAILED and job.attempts == 1
    assert job.reason == "the job cannot run: ValueError: unknown builtin task"
    assert_settled(plane, job.id)


def test_preemption_queues_the_job_again(plane: Plane) -> None:
    handle = running_job(plane)
    with plane.sessions() as s, s.begin():
        job = s.get(Job, handle.job_id)
        assert job is not None
        job.preempted_by = "urgent-job"
    handle.on_progress(progress(30, 500))
    plane.launcher.tick()
    assert handle.stop == Stop(StopReason.PREEMPTED, "urgent-job") and handle.should_stop()
    job = finish(plane, handle)
    assert job.state is JobState.PENDING and job.preempted_by is None and job.attempts == 0
    event = last_state_event(plane, job.id)
    # The preempting job may be another tenant's: the victim's reason does not name it.
    assert event.message == "preempted by a higher-priority job; checkpointed, resumes later"
    assert event.data == {"step": 30}
    assert_settled(plane, job.id)


def test_a_cluster_going_down_places_the_job_again(plane: Plane) -> None:
    handle = running_job(plane)
    with plane.sessions() as s, s.begin():
        cluster = s.scalars(select(Cluster).where(Cluster.name == "b")).one()
        cluster.state = ClusterState.DOWN
    plane.launcher.tick()
    assert handle.stop == Stop(StopReason.CLUSTER_DOWN, "b")
    job = finish(plane, handle)
    assert job.state is JobState.RESCHEDULING and job.attempts == 0
    assert job.reason == "cluster b is DOWN; placing again on what is left"
    assert_settled(plane, job.id)


def test_cancel_ends_the_run_at_once_and_bills_what_its_last_reports_bring(
    plane: Plane,
) -> None:
    handle = running_job(plane)
    with plane.sessions() as s, s.begin():
        job = s.get(Job, handle.job_id)
        assert job is not None
        cancel(s, job, "cancelled by tenant")
    assert gpus_in_use(plane) == 0  # GPUs are back before the workers stop
    plane.launcher.tick()
    assert handle.stop == Stop(StopReason.CANCELLED)
    handle.on_progress(progress(20, 700))  # reported on the way down
    job = finish(plane, handle)
    assert job.state is JobState.CANCELLED
    with plane.sessions() as s:
        messages = list(
            s.scalars(
                select(JobEvent.message).where(JobEvent.job_id == job.id).order_by(JobEvent.id)
            )
        )
    assert messages[-1] == "workers stopped"
    assert_settled(plane, job.id)
    with plane.sessions() as s:
        gpu_rows = list(s.scalars(select(Usage).where(Usage.kind == "gpu_seconds")))
    assert len(gpu_rows) == 2  # one per allocation: settling again charged nothing twice


def test_shutdown_and_adoption_leave_the_job_as_it_is(plane: Plane) -> None:
    handle = running_job(plane)
    handle.request_stop(Stop(StopReason.SHUTDOWN))
    job = finish(plane, handle)
    assert job.state is JobState.RUNNING and gpus_in_use(plane) == 2  # for adoption

    handle = running_job(plane)
    with plane.sessions() as s, s.begin():
        row = s.get(Job, handle.job_id)
        assert row is not None
        row.owner = "replica-2"
    plane.launcher.tick()
    assert handle.stop == Stop(StopReason.ADOPTED)
    handle.error = RuntimeError("stopped")
    decision = settle(plane.sessions, handle, REPLICA, 3)
    assert decision is Decision.LEAVE
    assert open_allocations(plane, handle.job_id) == 2 and gpus_in_use(plane) == 4


def test_a_best_by_eval_loss_is_named_so_beside_its_accuracy(plane: Plane) -> None:
    """A run whose eval loss rose while its accuracy did not: the best evaluation is the one
    of least eval loss, so the message says so rather than call a lower accuracy its best."""
    handle = running_job(plane)
    handle.on_progress(progress(100, 4000))
    warning = "the run's evaluation got worse: final eval loss 1.832 against its best 1.221"
    handle.report = replace(
        report(),
        best_step=474,
        best_accuracy=0.579,
        best_eval_loss=1.221,
        final_eval_loss=1.832,
        warning=warning,
    )
    job = finish(plane, handle)
    event = last_state_event(plane, job.id)
    assert (
        "final accuracy 0.8750, eval loss 1.832; its best evaluation by eval loss was step 474 "
        "(eval loss 1.221, accuracy 0.5790)" in event.message
    ), event.message
