"""The service layer's job operations: quote, submit (idempotent), cancel.

Spec validation that needs the world (task, capacity, deadline, budget, quotes) lives here;
shape validation lives in the pydantic spec at the API edge.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import bindparam, func, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

import scheduler
from controller.access.tenancy import Grant, check_grant, live_grant, live_grants
from controller.jobs import lifecycle
from controller.jobs.request import job_request
from controller.network.snapshot import build_snapshot, build_world, calibration
from controller.store.db import lock_for_update
from controller.store.models import Cluster, ClusterGpus, Job, Quote, Tenant, new_id, utcnow
from controller.values.errors import Conflict, CpnError, Invalid, NotFound, TooMany
from controller.values.plan import plan_of
from controller.values.tasks import check_allowed
from grammar.states import LIVE, JobState
from wire.plan import HeldPlan, JobPlan, QuoteOptions
from wire.spec import JobSpec, stored_spec

QUOTE_TTL = timedelta(minutes=15)


class Gone(CpnError):
    status, slug, title = 410, "quote-expired", "Quote expired"


def body_hash(stored: dict[str, Any]) -> str:
    """Fingerprint of a submission (its spec as stored), to tell a retry from a different job
    under one key."""
    canonical = json.dumps(stored, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def quote_options(
    session: Session, spec: JobSpec, tenant_id: str, now: datetime | None = None
) -> list[JobPlan]:
    """Fastest, cheapest, and cheapest-within-deadline options over the live snapshot."""
    request = job_request(spec, tenant_id, now)
    world = build_world(session, spec.qos.qos_class, now)
    efficiency = calibration(session).for_task(spec.task)  # as the placement plans
    objectives: list[scheduler.Objective] = ["time", "cost"]
    if request.qos.deadline_s is not None:
        objectives.append("cost-within-deadline")
    options: list[JobPlan] = []
    failure: scheduler.Infeasible | None = None
    for objective in objectives:
        result = scheduler.plan(
            world.snapshot, request, objective, preempt=False, efficiency=efficiency
        )
        if isinstance(result, scheduler.Infeasible):
            failure = failure or result
            continue
        options.append(
            plan_of(
                result, world.snapshot, world.origins, spec.qos.qos_class, spec, paced=world.paced
            )
        )
    if not options:
        assert failure is not None
        raise Invalid(_infeasible_detail(failure), field=_constraint_field(failure.constraint))
    return options


def _constraint_field(constraint: str) -> str:
    return {
        "deadline": "qos.deadline",
        "budget": "qos.budget",
        "max_cost": "qos.budget",
        "regions": "qos.regions",
        "max_clusters": "qos.max_clusters",
        "quota": "gpus",
        "capacity": "gpus",
        "gpus": "gpus",
    }.get(constraint, constraint)


def _infeasible_detail(failure: scheduler.Infeasible) -> str:
    detail = f"no placement fits ({failure.constraint}): {failure.reason}"
    if failure.closest is not None:
        est = failure.closest.estimate
        detail += f"; the closest plan takes {est.total_time_s:.0f}s and costs {est.cost:.2f}"
    return detail


def admit(spec: JobSpec, tenant: Grant, task_modules: Sequence[str]) -> None:
    """What a tenant may ask for at all: its task under CPN_TASK_MODULES (or a builtin), else
    422 naming `task`; a QoS class and priority within its grant, else 403 (tenancy)."""
    try:
        check_allowed(spec.task, task_modules)
    except ValueError as exc:
        raise Invalid(str(exc), field="task") from None
    check_grant(tenant, spec.qos)


def create_quote(
    session: Session,
    spec: JobSpec,
    tenant_id: str,
    ttl: timedelta = QUOTE_TTL,
    task_modules: Sequence[str] = (),
) -> Quote:
    """Options for `spec`, stored for QUOTE_TTL; `task_modules`: CPN_TASK_MODULES."""
    tenant = live_grant(session, tenant_id)
    if tenant is None:
        raise NotFound("the tenant of this key no longer exists; ask an admin", field="tenant")
    admit(spec, tenant, task_modules)
    now = utcnow()
    options = quote_options(session, spec, tenant_id, now)
    quote = Quote(
        tenant_id=tenant_id,
        spec=spec.model_dump(mode="json"),
        options=QuoteOptions(options=tuple(options)),
        created_at=now,
        expires_at=now + ttl,
    )
    session.add(quote)
    session.flush()
    return quote


@dataclass(frozen=True)
class Submitted:
    job: Job
    created: bool


@dataclass(frozen=True, slots=True)
class Submission:
    """One job submitted by one tenant, with its Idempotency-Key if it sent one."""

    spec: JobSpec
    tenant_id: str
    idempotency_key: str | None = None


SubmitOutcome = Submitted | CpnError
"""What a submission in a batch came to: its job, or the problem it alone was refused with."""


def submit(
    session: Session,
    item: Submission,
    task_modules: Sequence[str] = (),
    max_queued: int = 0,
) -> Submitted:
    """Create a PENDING job, or return the job an earlier submission with this key created
    (also when that submission's commit raced this one's insert); the caller commits.

    `task_modules`: CPN_TASK_MODULES (default: builtin tasks only); `max_queued`:
    CPN_MAX_QUEUED_JOBS (0: no cap)."""
    try:
        [outcome] = submit_many(session, [item], task_modules, max_queued)
    except IntegrityError:  # the key's job exists: a retry, or a race lost
        session.rollback()
        existing = (
            _by_key(session, item.tenant_id, item.idempotency_key) if item.idempotency_key else None
        )
        if existing is None:
            raise
        return Submitted(_same_body(existing, body_hash(item.spec.model_dump(mode="json"))), False)
    if isinstance(outcome, CpnError):
        raise outcome
    return outcome


def submit_many(
    session: Session,
    items: Sequence[Submission],
    task_modules: Sequence[str] = (),
    max_queued: int = 0,
) -> list[SubmitOutcome]:
    """Create a PENDING job for each item in the session's transaction (the caller commits);
    an item refused alone wrote nothing, and one whose key made a job before gets that job.

    What every submission reads is read once for the batch (api.submissions' group commit):
    the network's offered GPUs, each tenant's grant, and with a queue cap its PENDING jobs,
    to which those accepted here are added. The jobs and their first events are then written
    as one insert each. A key is looked up only when a check refuses its item (a first
    submission, most of them, saves the lookup); a key already taken (stored, or twice in the
    batch) makes the insert raise `IntegrityError`, with nothing written: `submit` each item
    alone then, which answers that key's job.

    Items are taken tenant by tenant (in the order of their ids; a tenant's own in arrival
    order, which the queue cap counts in), and rows inserted in (tenant, key) order: two
    batches on PostgreSQL then take tenants' locks and keys' index entries in one order,
    so they wait on each other but never deadlock."""
    grants = live_grants(session, {item.tenant_id for item in items})
    offered = offered_gpus(session)
    queues: dict[str, _Queue] = {}
    outcomes: list[SubmitOutcome | None] = [None] * len(items)
    jobs: list[tuple[Job, str]] = []  # each with the reason it waits, its first event
    for at in sorted(range(len(items)), key=lambda i: items[i].tenant_id):
        item = items[at]
        stored = item.spec.model_dump(mode="json")  # once: hashed here, stored in the job
        digest = body_hash(stored)
        try:
            grant = grants.get(item.tenant_id)
            if grant is None:  # or deleted: it cannot submit
                raise NotFound(
                    "the tenant of this key no longer exists; ask an admin", field="tenant"
                )
            job, why = _create(session, item, stored, grant, digest, task_modules, offered)
            if max_queued:  # so a tenant's lock is taken only for what will be written
                _check_queue_cap(session, grant, max_queued, queues)
            if job.quote_id is not None:  # last: a refused item wrote nothing
                _accept_quote(session, job.quote_id, job.id)
        except CpnError as exc:
            outcomes[at] = _refused(session, item, digest, exc)
            continue
        jobs.append((job, why))
        outcomes[at] = Submitted(job, created=True)
    if jobs:
        jobs.sort(key=lambda made: (made[0].tenant_id, made[0].idempotency_key or ""))
        _insert(session, [job for job, _why in jobs])
        lifecycle.created_many(session, jobs)
    return [outcome for outcome in outcomes if outcome is not None]


def _refused(session: Session, item: Submission, digest: str, exc: CpnError) -> SubmitOutcome:
    """A retry still gets its job whatever would refuse a new one now (the queue cap, an
    expired quote, a network that shrank)."""
    if item.idempotency_key is None:
        return exc
    existing = _by_key(session, item.tenant_id, item.idempotency_key)
    if existing is None:
        return exc
    try:
        return Submitted(_same_body(existing, digest), created=False)
    except Invalid as mismatch:
        return mismatch


def _create(
    session: Session,
    item: Submission,
    stored: dict[str, Any],
    tenant: Grant,
    digest: str,
    task_modules: Sequence[str],
    offered: int,
) -> tuple[Job, str]:
    """The job `item` makes (not written yet), and the reason it waits, for its first event."""
    spec = item.spec
    admit(spec, tenant, task_modules)
    now = utcnow()
    request = job_request(spec, tenant.id, now)
    job_id = new_id()
    held, reason = _hold_quote(session, spec, tenant, request, now)
    reason = reason or _queue_reason(session, spec, tenant, request, offered)
    lo, hi = spec.gpu_range
    job = Job(
        id=job_id,
        tenant_id=tenant.id,
        name=spec.name,
        spec=stored,
        state=JobState.PENDING,
        reason=reason or "waiting for the scheduler",
        priority=spec.qos.priority,
        qos_class=spec.qos.qos_class,
        preemptible=spec.qos.is_preemptible,
        gpus_min=lo,
        gpus_max=hi,
        run_s=scheduler.reference_run_s(request),
        idempotency_key=item.idempotency_key,
        request_hash=digest,
        quote_id=spec.quote_id,
        held_price=held,
        placement=None,
        attempts=0,
        owner=None,
        preempted_by=None,
        checkpoint_step=None,
        fence=0,
        created_at=now,
        updated_at=now,
        started_at=None,
        finished_at=None,
        ends_at=None,
        version=1,
    )
    return job, reason or "submitted"


_INSERT_JOB = insert(Job)
_JOB_COLUMNS = tuple(c.key for c in Job.__table__.columns)


def _insert(session: Session, jobs: Sequence[Job]) -> None:
    """Write new jobs' rows, every column as set on each, as one Core statement in the
    session's transaction; the jobs stay detached (the answers' values, not tracked
    entities). The ORM's unit of work (change tracking, ordering, version check, the row's
    fetch-back) was a large share of a submission's CPU and had nothing to decide for new rows
    (measured: bench/results/api-throughput.md)."""
    rows = [{k: getattr(job, k) for k in _JOB_COLUMNS} for job in jobs]
    session.connection().execute(_INSERT_JOB, rows)


CAP_SLACK = 1_000
"""How far below CPN_MAX_QUEUED_JOBS a submission counts without locking the tenant."""


@dataclass
class _Queue:
    """A tenant's PENDING jobs as a batch counts them: read once, then its own accepted."""

    stored: int
    locked: bool = False
    accepted: int = 0

    @property
    def queued(self) -> int:
        return self.stored + self.accepted


def _check_queue_cap(session: Session, tenant: Grant, cap: int, queues: dict[str, _Queue]) -> None:
    """Refuse a submission past the tenant's cap of PENDING jobs (a retry of a job already
    submitted is answered before this); count it in `queues` (the batch's, per tenant).

    Within `CAP_SLACK` of the cap the tenant row is locked first (SQLite: the database's
    write lock), so concurrent submissions count each other and cannot overshoot together.
    Further below, the count is taken without the lock, which serialised every submission of
    a tenant over its count, insert and commit and so capped one tenant's submission rate
    (measured: bench/results/api-throughput.md). A submission counted there can overshoot only by
    staying uncommitted while `CAP_SLACK` others commit, and then by at most the submissions
    in flight at once."""
    queue = queues.get(tenant.id)
    if queue is None:
        queue = queues[tenant.id] = _Queue(_pending(session, tenant, cap))
    if not queue.locked and queue.queued >= cap - CAP_SLACK:
        lock_for_update(session)  # SQLite: its write lock now, or two counts could both pass
        # NO KEY UPDATE: these serialise, while the jobs' foreign-key checks (KEY SHARE) pass
        session.execute(
            select(Tenant.id).where(Tenant.id == tenant.id).with_for_update(key_share=True)
        )
        queue.stored, queue.locked = _pending(session, tenant, cap), True
    if queue.queued >= cap:
        raise TooMany(
            f"{queue.queued} jobs are queued, the most is {cap} (CPN_MAX_QUEUED_JOBS); wait for "
            "some to start or cancel some",
            field="tenant",
        )
    queue.accepted += 1


_PENDING = select(func.count()).select_from(
    select(Job.tenant_id)
    .where(Job.tenant_id == bindparam("tenant"), Job.state == JobState.PENDING)
    .limit(bindparam("upto"))
    .subquery()
)
"""Built once: building and keying a statement for SQLAlchemy's cache costs about what
running it does, and a submission runs several (measured: bench/results/api-throughput.md)."""


def _pending(session: Session, tenant: Grant, upto: int) -> int:
    """The tenant's PENDING jobs, counted up to `upto` (an index-only count, cut short)."""
    conn = session.connection()  # Core: a count has no entities for the ORM to load
    return conn.execute(_PENDING, {"tenant": tenant.id, "upto": upto}).scalar() or 0


_BY_KEY = select(Job).where(
    Job.tenant_id == bindparam("tenant"), Job.idempotency_key == bindparam("key")
)


def _by_key(session: Session, tenant_id: str, key: str) -> Job | None:
    return session.scalars(_BY_KEY, {"tenant": tenant_id, "key": key}).first()


def _same_body(job: Job, digest: str) -> Job:
    if job.request_hash != digest:
        raise Invalid(
            "this Idempotency-Key was used for a different job spec; use a new key for a new job",
            field="Idempotency-Key",
        )
    return job


_PRICED_APART = {"name", "quote_id", "quote_option"}
"""What a job may change from the spec its quote priced: its name, and the quote it names."""


def _priced(spec: JobSpec) -> dict[str, Any]:
    return spec.model_dump(mode="json", exclude=_PRICED_APART)


def _hold_quote(
    session: Session,
    spec: JobSpec,
    tenant: Grant,
    request: scheduler.JobRequest,
    now: datetime,
) -> tuple[HeldPlan | None, str | None]:
    """The held price of the quote named in the spec, if its placement is still possible.

    A quote prices one spec and is accepted once, by its tenant, before it expires (as a
    payment processor treats a quote): another tenant's is a 404, an expired one a 410, one
    for another spec or already accepted a 409. `_accept_quote` marks it taken."""
    if spec.quote_id is None:
        return None, None
    quote = session.get(Quote, spec.quote_id)
    if quote is None or quote.tenant_id != tenant.id:
        raise NotFound(
            f"no quote {spec.quote_id!r}; ask for one with POST /v1/quotes", field="quote_id"
        )
    if quote.expires_at <= now:
        raise Gone(
            f"quote {quote.id} expired at {quote.expires_at.isoformat()}; ask for a new quote",
            field="quote_id",
        )
    if quote.accepted_by is not None:
        raise Conflict(
            f"quote {quote.id} was accepted by job {quote.accepted_by}; a quote holds its "
            "price for one job: ask for a new quote",
            field="quote_id",
        )
    quoted = _priced(stored_spec(quote.spec))
    asked = _priced(spec)
    changed = sorted(k for k in quoted.keys() | asked.keys() if quoted.get(k) != asked.get(k))
    if changed:
        raise Conflict(
            f"quote {quote.id} priced another spec ({', '.join(changed)} differ); submit the "
            "spec it priced, or ask for a quote of this one",
            field="quote_id",
        )
    options = quote.options.options
    chosen = next((o for o in options if spec.quote_option in (None, o.objective)), None)
    if chosen is None:
        raise Invalid(
            f"quote {quote.id} has no {spec.quote_option!r} option; it has "
            + ", ".join(str(o.objective) for o in options),
            field="quote_option",
        )
    world = build_world(session, spec.qos.qos_class, now)
    check = scheduler.evaluate(world.snapshot, request, chosen.assignments(world.origins))
    if isinstance(check, scheduler.Infeasible):
        raise Conflict(
            f"the quoted placement is no longer possible ({check.reason}); ask for a new quote",
            field="quote_id",
        )
    return HeldPlan(**dict(chosen), quote_id=quote.id), None


def _accept_quote(session: Session, quote_id: str, job_id: str) -> None:
    """Mark the quote accepted by the job, the item's last write before its job's insert (a
    refused item then wrote nothing); Conflict when another job took it meanwhile."""
    taken = session.execute(
        update(Quote)
        .where(Quote.id == quote_id, Quote.accepted_by.is_(None))
        .values(accepted_by=job_id)
        .execution_options(synchronize_session=False)
    )
    if taken.rowcount != 1:  # type: ignore[attr-defined]
        raise Conflict(
            f"quote {quote_id} was accepted by another job meanwhile; ask for a new quote",
            field="quote_id",
        )


def _queue_reason(
    session: Session, spec: JobSpec, tenant: Grant, request: scheduler.JobRequest, total: int
) -> str | None:
    """Refuse a spec that can never fit; say why a spec its own limits hold back will wait.

    A submission gets only cheap checks (capacity, quota) unless its own budget, deadline,
    region or cluster limit could make it unplaceable: only then does the planner run here.
    The tenant's budget is not checked here: it is held at placement (controller.money.budget), and
    the reconcile loop, which plans every queued job, keeps each one's waiting reason current
    -- a planner run and an O(queue) commitment sum per submission took much of its time
    (measured: bench/results/api-throughput.md).
    `total`: the GPUs the network offers (`offered_gpus`, read once for a batch).
    """
    lo, _hi = spec.gpu_range
    if lo > total:
        raise Invalid(
            f"the job needs at least {lo} GPUs but the compute network offers {total} in all; "
            "ask for fewer GPUs",
            field="gpus",
        )
    if tenant.gpu_quota is not None and lo > tenant.gpu_quota:
        raise Invalid(
            f"the job needs {lo} GPUs but your quota is {tenant.gpu_quota}; ask for fewer GPUs "
            "or a larger quota",
            field="gpus",
        )
    if spec.data.residency == "local" and spec.data.clusters:
        held = list(dict.fromkeys(spec.data.clusters))
        known = set(session.scalars(select(Cluster.name).where(Cluster.name.in_(held))))
        unknown = [c for c in held if c not in known]
        if unknown:
            raise Invalid(
                f"data.clusters: no cluster {', '.join(map(repr, unknown))}; a local-data job "
                "runs on every cluster holding its data, so name only clusters of the network",
                field="data.clusters",
            )
        if spec.gpu_range[1] < len(held):
            raise Invalid(
                f"data.clusters: {len(held)} clusters hold the data but the job asks for at "
                f"most {spec.gpu_range[1]} GPUs; each cluster trains its share, so ask for at "
                f"least {len(held)} GPUs",
                field="data.clusters",
            )
    qos = spec.qos
    if all(v is None for v in (qos.budget, qos.deadline, qos.regions, qos.max_clusters)):
        return None
    snap = build_snapshot(session, spec.qos.qos_class)
    efficiency = calibration(session).for_task(spec.task)  # as the placement plans
    result = scheduler.plan(snap, request, "cost", preempt=False, efficiency=efficiency)
    if not isinstance(result, scheduler.Infeasible):
        return None
    if result.constraint in ("budget", "max_cost", "deadline", "regions", "max_clusters"):
        # Would an empty network fit it? If not, the spec alone can never fit.
        empty = _emptied(snap)
        again = scheduler.plan(empty, request, "cost", preempt=False, efficiency=efficiency)
        if isinstance(again, scheduler.Infeasible):
            raise Invalid(_infeasible_detail(result), field=_constraint_field(result.constraint))
    return f"waiting: {result.reason}"


_OFFERED = (
    select(func.coalesce(func.sum(ClusterGpus.allocatable), 0))
    .join(Cluster, Cluster.id == ClusterGpus.cluster_id)
    .where(Cluster.state.in_(LIVE), Cluster.cordoned.is_(False))
)


def offered_gpus(session: Session) -> int:
    """GPUs the network offers at all (held or free), on clusters that take new work."""
    return int(session.connection().execute(_OFFERED).scalar() or 0)


def _held(snap: scheduler.Snapshot, cluster: str) -> int:
    return sum(a.gpus for r in snap.running for a in r.placement if a.cluster == cluster)


def _emptied(snap: scheduler.Snapshot) -> scheduler.Snapshot:
    """The same network with every running job gone: what the spec could ever get."""
    import dataclasses

    clusters = tuple(
        dataclasses.replace(c, gpus_free=c.gpus_free + _held(snap, c.name)) for c in snap.clusters
    )
    return scheduler.Snapshot(clusters=clusters, links=snap.links, quotas=snap.quotas)


def cancel(session: Session, job: Job, reason: str) -> Job:
    """Cancel now: GPUs go back at once; a running job's actors are stopped by the launcher."""
    if job.state in lifecycle.TERMINAL:
        raise Conflict(
            f"job {job.id} already ended ({job.state}); nothing to cancel", field="state"
        )
    lifecycle.transition(session, job, JobState.CANCELLED, reason)
    lifecycle.end_run(session, job)
    return job


SHORT_ID_MIN = 4
"""The fewest characters of a job id that name it (tables print 8)."""
_SHOWN_MATCHES = 5


def get_job(session: Session, job_id: str, tenant_id: str | None) -> Job:
    """The job, if the caller may see it (tenant_id None: an admin sees all). `job_id` may be
    the start of an id, as tables print it (`docker`'s and `git`'s short ids): one visible
    job whose id starts so is that job; several are a 422 listing them; another tenant's
    never match. A miss on the full id is the only case that searches."""
    job = session.get(Job, job_id)
    if job is not None and (tenant_id is None or job.tenant_id == tenant_id):
        return job
    prefix = job_id.strip().lower()
    if job is None and SHORT_ID_MIN <= len(prefix) < 36 and set(prefix) <= _ID_CHARS:
        stmt = select(Job).where(Job.id.startswith(prefix, autoescape=True))
        if tenant_id is not None:
            stmt = stmt.where(Job.tenant_id == tenant_id)
        found = list(session.scalars(stmt.order_by(Job.created_at).limit(_SHOWN_MATCHES + 1)))
        if len(found) == 1:
            return found[0]
        if found:
            shown = ", ".join(j.id[:12] for j in found[:_SHOWN_MATCHES])
            more = "" if len(found) <= _SHOWN_MATCHES else ", ..."
            raise Invalid(
                f"job id {job_id!r} is the start of several jobs' ids ({shown}{more}); "
                "give more of it",
                field="job_id",
            )
    raise NotFound(f"no job {job_id!r}; list yours with GET /v1/jobs", field="job_id")


_ID_CHARS = frozenset("0123456789abcdef-")
