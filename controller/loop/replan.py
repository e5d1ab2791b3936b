"""A running job's plan after a datacenter left or joined it (`training.faults`).

The run goes on with the same decisions (sync, compression, parallelism); what changes is
where it runs, so the planner's estimate is made again for the GPUs it holds now, with the
job's own GPUs counted free, and stored as the job's plan: what the API shows is what runs.
The run is told the new plan's ring order, links, reservations and batch shares
(`RunHandle.want`), so a newcomer runs on its planned links, not a default. Re-estimating
is `scheduler.evaluate` over today's snapshot, the call a held quote is placed with.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

import scheduler
from controller.jobs.request import job_request, spec_of
from controller.network.allocations import Slot
from controller.network.snapshot import World, build_world
from controller.store.models import Allocation, Cluster, Job
from controller.values.plan import plan_of
from wire.plan import JobPlan


@dataclass(frozen=True)
class Replanned:
    """The job's plan on its new clusters, or why it cannot run there (`refused`)."""

    plan: JobPlan | None
    note: str
    refused: bool = False


def held_slots(session: Session, job_id: str) -> list[Slot]:
    """The job's open allocations, as slots."""
    rows = session.execute(
        select(Cluster.name, Allocation.gpu_model, Allocation.gpus)
        .join(Cluster, Cluster.id == Allocation.cluster_id)
        .where(Allocation.job_id == job_id, Allocation.ended_at.is_(None))
        .order_by(Cluster.name)
    ).all()
    return [Slot(name, model, gpus) for name, model, gpus in rows]


def replan(
    session: Session,
    job: Job,
    slots: Sequence[Slot],
    efficiency: Mapping[str, float] | None,
    now: datetime,
    remaining_steps: int,
    world: World | None = None,
) -> Replanned | None:
    """The job's plan on `slots` with its decisions kept, and the line that says what
    changed; `refused` when the job cannot run there (a local-data job on a cluster without
    its data). None when there is nothing to re-estimate (no plan, a pipeline, a cluster
    the snapshot does not price now): the run goes on under its old plan. `world`: the
    network as read in this transaction, when the caller weighs several `slots`."""
    old = job.placement
    if old is None or old.parallel.mode != "data" or not slots:
        return None
    spec = spec_of(job)
    world = world or build_world(session, job.qos_class, now)
    names = {origin: name for name, origin in world.origins.items()}
    own: dict[str, int] = {}
    for s in held_slots(session, job.id):
        name = names.get((s.cluster, s.gpu_model))
        if name is not None:
            own[name] = own.get(name, 0) + s.gpus
    others = tuple(r for r in world.snapshot.running if r.id != job.id)
    snapshot = world.snapshot.with_free(own, others)
    placement = []
    for s in slots:
        name = names.get((s.cluster, s.gpu_model))
        if name is None:
            return None
        placement.append(scheduler.Assignment(name, s.gpus))
    request = job_request(spec, job.tenant_id, now)
    # the decisions stay as they run, on the GPUs it has now; the estimate is what is asked
    # (a deadline or budget the new placement misses is the note's to say, not a reason to
    # stop the run)
    gpus = sum(s.gpus for s in slots)
    request = replace(
        request,
        min_gpus=gpus,
        max_gpus=gpus,
        compression=str(old.compression),
        sync=str(old.sync),
        qos=replace(request.qos, deadline_s=None, max_cost=None),
    )
    objective = old.objective or "time"
    result = scheduler.evaluate(
        snapshot, request, placement, objective=objective, efficiency=efficiency
    )
    if isinstance(result, scheduler.Infeasible):
        if result.constraint == "data":
            return Replanned(None, result.reason, refused=True)
        if result.closest is None:
            return None
        result = result.closest
    new = plan_of(result, snapshot, world.origins, job.qos_class, spec, paced=world.paced)
    return Replanned(new, _note(old, new, remaining_steps))


def _note(old: JobPlan, new: JobPlan, remaining: int) -> str:
    where = ", ".join(f"{s.cluster}:{s.gpus}" for s in new.clusters)
    was, now = old.estimate, new.estimate
    return (
        f"plan updated: {new.sync} with {new.compression} on {where}; a step takes "
        f"{now.step_time_s:.3g} s (planned {was.step_time_s:.3g} s), so the {remaining} "
        f"steps left take about {now.step_time_s * remaining:.0f} s; the whole job on these "
        f"clusters is estimated at {now.total_time_s:.0f} s and ${now.cost or 0:.4f} "
        f"(was {was.total_time_s:.0f} s and ${was.cost or 0:.4f})"
    )
