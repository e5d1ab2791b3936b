"""A pipeline (or hybrid) job that lost a cluster: only the stages there move, and it resumes.

`controller.loop.policy.replace_stages` decides, purely; this module reads what it decides on and
applies the decision inside the settlement's transaction (`controller.loop.settle`):

- the spares: free GPUs per cluster and one GPU's usable memory, from the snapshot the
  reconcile loop plans on (`build_world`: schedulable, priced, known GPU models), read before
  the job's GPUs go back, so the stages that stay keep theirs and only the moved ones count;
- each stage's memory (`policy.stage_needs`) over the job's parameters split evenly across its
  stages: the control plane knows a task's parameters, not its layers (the plan's memory
  verdict, `controller.values.plan.parallel_of`, is made the same way);
- then the books: the run's allocations end as every run's do (`lifecycle.end_run`), the new
  stages' GPUs are reserved under one savepoint by the placements' conditional UPDATE (never
  over-committed: a lost race leaves the job RESCHEDULING for the reconcile loop), and the job
  goes RESCHEDULING (the reason names each moved stage) -> SCHEDULED with the new stages in
  its plan. This replica's loop launches it; the driver resumes from the newest step every
  stage saved (`training.pipeline.checkpoint`), same stages, same split, new clusters.

A stage that fits no cluster left queues the job (PENDING) until GPUs free up.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

import scheduler
from controller.jobs import lifecycle
from controller.jobs.request import spec_of
from controller.loop.policy import Spare, StageReplacement, replace_stages, stage_needs
from controller.money import budget
from controller.network.allocations import Slot, reserve
from controller.network.snapshot import build_world
from controller.store.models import REASON_MAX, Allocation, Cluster, Job, bounded, utcnow
from controller.values.errors import Conflict
from controller.values.plan import as_billed, micro_batches_of, pipeline_estimate, wan_kbps
from controller.values.tasks import builtin_work
from grammar.states import JobState
from scheduler.memory import Layer, ModelProfile, gpu_memory_bytes
from wire.plan import JobPlan, Share, StageShare


@dataclass(frozen=True)
class Restage:
    """The policy's answer and what applying it takes."""

    replacement: StageReplacement
    plan: JobPlan | None
    """The job's plan with its new stages, shares and estimate; None when it requeues."""
    slots: tuple[Slot, ...] = ()


def even_profile(params: int, stages: int) -> ModelProfile:
    """The job's model as `stages` pieces of equal parameters (no activations known)."""
    share, extra = divmod(params, stages)
    return ModelProfile(
        tuple(
            Layer(f"stage{i}", share + (1 if i < extra else 0), 0.0, 0.0, 0.0)
            for i in range(stages)
        )
    )


def decide(session: Session, job: Job, down: str) -> Restage | None:
    """Where the stages of `job` on `down` go; None when the job is not a pipeline or hybrid
    of stages inside their clusters (the settlement then queues it to be placed again whole,
    its stage count kept)."""
    plan = job.placement
    if plan is None or plan.parallel.mode == "data" or not plan.parallel.stages:
        return None
    if plan.parallel.stages[0].replica_clusters:  # whole pipelines: placed again, stages kept
        return None
    spec = spec_of(job)
    par = plan.parallel
    held = dict(
        session.execute(
            select(Cluster.name, Allocation.gpu_model)
            .join(Cluster, Cluster.id == Allocation.cluster_id)
            .where(Allocation.job_id == job.id, Allocation.ended_at.is_(None))
        ).all()
    )
    world = build_world(session, job.qos_class)
    options: dict[str, list[scheduler.Cluster]] = {}
    for c in world.snapshot.clusters:
        if c.schedulable:
            options.setdefault(world.origins[c.name][0], []).append(c)
    spares: list[Spare] = []
    model: dict[str, str] = dict(held)
    for name, found in options.items():
        # the GPU model the job holds there already, else the one with the most free GPUs
        pick = next((c for c in found if world.origins[c.name][1] == held.get(name)), None)
        pick = pick or max(found, key=lambda c: (c.gpus_free, c.name))
        try:
            gpu_bytes = gpu_memory_bytes(pick)
        except ValueError:  # a GPU model of unknown memory: no stage is moved onto it
            continue
        spares.append(Spare(name, pick.gpus_free, gpu_bytes))
        model.setdefault(name, world.origins[pick.name][1])
    s_count, replicas = len(par.stages), par.stages[0].replicas
    width = replicas * par.tensor  # a stage's GPUs (its memory counted unsplit: the safe side)
    params = spec.work.params if spec.work is not None else builtin_work(spec.task).params
    needs = stage_needs(
        even_profile(params, s_count),
        tuple(range(1, s_count)),
        tuple(s.cluster for s in par.stages),
        width,
        micro_batches_of(par, spec),
        1,
    )
    got = replace_stages(needs, down, spares)
    if got.stages is None:
        return Restage(got, None)
    gpus: dict[str, int] = {}
    for where in got.stages:
        gpus[where] = gpus.get(where, 0) + width
    shares = tuple(Share(cluster=c, gpus=n, gpu_model=model[c]) for c, n in gpus.items())
    gb = dict(par.gpu_gb)
    for s in spares:
        gb.setdefault(s.cluster, round(s.gpu_bytes / 1e9, 3))
    parallel = par.model_copy(
        update={
            "stages": tuple(StageShare(cluster=c, replicas=replicas) for c in got.stages),
            "gpu_gb": {c: gb[c] for c in gpus if c in gb},
            "micro_batches": micro_batches_of(par, spec),
            "micro_overhead_s": world.snapshot.micro_overhead_s,
        }
    )
    new = plan.model_copy(
        update={
            "clusters": shares,
            "parallel": parallel,
            "explanation": (*plan.explanation, got.reason),
        }
    )
    staged = pipeline_estimate(spec, parallel, shares, world.snapshot, world.origins, job.qos_class)
    if staged is not None:
        estimate, price, why = staged
        new = new.model_copy(
            update={"estimate": estimate, "price": price, "explanation": (*new.explanation, why)}
        )
    if new.price is None:  # a plan stored before prices were kept: its WAN rates alone
        new = new.model_copy(update={"wan_kbps": wan_kbps(new.estimate, shares)})
    else:
        estimate, price, reserved = as_billed(
            new.estimate, new.price, shares, world.snapshot, world.origins
        )
        new = new.model_copy(update={"estimate": estimate, "price": price, "wan_kbps": reserved})
    slots = tuple(Slot(s.cluster, s.gpu_model or "", s.gpus) for s in shares)
    return Restage(got, new, slots)


def apply(session: Session, job: Job, restage: Restage, down: str) -> None:
    """Move the job as `restage` says, its run's GPUs already given back (`end_run`)."""
    got = restage.replacement
    reason = f"cluster {down} is DOWN; {got.reason}"
    step = {"step": job.checkpoint_step}
    if restage.plan is None:
        lifecycle.transition(session, job, got.state, reason, **step)
        return
    stages = [s.cluster for s in restage.plan.parallel.stages]
    lifecycle.transition(session, job, JobState.RESCHEDULING, reason, stages=stages, **step)
    refused = _over_budget(session, job, restage.plan)
    if refused is not None:
        job.reason = bounded(f"waiting: {refused}", REASON_MAX)
        return
    try:
        with session.begin_nested():  # the new stages' GPUs and the state change, or neither
            reserve(session, job, restage.slots, restage.plan.wan_kbps)
            budget.hold(session, job, restage.plan)
            job.placement = restage.plan
            lifecycle.transition(
                session,
                job,
                JobState.SCHEDULED,
                "placed: " + ", ".join(f"{s.cluster}:{s.gpus}" for s in restage.slots),
                placement=restage.plan.model_dump(mode="json", exclude_computed_fields=True),
            )
    except Conflict as exc:  # another placement took the spare GPUs: the reconcile loop places it
        job.reason = bounded(f"waiting: {exc.detail}", REASON_MAX)


def _over_budget(session: Session, job: Job, plan: JobPlan) -> str | None:
    """Why the tenant's budget refuses the re-placed plan, as a placement's check would."""
    terms = budget.lock_terms(session, job.tenant_id)
    if terms.budget is None:
        return None
    committed = budget.commitment(session, job.tenant_id, utcnow())
    return budget.refusal(terms.budget, committed, budget.estimate_of(plan))
