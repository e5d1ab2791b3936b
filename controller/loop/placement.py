"""The reconcile loop's placement step: PENDING jobs -> GPUs reserved -> SCHEDULED.

Takes pending jobs in priority order with fair share between tenants, plans each over a fresh
snapshot, and reserves its GPUs in the same transaction as the state change. The job row is
locked with SELECT ... FOR UPDATE SKIP LOCKED, so several replicas on PostgreSQL never place
the same job twice; each GPU reservation is a conditional UPDATE, so they never hand out more
GPUs than a cluster has. The tenant's budget is checked in that same transaction, its row
locked (`controller.money.budget`), so concurrent placements are counted once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Set
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from itertools import islice

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

import scheduler
from controller.access.tenancy import granted, granted_priority
from controller.jobs import lifecycle
from controller.jobs.request import job_request, spec_of
from controller.money import budget
from controller.network.allocations import Slot, bursts, ports, reserve
from controller.network.snapshot import Calibration, World, build_world, free_ports
from controller.store import failpoints
from controller.store.models import REASON_MAX, Job, JobEvent, Tenant, bounded, utcnow
from controller.values.errors import Conflict, CpnError, Invalid
from controller.values.plan import plan_of
from grammar.states import ACTIVE, QUEUED, JobState
from scheduler.bandwidth import BURST_TOLERANCE, burst_slowdown, port_gbps
from wire.plan import JobPlan

log = logging.getLogger("cpn.reconcile")


@dataclass(frozen=True)
class Placed:
    job_id: str
    placement: JobPlan
    waited_s: float = 0.0
    """From submission to GPUs reserved: what the tenant waited for a placement."""
    decided_s: float = 0.0
    """This placement's own work: planning, budget check and reservation."""


Shares = tuple[dict[str, int], tuple[int, int]]
"""Each tenant's reserved rate on declared uplinks (kbit/s); all GPUs and all uplinks."""


def _queue(
    session: Session,
) -> tuple[list[scheduler.QueuedJob], dict[str, int], dict[str, int], World | None, Shares]:
    """The pending jobs, GPUs per tenant and quotas, the standard class's world they were
    read from (the pass places its first jobs on it rather than read the world again), and
    the WAN side of fair share (`_shares`)."""
    rows = session.execute(
        select(
            Job.id,
            Job.tenant_id,
            Job.gpus_min,
            granted_priority(),
            Job.created_at,
            Job.qos_class,
            Job.run_s,
        )
        .join(Tenant, Tenant.id == Job.tenant_id)
        .where(Job.state.in_(QUEUED))
    ).all()
    queue = [
        scheduler.QueuedJob(
            id=i, tenant=t, gpus=g, priority=p, submitted_at=c.timestamp(), qos_class=q, run_s=r
        )
        for i, t, g, p, c, q, r in rows
    ]
    if not queue:
        return [], {}, {}, None, ({}, (0, 0))
    world = build_world(session, "standard")
    usage = scheduler.tenant_usage(world.snapshot.running)
    # no declared port, no bandwidth to share: skip the read (most networks, every pass)
    shares = _shares(session, world) if world.ports else ({}, (0, 0))
    return queue, dict(usage), dict(world.snapshot.quotas), world, shares


def _shares(session: Session, world: World) -> Shares:
    """What fair share weighs beside GPUs: each tenant's reserved rate on the declared
    uplinks (kbit/s), and the totals (all GPUs, all declared uplinks' capacity)."""
    wan: dict[str, int] = {}
    capacity = 0
    for port in ports(session):
        if port.direction != "up" or port.capacity_kbps is None:
            continue
        capacity += port.capacity_kbps
        for h in port.holders:
            wan[h.tenant_id] = wan.get(h.tenant_id, 0) + h.kbps
    gpus = sum(c.gpus_free for c in world.snapshot.clusters) + sum(
        a.gpus for r in world.snapshot.running for a in r.placement
    )
    return wan, (gpus, capacity)


def plan_for(
    world: World,
    job: Job,
    efficiency: Mapping[str, float] | None,
    now: datetime,
    priority: int | None = None,
    *,
    max_cost: float | None = None,
) -> scheduler.PlanResult:
    """The held quote's placement when still possible, else the planner's best; `priority`:
    what the job counts as (its tenant's grant), when less than its spec asks; `max_cost`:
    the cheapest plan within that (what is left of the tenant's budget) instead."""
    request = job_request(spec_of(job), job.tenant_id, now)
    if priority is not None:
        request = replace(request, qos=replace(request.qos, priority=priority))
    if max_cost is not None:
        own = request.qos.max_cost
        limit = max_cost if own is None else min(own, max_cost)
        request = replace(request, qos=replace(request.qos, max_cost=limit))
        return scheduler.plan(
            world.snapshot, request, "cost", efficiency=efficiency, release=world.release
        )
    if job.held_price:
        # a held quote is the plan that runs: its placement and its decisions, re-estimated
        # on today's snapshot, never re-decided (calibration may have moved since the quote)
        quoted = job.held_price
        fixed = replace(request, compression=str(quoted.compression), sync=str(quoted.sync))
        held = quoted.assignments(world.origins)
        result = scheduler.evaluate(world.snapshot, fixed, held, efficiency=efficiency)
        if isinstance(result, scheduler.Plan):
            return result
    return scheduler.plan(
        world.snapshot,
        request,
        objective_for(request),
        efficiency=efficiency,
        release=world.release,
    )


def objective_for(request: scheduler.JobRequest) -> scheduler.Objective:
    """What the loop optimises a job for: cheapest within its deadline when it has one, else
    fastest (a pure decision: `bench.sim` replays it)."""
    return "cost-within-deadline" if request.qos.deadline_s is not None else "time"


GROUP_MAX = 16
"""Most placements committed together (see `place_pending`)."""


def place_pending(
    factory: sessionmaker[Session],
    owner: str,
    calibration: Calibration | None = None,
    limit: int = 64,
    *,
    waits: dict[str, scheduler.Wait] | None = None,
) -> list[Placed]:
    """One pass over the queue; returns the jobs it placed.

    The world is read once per QoS class and pass, and kept current in memory as this pass
    reserves GPUs; what other replicas reserve meanwhile is caught by the conditional update
    in `reserve`, which turns into a waiting reason, never an over-commitment.

    A pass tries `limit` jobs, and more while it has spent less time placing than reading the
    queue and the world: with thousands of clusters and pending jobs that read is most of a
    64-job pass, so the pass grows until the read is at most half of it.

    Placements are committed in groups of 1, 2, 4, ... up to `GROUP_MAX` jobs: one commit
    (a WAL sync) per job was most of a placement's cost. A job's writes (its reservation and
    state change) are made under one savepoint, so a lost reservation race rolls back that
    job alone, and a job that cannot be placed (an invalid spec) is failed in the group's
    transaction; the first group of a pass is one job, so a lone job is committed and handed
    to the launcher as soon as it is placed.

    `waits` (kept by the caller between passes): job id -> the GPUs it chose to wait for
    (`scheduler.waiting`). Until they are due, or free sooner, a pass neither plans it nor
    counts it against its limit: planning a waiting job again at every pass, with GPUs left
    free for it, was most of a pass's work under load (`bench.sim`). Losing the map costs
    only replanning.
    """
    started = time.perf_counter()
    now_s = utcnow().timestamp()
    if waits is not None:  # forget the waits that are due
        for job_id in [j for j, w in waits.items() if w.at_s <= now_s]:
            del waits[job_id]
    with factory() as session:
        queue, usage, quotas, standard, (wan, totals) = _queue(session)
    order = scheduler.order_queue(
        queue, usage=usage, quotas=quotas, now=now_s, wan=wan, totals=totals if wan else None
    )
    read_s = time.perf_counter() - started
    held = {q.id: reason for q, reason in order.held}
    placed: list[Placed] = []
    worlds: dict[str, World] = {"standard": standard} if standard is not None else {}
    placing = time.perf_counter()
    todo = iter(order.order)
    tried, group, done = 0, 1, False
    blocked: dict[tuple[str, int], int] = {}  # see `_place_one`
    noted = 0
    while not done:
        batch: list[Placed] = []
        terms: dict[str, budget.Terms] = {}  # tenants locked by this group's transaction
        chunk = list(islice(todo, group))
        with factory() as session, session.begin():
            # The group's tenants are locked first, in one order: a run's end locks its
            # tenant and then its GPUs, so a group holding GPUs while it waited for a tenant
            # could deadlock with it (and with another replica's group) on PostgreSQL.
            for tenant_id in sorted({q.tenant for q in chunk}):
                terms[tenant_id] = budget.lock_terms(session, tenant_id)
            for queued in (*chunk, None):
                if queued is None or (tried >= limit and time.perf_counter() - placing >= read_s):
                    done = queued is not None or len(chunk) < group
                    break
                if queued.gpus >= blocked.get((queued.qos_class, queued.priority), queued.gpus + 1):
                    # cannot fit this pass either: not planned, not counted as tried; its
                    # reason kept current as a tried job's is, for as many as the pass tries
                    if noted < limit:
                        noted += 1
                        _still_waiting(session, queued.id, queued.gpus)
                    continue
                wait = None if waits is None else waits.get(queued.id)
                seen = worlds.get("standard")  # the pass's world, kept current as it places
                if wait is not None and seen is not None and wait.pending(seen.snapshot, now_s):
                    continue  # waiting for GPUs not back yet: its reason stands
                tried += 1
                try:
                    result = _place_one(
                        session, queued.id, owner, calibration, worlds, terms, blocked, waits
                    )
                except CpnError as exc:  # a spec that stopped being valid (e.g. deadline passed)
                    _fail(session, queued.id, exc.detail)
                    continue
                if result is not None:
                    batch.append(result)
            if batch:
                failpoints.failpoint("place.before_commit")  # GPUs reserved, not committed
        for result in batch:
            placed.append(result)
            failpoints.failpoint("place.after_commit")  # committed, not launched
        group = min(group * 2, GROUP_MAX)
    for job_id, reason in held.items():
        _note(factory, job_id, f"waiting: {reason}")
    return placed


def _place_one(
    session: Session,
    job_id: str,
    owner: str,
    calibration: Calibration | None,
    worlds: dict[str, World],
    terms: dict[str, budget.Terms],
    blocked: dict[tuple[str, int], int],
    waits: dict[str, scheduler.Wait] | None = None,
) -> Placed | None:
    """Place one job in the caller's transaction, or leave why it waits. Raises CpnError only
    before the job's writes (its reservation and state change, made under one savepoint).

    `blocked[(class, priority)]`: the fewest GPUs that no set of linked clusters had free (or
    could free by preemption) for a job of that class and priority with no limits of its own
    (regions, data residency, cluster cap) in this pass. A pass only takes GPUs, and a job
    later in the order has at most that priority and at most that freedom, so it cannot fit
    with as many; the pass skips it without counting it against its limit. Otherwise a queue
    headed by `limit` jobs too large to place (which the response-ratio order puts first: a
    large gang has the least work per GPU) stopped every pass before the jobs that fit."""
    now = utcnow()
    started = time.perf_counter()
    job = session.scalars(
        select(Job).where(Job.id == job_id, Job.state.in_(QUEUED)).with_for_update(skip_locked=True)
    ).first()
    if job is None:
        return None  # another replica has it, or it left PENDING
    efficiency = calibration.for_task(spec_of(job).task) if calibration else None
    world = worlds.get(job.qos_class)
    if world is None:
        world = worlds[job.qos_class] = build_world(session, job.qos_class, now)
    tenant = session.get(Tenant, job.tenant_id)
    priority = granted(job.priority, tenant.priority_ceiling) if tenant else job.priority
    # A job placed by a held quote keeps the quote's clusters; others may wait for faster GPUs
    # a running job hands back soon, when that finishes them sooner (`scheduler.waiting`).
    wait, request = None, None
    if job.held_price is None:
        request = job_request(spec_of(job), job.tenant_id, now)
        wait = scheduler.soonest_wait(world.snapshot, request, now.timestamp(), efficiency)
    if wait is not None and wait.beats(now.timestamp()):
        _wait_for(job, wait, now, None, "any GPUs free now", waits)
        return None
    result = plan_for(world, job, efficiency, now, priority)
    if isinstance(result, scheduler.Infeasible):
        spec = spec_of(job)
        free_to_go = not (
            spec.qos.regions or spec.qos.max_clusters or spec.data.residency == "local"
        )
        if result.constraint in ("capacity", "links") and free_to_go:
            key = (job.qos_class, priority)
            blocked[key] = min(blocked.get(key, job.gpus_min), job.gpus_min)
        reason = bounded(f"waiting: {result.reason}", REASON_MAX)
        if job.reason != reason:
            job.reason = reason
        return None
    fitted = _fit_budget(session, world, job, result, efficiency, now, priority, terms)
    if isinstance(fitted, str):
        reason = bounded(f"waiting: {fitted}", REASON_MAX)
        if job.reason != reason:
            job.reason = reason
        return None
    result = fitted
    if result.victims:
        _request_preemption(session, job, result.victims)
        return None
    if _waits_sooner(world, job, request, result, wait, efficiency, now, waits):
        return None
    slots = [
        Slot(world.origins[a.cluster][0], world.origins[a.cluster][1], a.gpus)
        for a in result.placement
    ]
    # A pipeline placed again keeps its stage count: its stage checkpoints are of that split.
    earlier = job.placement.parallel.stages if job.placement is not None else ()
    placement = plan_of(
        result,
        world.snapshot,
        world.origins,
        job.qos_class,
        spec_of(job),
        len(earlier) or None,
        paced=world.paced,
    )
    try:
        # The job's only writes, under one savepoint: if the GPUs are gone (or the job can no
        # longer move), neither the reservation nor the state change stays.
        with session.begin_nested():
            reserve(session, job, slots, placement.wan_kbps)
            budget.hold(session, job, placement)
            job.placement = placement
            ends = now + timedelta(seconds=placement.estimate.total_time_s * _left(job))
            job.ends_at = ends
            job.owner = owner
            job.preempted_by = None
            lifecycle.transition(
                session,
                job,
                JobState.SCHEDULED,
                "placed: " + ", ".join(f"{s.cluster}:{s.gpus}" for s in slots),
                placement=placement.model_dump(mode="json", exclude_computed_fields=True),
            )
    except Conflict as exc:
        job.reason = bounded(f"waiting: {exc.detail}", REASON_MAX)
        worlds.clear()  # someone else reserved: read the world again
        return None
    touched = world.paced & placement.wan_kbps.keys()
    if touched:
        _warn_bursts(session, job.id, touched)
    now_free = free_ports(session, touched) if touched else None
    for qos_class, w in list(worlds.items()):
        worlds[qos_class] = w.after(
            job.id,
            job.tenant_id,
            priority,
            job.preemptible,
            result.placement,
            ends.timestamp(),
            placement.wan_kbps,
            now_free,
        )
    waited = max((utcnow() - job.created_at).total_seconds(), 0.0)
    return Placed(job.id, placement, waited, time.perf_counter() - started)


def _waits_sooner(
    world: World,
    job: Job,
    request: scheduler.JobRequest | None,
    plan: scheduler.Plan,
    gpus: scheduler.Wait | None,
    efficiency: Mapping[str, float] | None,
    now: datetime,
    waits: dict[str, scheduler.Wait] | None,
) -> bool:
    """Whether `job` waits (and is held so) rather than run on `plan` now: for the GPUs of
    `gpus`, or for the WAN rate runners hold on `plan`'s ports, where that finishes it
    sooner. A plan on the small share the ports have free now, where the runners holding
    them end soon, may finish long after waiting for them would
    (`scheduler.bandwidth_wait`; only where ports are declared, never for a held quote:
    `request` is None for one)."""
    taken = ", ".join(f"{a.cluster}:{a.gpus}" for a in plan.placement)
    if gpus is not None and gpus.beats(now.timestamp(), plan.estimate):
        _wait_for(job, gpus, now, plan.estimate, f"the GPUs free now ({taken})", waits)
        return True
    ports = {world.origins[a.cluster][0] for a in plan.placement} & world.paced
    if request is None or not ports:
        return False
    objective = objective_for(request)
    at = now.timestamp()
    rate = scheduler.bandwidth_wait(
        world.snapshot, request, plan, at, objective, world.release, ports, efficiency
    )
    if rate is None or not rate.beats(now.timestamp(), plan.estimate):
        return False
    _wait_for(job, rate, now, plan.estimate, f"the rate free now ({taken})", waits)
    return True


def _warn_bursts(session: Session, placed: str, clusters: Set[str]) -> None:
    """Tell the running jobs whose exchanges cross a port that the job `placed` just
    reserved on (`clusters`, by name) when its rate slows their bursts there by more than
    `BURST_TOLERANCE` (`scheduler.bandwidth.burst_slowdown`): the planner keeps what it
    places within it (the snapshot's ports, `controller.network.snapshot._burst_room`), so
    this is a later job admitted on a view of the ports older than the placements before it
    in the same pass, or on ports whose capacity was lowered. One warning event per job and
    port, with the numbers; the other job is not named (it may be another tenant's)."""
    for port in ports(session, clusters):
        if port.capacity_kbps is None:
            continue
        capacity = (port_gbps(port.capacity_kbps, port.carried_kbps) or 0.0) / 1e6
        for holder in port.holders:
            if holder.job_id == placed:
                continue
            job = session.get(Job, holder.job_id)
            plan = job.placement if job is not None else None
            seen = bursts(plan, port.cluster, port.direction) if plan is not None else None
            if job is None or seen is None:
                continue
            burst, share = seen
            others = sum(h.kbps for h in port.holders if h.job_id != holder.job_id) / 1e6
            slower = burst_slowdown(share, burst, capacity, others)
            if slower <= BURST_TOLERANCE:
                continue
            way = "uplink" if port.direction == "up" else "downlink"
            left = max(capacity - others, 0.0)
            more = "it waits until they end" if slower == float("inf") else f"{slower:.0%}"
            session.add(
                JobEvent(
                    job_id=job.id,
                    kind="warning",
                    message=bounded(
                        f"WAN of {port.cluster}: other jobs now reserve {others:.3g} Gbit/s "
                        f"of its {capacity:.3g} Gbit/s {way}; while they send, this job's "
                        f"exchanges get {left:.3g} of the {burst:.3g} Gbit/s its plan "
                        f"was timed at, so its steps may take up to {more} longer than "
                        "planned",
                        REASON_MAX,
                    ),
                    data={
                        "cluster": port.cluster,
                        "direction": port.direction,
                        "planned_gbps": burst,
                        "left_gbps": left,
                        "slower": None if slower == float("inf") else slower,
                    },
                )
            )


def _left(job: Job) -> float:
    """The share of the job's steps still to run: a job resumed from a checkpoint ends that
    much sooner than its plan's run time (which covers all its steps)."""
    steps = spec_of(job).steps
    done = job.checkpoint_step or 0
    return min(max(1.0 - done / steps, 0.0), 1.0) if steps > 0 else 1.0


def _wait_for(
    job: Job,
    wait: scheduler.Wait,
    now: datetime,
    plan: scheduler.Estimate | None,
    than: str,
    waits: dict[str, scheduler.Wait] | None,
) -> None:
    """Hold the job for `wait`, saying by how much it beats `plan` (None: any plan now)."""
    if waits is not None:
        waits[job.id] = wait
    free_at = datetime.fromtimestamp(wait.at_s, tz=UTC).strftime("%H:%M:%S")
    sooner = wait.sooner_s(now.timestamp(), plan)
    what = (
        f"the WAN rate {len(wait.holders)} running job(s) hold on the ports of {wait.cluster}"
        if wait.holders
        else f"{wait.gpus} GPUs on {wait.cluster}"
    )
    reason = bounded(
        f"waiting: for {what}, expected free at {free_at} UTC: "
        f"done ~{max(sooner / 60, 1):,.0f} min sooner than on {than}",
        REASON_MAX,
    )
    if job.reason != reason:
        job.reason = reason


def _fit_budget(
    session: Session,
    world: World,
    job: Job,
    result: scheduler.Plan,
    efficiency: Mapping[str, float] | None,
    now: datetime,
    priority: int | None,
    locked: dict[str, budget.Terms] | None = None,
) -> scheduler.Plan | str:
    """The plan when the tenant's budget covers it besides what is committed already, else
    the cheapest plan that fits what is left, else why the job waits. Locks the tenant row
    until this placement commits, so concurrent placements see each other; `locked`: the
    terms of the tenants this transaction has locked already (kept until it ends)."""
    terms = locked.get(job.tenant_id) if locked is not None else None
    if terms is None:
        terms = budget.lock_terms(session, job.tenant_id)
        if locked is not None:
            locked[job.tenant_id] = terms
    if terms.deleted:
        raise Invalid("its tenant was deleted", field="tenant")
    if terms.budget is None:
        return result
    committed = budget.commitment(session, job.tenant_id, now)
    why = budget.refusal(terms.budget, committed, budget.priced_up(result.estimate.cost))
    if why is None:
        return result
    room = budget.left(terms.budget, committed)
    if room > 0:
        cheaper = plan_for(world, job, efficiency, now, priority, max_cost=float(room))
        if isinstance(cheaper, scheduler.Plan) and (
            budget.refusal(terms.budget, committed, budget.priced_up(cheaper.estimate.cost)) is None
        ):
            return cheaper
    return why


def _request_preemption(session: Session, job: Job, victims: tuple[str, ...]) -> None:
    """Ask the victims' launchers to checkpoint and stop; the job waits until their GPUs free up."""
    for victim_id in victims:
        victim = session.get(Job, victim_id)
        if victim is None or victim.preempted_by or victim.state not in ACTIVE:
            continue
        victim.preempted_by = job.id
        log.info("job %s preempts %s", job.id, victim_id)
    # The victims may be other tenants' jobs: their ids stay in the log.
    job.reason = f"waiting: preempting {len(victims)} lower-priority job(s)"


def _still_waiting(session: Session, job_id: str, gpus: int) -> None:
    """The reason of a job the pass skips for want of room, in the group's transaction (a job
    another replica is placing is left to it)."""
    job = session.scalars(
        select(Job).where(Job.id == job_id, Job.state.in_(QUEUED)).with_for_update(skip_locked=True)
    ).first()
    reason = f"waiting: no linked clusters have {gpus} free GPUs where the job may run"
    if job is not None and job.reason != reason:
        job.reason = reason


def _note(factory: sessionmaker[Session], job_id: str, reason: str) -> None:
    with factory() as session, session.begin():
        job = session.get(Job, job_id)
        reason = bounded(reason, REASON_MAX)
        if job is not None and job.state in QUEUED and job.reason != reason:
            job.reason = reason


def _fail(session: Session, job_id: str, reason: str) -> None:
    """Fail a job that cannot be placed, in the group's transaction (a second connection would
    wait on this one's write lock on SQLite)."""
    job = session.get(Job, job_id)
    if job is not None and job.state in QUEUED:
        lifecycle.transition(session, job, JobState.FAILED, f"cannot be placed: {reason}")
