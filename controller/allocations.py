"""GPU reservations: never more than a cluster offers, even with several controllers.

Each reservation is one conditional UPDATE (`in_use + n <= allocatable`), which PostgreSQL
and SQLite both apply atomically per row, so two controllers can never both take the last GPUs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from controller.errors import Conflict
from controller.models import Allocation, Cluster, GpuInventory, Job, utcnow


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
            select(GpuInventory.id, Cluster.id)
            .join(Cluster, Cluster.id == GpuInventory.cluster_id)
            .where(Cluster.name == slot.cluster, GpuInventory.model == slot.gpu_model)
        ).first()
        if row is None:
            raise Conflict(
                f"cluster {slot.cluster!r} has no {slot.gpu_model} GPUs", field="placement"
            )
        inv_id, cluster_id = row
        result = session.execute(
            update(GpuInventory)
            .where(
                GpuInventory.id == inv_id,
                GpuInventory.in_use + slot.gpus <= GpuInventory.allocatable,
            )
            .values(in_use=GpuInventory.in_use + slot.gpus)
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


def release(session: Session, job: Job) -> int:
    """End the job's open allocations and give their GPUs back; returns GPUs released."""
    now = utcnow()
    released = 0
    open_allocs = session.scalars(
        select(Allocation).where(Allocation.job_id == job.id, Allocation.ended_at.is_(None))
    ).all()
    for alloc in open_allocs:
        session.execute(
            update(GpuInventory)
            .where(
                GpuInventory.cluster_id == alloc.cluster_id, GpuInventory.model == alloc.gpu_model
            )
            .values(in_use=GpuInventory.in_use - alloc.gpus)
            .execution_options(synchronize_session=False)
        )
        alloc.ended_at = now
        released += alloc.gpus
    session.flush()
    return released
