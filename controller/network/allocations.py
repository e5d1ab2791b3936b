"""GPU reservations: never more than a cluster offers, even with several controllers.

The invariant, for every (cluster, GPU model): `in_use` = the GPUs of its open allocations,
never negative, never above what was allocatable when reserved. Each reservation is one
conditional UPDATE (`in_use + n <= allocatable`), which PostgreSQL and SQLite both apply
atomically per row, so two controllers can never both take the last GPUs. Each release first
closes its allocation with a conditional UPDATE (`ended_at IS NULL`), so of two concurrent
releases of one allocation (a cancel and a settlement) exactly one gives its GPUs back.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from controller.store.models import Allocation, Cluster, ClusterGpus, Job, utcnow
from controller.values.errors import Conflict

log = logging.getLogger("cpn.allocations")


@dataclass(frozen=True)
class Slot:
    """`gpus` GPUs of `gpu_model` in cluster `cluster`."""

    cluster: str
    gpu_model: str
    gpus: int


def reserve(session: Session, job: Job, slots: Sequence[Slot]) -> list[Allocation]:
    """Reserve every slot or none (the caller's transaction rolls back on Conflict)."""
    now = utcnow()
    made = []
    for slot in slots:
        row = session.execute(
            select(ClusterGpus.id, Cluster.id)
            .join(Cluster, Cluster.id == ClusterGpus.cluster_id)
            .where(Cluster.name == slot.cluster, ClusterGpus.model == slot.gpu_model)
        ).first()
        if row is None:
            raise Conflict(
                f"cluster {slot.cluster!r} has no {slot.gpu_model} GPUs", field="placement"
            )
        inv_id, cluster_id = row
        result = session.execute(
            update(ClusterGpus)
            .where(
                ClusterGpus.id == inv_id,
                ClusterGpus.in_use + slot.gpus <= ClusterGpus.allocatable,
            )
            .values(in_use=ClusterGpus.in_use + slot.gpus)
            .execution_options(synchronize_session=False)
        )
        if result.rowcount != 1:  # type: ignore[attr-defined]
            raise Conflict(
                f"cluster {slot.cluster!r} no longer has {slot.gpus} free {slot.gpu_model} GPUs",
                field="placement",
            )
        alloc = Allocation(
            job_id=job.id,
            cluster_id=cluster_id,
            gpu_model=slot.gpu_model,
            gpus=slot.gpus,
            qos_class=job.qos_class,
            started_at=now,
        )
        session.add(alloc)
        made.append(alloc)
    session.flush()
    return made


def release(session: Session, job: Job, until: datetime | None = None) -> int:
    """End the job's open allocations and give their GPUs back; returns GPUs released.

    Idempotent per allocation: one closed by a concurrent release is skipped, never released
    twice. A missing inventory row (its model no longer reported) goes once nothing holds it.
    `until`: when the run's workers stopped, recorded as the allocations' end (what billing
    reads) when it is earlier than now.
    """
    now = min(until, utcnow()) if until is not None else utcnow()
    released = 0
    open_allocs = session.scalars(
        select(Allocation).where(Allocation.job_id == job.id, Allocation.ended_at.is_(None))
    ).all()
    for alloc in open_allocs:
        closed = session.execute(
            update(Allocation)
            .where(Allocation.id == alloc.id, Allocation.ended_at.is_(None))
            .values(ended_at=now)
            .execution_options(synchronize_session=False)
        )
        if closed.rowcount != 1:  # type: ignore[attr-defined]
            session.refresh(alloc)  # another release got there first; take its end time
            continue
        set_committed_value(alloc, "ended_at", now)
        _give_back(session, alloc)
        released += alloc.gpus
    session.flush()
    return released


def _give_back(session: Session, alloc: Allocation) -> None:
    """Return an allocation's GPUs to its inventory row; never below zero."""
    row = (ClusterGpus.cluster_id == alloc.cluster_id) & (ClusterGpus.model == alloc.gpu_model)
    result = session.execute(
        update(ClusterGpus)
        .where(row, ClusterGpus.in_use >= alloc.gpus)
        .values(in_use=ClusterGpus.in_use - alloc.gpus)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        # The books were already wrong (a row written before the invariant was kept): say so
        # loudly, and keep the row within its constraints rather than fail the settlement.
        log.error(
            "allocation %s returns %d %s GPUs that cluster %s does not count as in use",
            alloc.id,
            alloc.gpus,
            alloc.gpu_model,
            alloc.cluster_id,
        )
        session.execute(
            update(ClusterGpus)
            .where(row)
            .values(in_use=0)
            .execution_options(synchronize_session=False)
        )
    session.execute(
        delete(ClusterGpus)
        .where(row, ClusterGpus.missing.is_(True), ClusterGpus.in_use == 0)
        .execution_options(synchronize_session=False)
    )
