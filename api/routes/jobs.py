"""Tenants' jobs: quotes, idempotent submission, listing, cancel, events (SSE), metrics."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from functools import partial
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Depends, Header, Query, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from api.deps import (
    ReaderDep,
    SessionDep,
    SettingsDep,
    app_state,
    autocommit_read,
    caller_key_hash,
    current_principal,
    require,
)
from api.job_list import list_page
from api.pagination import PageDep, fetch_page
from api.problems import PROBLEM_BASE, problem
from api.ratelimit import limit_quotes
from api.schemas import Page
from api.streams import EventStream, StreamSlot, StreamSlots
from api.submissions import SubmissionBatcher
from controller.access.keys import Principal
from controller.access.tenancy import find_tenant
from controller.jobs import lifecycle
from controller.jobs import service as job_service
from controller.jobs.service import Submission
from controller.store.models import (
    Job,
    JobEvent,
    JobLog,
    JobMetric,
    Quote,
)
from controller.values.errors import Invalid, NotFound, PreconditionFailed
from grammar.states import JobState
from wire.jobs import JobEventOut, JobLogOut, JobMetricOut, JobOut, QuoteOut
from wire.spec import JobSpec

router = APIRouter(prefix="/v1", tags=["jobs"])
TenantDep = Annotated[Principal, Depends(require("tenant"))]
StateQuery = Annotated[JobState | None, Query(description="Only jobs in this state.")]


def _scope(principal: Principal) -> str | None:
    """Tenants see their own jobs; admins see all."""
    return None if principal.role == "admin" else principal.scope


def _job_response(job: Job, status_code: int = status.HTTP_200_OK) -> Response:
    """The job as `JobOut` JSON with its version as the ETag, rendered on the route's thread:
    a sync route returning a model has FastAPI validate it again on a second worker thread,
    and each thread hop costs CPU (measured: bench/results/api-throughput.md)."""
    return Response(
        JobOut.model_validate(job).model_dump_json(),
        status_code=status_code,
        media_type="application/json",
        headers={"ETag": f'"{job.version}"'},
    )


@router.post(
    "/quotes",
    status_code=status.HTTP_201_CREATED,
    response_model=QuoteOut,
    dependencies=[Depends(limit_quotes)],  # after authentication, before the body and planner
)
def create_quote(
    spec: JobSpec, session: SessionDep, principal: TenantDep, settings: SettingsDep
) -> QuoteOut:
    """Options from the planner over the live network: fastest, cheapest, within the deadline."""
    ttl = timedelta(seconds=settings.quote_ttl_s)
    # create_quote reads the tenant's grant (a deleted tenant: 404 naming `tenant`)
    tenant_id = principal.scope or ""
    quote = job_service.create_quote(session, spec, tenant_id, ttl, settings.task_prefixes())
    session.commit()
    return QuoteOut(
        id=quote.id,
        created_at=quote.created_at,
        expires_at=quote.expires_at,
        options=list(quote.options.options),
    )


@router.get("/quotes/{quote_id}", response_model=QuoteOut)
def get_quote(quote_id: str, session: SessionDep, principal: TenantDep) -> QuoteOut:
    quote = session.get(Quote, quote_id)
    if quote is None or quote.tenant_id != principal.scope:
        raise NotFound(f"no quote {quote_id!r}", field="quote_id")
    return QuoteOut(
        id=quote.id,
        created_at=quote.created_at,
        expires_at=quote.expires_at,
        options=list(quote.options.options),
    )


@router.post(
    "/jobs",
    status_code=status.HTTP_201_CREATED,
    response_model=JobOut,
    responses={200: {"model": JobOut, "description": "An earlier submission with this key."}},
)
async def submit_job(
    spec: JobSpec,
    request: Request,
    principal: TenantDep,
    idempotency_key: Annotated[
        str | None,
        Header(max_length=128, description="Retries with the same key and body return one job."),
    ] = None,
) -> Response:
    """Submit a job; it starts PENDING, with the reason it waits when it cannot run yet.

    Submissions that arrive together are written in one transaction (`api.submissions`)."""
    submissions: SubmissionBatcher = app_state(request).submissions
    item = Submission(spec, principal.scope or "", idempotency_key)
    result = await submissions.run(item)
    created = status.HTTP_201_CREATED if result.created else status.HTTP_200_OK
    return _job_response(result.job, created)


@router.get("/jobs", response_model=Page[JobOut])
def list_jobs(
    request: Request,
    session: SessionDep,
    principal: ReaderDep,
    page: PageDep,
    state: StateQuery = None,
    tenant: Annotated[
        str | None, Query(max_length=63, description="Admins: one tenant, by id or name.")
    ] = None,
) -> Response:
    """Your jobs, newest first (admins: everyone's).

    Answered as JSON joined by `api.job_list` (the page's keys, then only the rows this
    replica has not rendered), so neither SQLAlchemy's per-value processors nor FastAPI's
    second validation run."""
    scope = _scope(principal)
    if scope is None and tenant:  # an admin: the one tenant asked for (else everyone's)
        named = find_tenant(session, tenant)
        scope = named.id if named is not None else tenant
    body = list_page(
        # Core: columns, not entities, so the ORM has nothing to do
        session.connection(execution_options=autocommit_read(session)),
        app_state(request).rendered_jobs,
        tenant=scope,
        state=state,
        limit=page.limit,
        offset=page.offset,
    )
    return Response(body, media_type="application/json")


@router.get("/jobs/{job_id}", response_model=JobOut)
def get_job(job_id: str, session: SessionDep, principal: ReaderDep) -> Response:
    """One job; its ETag is the version to send in If-Match when cancelling."""
    return _job_response(job_service.get_job(session, job_id, _scope(principal)))


@router.post("/jobs/{job_id}/cancel", response_model=JobOut)
def cancel_job(
    job_id: str,
    session: SessionDep,
    principal: ReaderDep,
    if_match: Annotated[
        str | None, Header(description="ETag from a GET: refuse if changed.")
    ] = None,
) -> Response:
    """Cancel a job that has not ended; its GPUs are released at once."""
    job = job_service.get_job(session, job_id, _scope(principal))
    if if_match is not None and if_match.strip('W/"') != str(job.version):
        raise PreconditionFailed(
            f"job {job.id} changed (version {job.version}, state {job.state}); GET it and retry",
            field="If-Match",
        )
    job_service.cancel(session, job, f"cancelled by {principal.role}")
    session.commit()
    return _job_response(job)


_SSE_BATCH = 500
POLL_S = 0.25
"""How soon an open stream looks again after finding events (one short session a look)."""
IDLE_POLL_S = 1.0
"""How often it looks while the job is quiet: the wait doubles after each empty look up to
this, so a crowd of idle streams costs a look a second each."""
KEEPALIVE_S = 5.0
"""A comment line after this long without a write keeps proxies from closing the stream."""
KEY_CHECK_S = 1.0
"""How often an open stream asks whether its key is still live (a dict lookup, a query at
most once a second per process): a revoked or expired key's streams end within seconds."""


def _events_after(
    sessions: sessionmaker[Session], job_id: str, after: int
) -> tuple[list[dict[str, Any]], bool]:
    """Events after `after`, and whether they are the last: the job has ended (or is gone) and
    all are sent. One short session: a stream holds no connection between polls.

    The state is read before the events: the final transition commits its event together with
    the state, so a job seen ended here has every event visible to the read that follows.
    Reading them the other way round could end the stream before its last event."""
    with sessions() as session:
        state = session.scalar(select(Job.state).where(Job.id == job_id))
        rows = session.scalars(
            select(JobEvent)
            .where(JobEvent.job_id == job_id, JobEvent.id > after)
            .order_by(JobEvent.id)
            .limit(_SSE_BATCH)
        ).all()
        out = [JobEventOut.model_validate(e).model_dump(mode="json") for e in rows]
    done = state is None or (state in lifecycle.TERMINAL and len(rows) < _SSE_BATCH)
    return out, done


@router.get(
    "/jobs/{job_id}/events",
    response_model=Page[JobEventOut],
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "JSON page or SSE."},
        429: {"description": "This key holds CPN_MAX_STREAMS_PER_KEY streams open already."},
    },
)
def job_events(
    job_id: str,
    request: Request,
    principal: ReaderDep,
    page: PageDep,
    stream: Annotated[bool, Query(description="Server-sent events until the job ends.")] = False,
    accept: Annotated[str | None, Header()] = None,
    last_event_id: Annotated[str | None, Header(max_length=20)] = None,
) -> Any:
    """State changes and progress, as a page of JSON or as server-sent events.

    A stream ends with `event: end` once the job has ended and every event is sent; with
    `event: resume` after CPN_STREAM_MAX_S (reconnect with `Last-Event-ID`: nothing is lost);
    with `event: error` (a problem) when its key is revoked or expires."""
    state = app_state(request)
    with state.sessions() as session:  # closed before any stream starts
        job_id = job_service.get_job(session, job_id, _scope(principal)).id
        if not (stream or (accept or "").startswith("text/event-stream")):
            stmt = select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)
            items, total = fetch_page(session, stmt, page)
            return Page(
                items=[JobEventOut.model_validate(e) for e in items],
                total=total,
                limit=page.limit,
                offset=page.offset,
            )
    return _stream(request, principal, job_id, last_event_id, _events_after, None)


def _stream(
    request: Request,
    principal: Principal,
    job_id: str,
    last_event_id: str | None,
    fetch: Fetch,
    kind: str | None,
) -> Any:
    """A job's rows as server-sent events from `Last-Event-ID` on, in one of the key's
    stream slots (a 429 when it holds them all)."""
    state = app_state(request)
    try:
        start = int(last_event_id) if last_event_id else 0
    except ValueError:
        raise Invalid(
            "Last-Event-ID must be an event id (an integer)", field="Last-Event-ID"
        ) from None
    slots: StreamSlots = state.streams
    slot = slots.acquire(principal.key_id, time.monotonic())
    if slot is None:
        state.metrics.rate_limited.labels("streams").inc()
        return problem(
            429,
            "Too many requests",
            f"this key already holds {slots.per_key} event streams open, the most allowed "
            "(CPN_MAX_STREAMS_PER_KEY); close one, or read the events as pages (without "
            "stream=true), and retry after Retry-After seconds",
            slug="too-many-streams",
            instance=request.url.path,
            errors=[{"field": "stream", "message": "too many open streams for this key"}],
            headers={"Retry-After": str(slots.retry_after(principal.key_id, time.monotonic()))},
        )
    key_hash = anyio.from_thread.run(caller_key_hash, request) or ""  # this route runs on a thread
    events = _sse(request, job_id, start, key_hash, state.settings.stream_max_s, slot, fetch, kind)
    return EventStream(events, slot)


@router.get(
    "/jobs/{job_id}/logs",
    response_model=Page[JobLogOut],
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "JSON page or SSE."},
        429: {"description": "This key holds CPN_MAX_STREAMS_PER_KEY streams open already."},
    },
)
def job_logs(
    job_id: str,
    request: Request,
    principal: ReaderDep,
    page: PageDep,
    source: Annotated[
        str | None,
        Query(max_length=64, description="Only this worker's lines (`cluster/rank`), or `driver`."),
    ] = None,
    after: Annotated[int, Query(ge=0, description="Only lines after this line id (a cursor).")] = 0,
    follow: Annotated[
        bool, Query(description="Server-sent events (`event: log`) until the job ends.")
    ] = False,
    accept: Annotated[str | None, Header()] = None,
    last_event_id: Annotated[str | None, Header(max_length=20)] = None,
) -> Any:
    """What the job's workers printed (stdout, stderr) and its run's driver said, oldest
    first: a page of JSON, or with `follow` a stream that ends once the job has ended and
    every line is sent (reconnect with `Last-Event-ID` after `event: resume`). The newest
    20,000 lines of a job are kept."""
    state = app_state(request)
    with state.sessions() as session:  # closed before any stream starts
        job_id = job_service.get_job(session, job_id, _scope(principal)).id
        if not (follow or (accept or "").startswith("text/event-stream")):
            stmt = select(JobLog).where(JobLog.job_id == job_id, JobLog.id > after)
            if source is not None:
                stmt = stmt.where(JobLog.source == source)
            items, total = fetch_page(session, stmt.order_by(JobLog.id), page)
            return Page(
                items=[JobLogOut.model_validate(x) for x in items],
                total=total,
                limit=page.limit,
                offset=page.offset,
            )
    fetch: Fetch = partial(_logs_after, source=source)
    return _stream(request, principal, job_id, last_event_id or str(after), fetch, "log")


def _logs_after(
    sessions: sessionmaker[Session], job_id: str, after: int, source: str | None = None
) -> tuple[list[dict[str, Any]], bool]:
    """Log lines after `after` (of `source` only, when given), and whether they are the last
    (as `_events_after`: the state first, then the lines; the last report's lines commit
    before the run is settled)."""
    with sessions() as session:
        state = session.scalar(select(Job.state).where(Job.id == job_id))
        stmt = select(JobLog).where(JobLog.job_id == job_id, JobLog.id > after)
        if source is not None:
            stmt = stmt.where(JobLog.source == source)
        rows = session.scalars(stmt.order_by(JobLog.id).limit(_SSE_BATCH)).all()
        out = [JobLogOut.model_validate(r).model_dump(mode="json") for r in rows]
    done = state is None or (state in lifecycle.TERMINAL and len(rows) < _SSE_BATCH)
    return out, done


Fetch = Callable[[sessionmaker[Session], str, int], tuple[list[dict[str, Any]], bool]]
"""What a stream polls: the rows after an id, and whether they are the job's last."""


def _sse_event(kind: str, data: dict[str, Any], event_id: int | None = None) -> str:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {kind}\ndata: {json.dumps(data)}\n\n"


async def _sse(
    request: Request,
    job_id: str,
    after: int,
    key_hash: str,
    max_s: float,
    slot: StreamSlot,
    fetch: Fetch = _events_after,
    kind: str | None = None,
) -> AsyncIterator[str]:
    """Poll a job's rows (`fetch`: its events, or its log) and forward new ones, as `kind`
    (None: each event's own); end once the job has ended and all is sent, when the stream's
    lifetime is up (`resume`), or when its key stops being live (`error`)."""
    state = app_state(request)
    started = checked = time.monotonic()
    wrote, wait = 0.0, POLL_S
    try:
        yield "retry: 1000\n\n"  # EventSource clients reconnect after a second
        while True:
            now = time.monotonic()
            if now - checked >= KEY_CHECK_S:
                checked = now
                if await current_principal(request, key_hash) is None:
                    yield _sse_event("error", _key_gone(request.url.path))
                    return
            batch, last = await run_in_threadpool(fetch, state.sessions, job_id, after)
            for event in batch:
                after = event["id"]
                yield _sse_event(kind or event["kind"], event, after)
            if last:
                yield "event: end\ndata: {}\n\n"
                return
            if time.monotonic() - started >= max_s:
                yield _sse_event(
                    "resume",
                    {
                        "last_event_id": after,
                        "detail": "this stream reached its lifetime (CPN_STREAM_MAX_S); "
                        "reconnect with Last-Event-ID to go on",
                    },
                )
                return
            now = time.monotonic()
            if batch:
                wrote, wait = now, POLL_S
            else:
                if now - wrote >= KEEPALIVE_S:  # the first empty look too: the stream is live
                    wrote = now
                    yield ": keep-alive\n\n"
                wait = min(wait * 2, IDLE_POLL_S)
            await anyio.sleep(wait)
    finally:
        slot.release()


def _key_gone(path: str) -> dict[str, Any]:
    """The problem an open stream ends with when its key was revoked or expired."""
    return {
        "type": PROBLEM_BASE + "unauthorized",
        "title": "Unauthorized",
        "status": 401,
        "detail": "API key is unknown, revoked or expired: ask an admin for a valid key",
        "instance": path,
    }


@router.get("/jobs/{job_id}/metrics", response_model=Page[JobMetricOut])
def job_metrics(
    job_id: str, session: SessionDep, principal: ReaderDep, page: PageDep
) -> Page[JobMetricOut]:
    """Progress reports: step, loss, accuracy, step time (compute and communication), WAN bytes."""
    job_id = job_service.get_job(session, job_id, _scope(principal)).id
    stmt = (
        select(JobMetric).where(JobMetric.job_id == job_id).order_by(JobMetric.step, JobMetric.id)
    )
    items, total = fetch_page(session, stmt, page)
    return Page(
        items=[JobMetricOut.model_validate(m) for m in items],
        total=total,
        limit=page.limit,
        offset=page.offset,
    )
