"""Integrity of the books under what used to break them, on SQLite and PostgreSQL.

Releases are idempotent per allocation, even when two race; the database refuses a write that
breaks the GPU invariant; step and byte counters are 64-bit; over-long state messages are cut,
never refused; a bad cluster label already stored is skipped by the planner, never fatal.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal

import pytest
from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from agents.protocol import GpuInventory as GpuReport
from agents.protocol import Heartbeat
from controller.jobs import lifecycle
from controller.loop import progress
from controller.loop.runs import RunHandle
from controller.network.allocations import Slot, release, reserve
from controller.network.labels import check_labels
from controller.network.leases import LeasePolicy
from controller.network.resources import create_cluster, ingest_heartbeat
from controller.network.snapshot import build_world
from controller.store.db import make_engine, make_sessionmaker
from controller.store.models import (
    ELLIPSIS,
    MESSAGE_MAX,
    REASON_MAX,
    Allocation,
    Cluster,
    ClusterGpus,
    GpuPrice,
    Job,
    JobEvent,
    JobMetric,
    Tenant,
    Usage,
    utcnow,
)
from controller.values.errors import Invalid
from grammar.states import JobState
from training import Progress, WanBytes

LEASES = LeasePolicy(heartbeat_interval_s=1.0, grace_s=10.0)
SPEC = {"name": "j", "task": "builtin:mnist1d-mlp", "gpus": 4, "steps": 100}
BIG = 3 * 2**31  # past what a 32-bit column holds


@dataclass
class Plane:
    sessions: sessionmaker[Session]
    job_id: str


@pytest.fixture
def plane(db_url: str) -> Iterator[Plane]:
    """Cluster `east` with 8 priced A100s (READY by a heartbeat), a tenant and a job."""
    engine = make_engine(db_url)
    sessions = make_sessionmaker(engine)
    with sessions() as s, s.begin():
        cluster = create_cluster(s, "east", "us", {})
        s.add(
            GpuPrice(
                cluster_id=cluster.id,
                gpu_model="A100",
                qos_class="standard",
                price_per_gpu_hour=Decimal("2.5"),
                effective_from=utcnow() - timedelta(hours=1),
            )
        )
        tenant = Tenant(name="acme")
        s.add(tenant)
        s.flush()
        job = Job(tenant_id=tenant.id, name="j", spec=SPEC, gpus_min=4, gpus_max=4)
        s.add(job)
        s.flush()
        job_id = job.id
    beat(sessions, GpuReport(model="A100", memory_gib=80, count=8, allocatable=8))
    yield Plane(sessions, job_id)
    engine.dispose()


def beat(sessions: sessionmaker[Session], *gpus: GpuReport) -> None:
    with sessions() as s, s.begin():
        ingest_heartbeat(s, Heartbeat(cluster="east", gpus=list(gpus)), LEASES)


def row(sessions: sessionmaker[Session], model: str = "A100") -> ClusterGpus | None:
    with sessions() as s:
        return s.scalars(select(ClusterGpus).where(ClusterGpus.model == model)).first()


def schedule(plane: Plane, gpus: int = 4) -> None:
    with plane.sessions() as s, s.begin():
        job = s.get(Job, plane.job_id)
        assert job is not None
        reserve(s, job, [Slot("east", "A100", gpus)])
        lifecycle.transition(s, job, JobState.SCHEDULED, "placed")


def test_a_model_that_vanishes_while_in_use_is_kept_until_its_jobs_end(plane: Plane) -> None:
    schedule(plane)
    beat(plane.sessions)  # the agent stops reporting the A100s
    kept = row(plane.sessions)
    assert kept is not None and kept.missing
    assert (kept.in_use, kept.allocatable, kept.count) == (4, 0, 4)
    beat(plane.sessions, GpuReport(model="A100", memory_gib=80, count=8, allocatable=8))
    back = row(plane.sessions)
    assert back is not None and not back.missing
    assert (back.in_use, back.allocatable, back.count) == (4, 8, 8)  # not a fresh 0 in use
    beat(plane.sessions)  # gone again, then the job ends: the row goes with its last GPU
    with plane.sessions() as s, s.begin():
        job = s.get(Job, plane.job_id)
        assert job is not None
        lifecycle.transition(s, job, JobState.CANCELLED, "cancelled")
        lifecycle.end_run(s, job)
    assert row(plane.sessions) is None


def test_a_shrunk_model_keeps_counting_the_gpus_in_use(plane: Plane) -> None:
    schedule(plane, gpus=6)
    beat(plane.sessions, GpuReport(model="A100", memory_gib=80, count=2, allocatable=2))
    shrunk = row(plane.sessions)
    assert shrunk is not None and (shrunk.in_use, shrunk.allocatable, shrunk.count) == (6, 2, 6)
    with plane.sessions() as s, s.begin():
        job = s.get(Job, plane.job_id)
        assert job is not None
        lifecycle.transition(s, job, JobState.CANCELLED, "cancelled")
        lifecycle.end_run(s, job)
    beat(plane.sessions, GpuReport(model="A100", memory_gib=80, count=2, allocatable=2))
    after = row(plane.sessions)
    assert after is not None and (after.in_use, after.allocatable, after.count) == (0, 2, 2)


def test_two_racing_releases_give_the_gpus_back_once(plane: Plane) -> None:
    schedule(plane)
    barrier = threading.Barrier(2)
    released: list[int] = []
    errors: list[BaseException] = []

    def settle_once() -> None:
        """A settlement or a cancel: both read the job's allocations open, then release."""
        try:
            with plane.sessions() as s, s.begin():
                job = s.get(Job, plane.job_id)
                assert job is not None
                assert s.scalars(select(Allocation).where(Allocation.job_id == job.id)).all()
                barrier.wait()
                released.append(release(s, job))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=settle_once) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(released) == [0, 4]
    again = row(plane.sessions)
    assert again is not None and again.in_use == 0
    with plane.sessions() as s, s.begin():  # and a third, later, finds nothing to give back
        job = s.get(Job, plane.job_id)
        assert job is not None
        lifecycle.end_run(s, job)
    last = row(plane.sessions)
    assert last is not None and last.in_use == 0


@pytest.mark.parametrize(
    "values",
    [{"in_use": -1}, {"in_use": 9}, {"allocatable": -1}, {"allocatable": 9}],
    ids=["negative", "above-count", "negative-allocatable", "allocatable-above-count"],
)
def test_the_database_refuses_books_that_do_not_balance(
    plane: Plane, values: dict[str, int]
) -> None:
    with pytest.raises(IntegrityError), plane.sessions() as s, s.begin():
        s.execute(update(ClusterGpus).values(**values))
    kept = row(plane.sessions)
    assert kept is not None and (kept.in_use, kept.allocatable, kept.count) == (0, 8, 8)


def test_counters_past_32_bits_are_stored(plane: Plane) -> None:
    schedule(plane)
    handle = RunHandle(
        job_id=plane.job_id,
        clusters={"east": 4},
        gpu_models={"east": "A100"},
        flops_per_step=1e9,
        predicted_step_s=None,
    )
    handle.on_progress(
        Progress(
            step=BIG,
            total_steps=BIG,
            loss=0.5,
            accuracy=None,
            wall_s=10.0,
            compute_s=5.0,
            comm_s=1.0,
            wan_bytes=WanBytes({("east", "west"): BIG}),
            wan_bytes_total=BIG,
            compression_ratio=1.0,
            compression="none",
        )
    )
    progress.flush(plane.sessions, handle)
    with plane.sessions() as s:
        metric = s.scalars(select(JobMetric)).one()
        job = s.get(Job, plane.job_id)
        usage = s.scalars(select(Usage).where(Usage.kind == "wan_bytes")).one()
    assert (metric.step, metric.wan_bytes) == (BIG, BIG)
    assert job is not None and job.checkpoint_step == BIG
    assert usage.quantity == Decimal(BIG)


def test_over_long_state_messages_are_cut_not_refused(plane: Plane) -> None:
    reason = "waiting: " + "x" * 10_000
    with plane.sessions() as s, s.begin():
        job = s.get(Job, plane.job_id)
        assert job is not None
        lifecycle.transition(s, job, JobState.FAILED, reason)
    with plane.sessions() as s:
        job = s.get(Job, plane.job_id)
        event = s.scalars(select(JobEvent).order_by(JobEvent.id.desc())).first()
    assert job is not None and event is not None
    assert len(job.reason) == REASON_MAX and job.reason.endswith(ELLIPSIS)
    assert job.reason.startswith("waiting: xxx")
    assert len(event.message) == MESSAGE_MAX and event.message.endswith(ELLIPSIS)


def test_labels_are_checked_when_written() -> None:
    check_labels({"intra_bandwidth_gbps": "400", "gpu_tflops": "312.5", "team": "ml"})
    for key, value in (
        ("intra_bandwidth_gbps", "fast"),
        ("intra_bandwidth_gbps", "0"),
        ("intra_bandwidth_gbps", "nan"),
        ("gpu_tflops", "-1"),
        ("gpu_tflops", "1e300"),
    ):
        with pytest.raises(Invalid) as exc:
            check_labels({key: value})
        assert exc.value.field == f"labels.{key}" and repr(value) in exc.value.detail


def test_a_bad_stored_label_is_skipped_not_fatal(
    plane: Plane, caplog: pytest.LogCaptureFixture
) -> None:
    fast = f"fast-{uuid.uuid4().hex[:6]}"  # each bad value is logged once per process
    with plane.sessions() as s, s.begin():  # written before labels were checked
        s.execute(update(Cluster).values(labels={"intra_bandwidth_gbps": fast, "gpu_tflops": "?"}))
    with caplog.at_level(logging.WARNING, logger="cpn.labels"), plane.sessions() as s:
        world = build_world(s, "standard")
    (cluster,) = world.snapshot.clusters
    assert cluster.intra_bandwidth_gbps == 100.0 and cluster.gpu_tflops is None
    assert "intra_bandwidth_gbps" in caplog.text and "PATCH /v1/clusters/east" in caplog.text
