"""Tenants' jobs: quotes, idempotent submission, listing, cancel, events (SSE), metrics."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from sqlalchemy import select

from api.deps import SessionDep, SettingsDep, require
from api.pagination import PageDep, fetch_page
from api.schemas import JobEventOut, JobMetricOut, JobOut, Page, QuoteOut
from controller import jobs as job_service
from controller import lifecycle
from controller.errors import Invalid, NotFound, PreconditionFailed
from controller.jobspec import JobSpec
from controller.keys import Principal
from controller.models import Job, JobEvent, JobMetric, Quote, Tenant

router = APIRouter(prefix="/v1", tags=["jobs"])
TenantDep = Annotated[Principal, Depends(require("tenant"))]
ReaderDep = Annotated[Principal, Depends(require("tenant", "admin"))]
StateQuery = Annotated[
    str | None,
    Query(pattern="^(PENDING|SCHEDULED|RUNNING|SUCCEEDED|FAILED|CANCELLED|RESCHEDULING)$"),
]


def _tenant(session: SessionDep, principal: Principal) -> Tenant:
    tenant = session.get(Tenant, principal.scope or "")
    if tenant is None:
        raise NotFound("the tenant of this key no longer exists; ask an admin", field="tenant")
    return tenant


def _scope(principal: Principal) -> str | None:
    """Tenants see their own jobs; admins see all."""
    return None if principal.role == "admin" else principal.scope


def _job_out(job: Job, response: Response | None = None) -> JobOut:
    if response is not None:
        response.headers["ETag"] = f'"{job.version}"'
    return JobOut.model_validate(job)


@router.post("/quotes", status_code=status.HTTP_201_CREATED, response_model=QuoteOut)
def create_quote(
    spec: JobSpec, session: SessionDep, principal: TenantDep, settings: SettingsDep
) -> QuoteOut:
    """Options from the planner over the live network: fastest, cheapest, within the deadline."""
    tenant = _tenant(session, principal)
    ttl = timedelta(seconds=settings.quote_ttl_s)
    quote = job_service.create_quote(session, spec, tenant.id, ttl)
    session.commit()
    return QuoteOut(
        id=quote.id,
        created_at=quote.created_at,
        expires_at=quote.expires_at,
        options=quote.options["options"],
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
        options=quote.options["options"],
    )


@router.post(
    "/jobs",
    status_code=status.HTTP_201_CREATED,
    response_model=JobOut,
    responses={200: {"model": JobOut, "description": "An earlier submission with this key."}},
)
def submit_job(
    spec: JobSpec,
    session: SessionDep,
    principal: TenantDep,
    response: Response,
    idempotency_key: Annotated[
        str | None,
        Header(max_length=128, description="Retries with the same key and body return one job."),
    ] = None,
) -> JobOut:
    """Submit a job; it starts PENDING, with the reason it waits when it cannot run yet."""
    tenant = _tenant(session, principal)
    result = job_service.submit(session, spec, tenant, idempotency_key)
    session.commit()
    if not result.created:
        response.status_code = status.HTTP_200_OK
    return _job_out(result.job, response)


@router.get("/jobs", response_model=Page[JobOut])
def list_jobs(
    session: SessionDep,
    principal: ReaderDep,
    page: PageDep,
    state: StateQuery = None,
    tenant: Annotated[str | None, Query(max_length=36, description="Admins: one tenant.")] = None,
) -> Page[JobOut]:
    """Your jobs, newest first (admins: everyone's)."""
    stmt = select(Job).order_by(Job.created_at.desc(), Job.id)
    scope = _scope(principal)
    if scope is not None:
        stmt = stmt.where(Job.tenant_id == scope)
    elif tenant:
        stmt = stmt.where(Job.tenant_id == tenant)
    if state:
        stmt = stmt.where(Job.state == state)
    items, total = fetch_page(session, stmt, page)
    return Page(
        items=[_job_out(j) for j in items], total=total, limit=page.limit, offset=page.offset
    )


@router.get("/jobs/{job_id}", response_model=JobOut)
def get_job(job_id: str, session: SessionDep, principal: ReaderDep, response: Response) -> JobOut:
    """One job; its ETag is the version to send in If-Match when cancelling."""
    return _job_out(job_service.get_job(session, job_id, _scope(principal)), response)


@router.post("/jobs/{job_id}/cancel", response_model=JobOut)
def cancel_job(
    job_id: str,
    session: SessionDep,
    principal: ReaderDep,
    response: Response,
    if_match: Annotated[
        str | None, Header(description="ETag from a GET: refuse if changed.")
    ] = None,
) -> JobOut:
    """Cancel a job that has not ended; its GPUs are released at once."""
    job = job_service.get_job(session, job_id, _scope(principal))
    if if_match is not None and if_match.strip('W/"') != str(job.version):
        raise PreconditionFailed(
            f"job {job_id} changed (version {job.version}, state {job.state}); GET it and retry",
            field="If-Match",
        )
    job_service.cancel(session, job, f"cancelled by {principal.role}")
    session.commit()
    return _job_out(job, response)


_SSE_BATCH = 500


def _events_after(request: Request, job_id: str, after: int) -> tuple[list[dict[str, Any]], bool]:
    """Events after `after`, and whether they are the last: the job has ended and all are sent.

    The state is read before the events: the final transition commits its event together with
    the state, so a job seen ended here has every event visible to the read that follows.
    Reading them the other way round could end the stream before its last event."""
    with request.app.state.sessions() as session:
        state = session.scalar(select(Job.state).where(Job.id == job_id))
        rows = session.scalars(
            select(JobEvent)
            .where(JobEvent.job_id == job_id, JobEvent.id > after)
            .order_by(JobEvent.id)
            .limit(_SSE_BATCH)
        ).all()
        out = [JobEventOut.model_validate(e).model_dump(mode="json") for e in rows]
    return out, state in lifecycle.TERMINAL and len(rows) < _SSE_BATCH


@router.get(
    "/jobs/{job_id}/events",
    response_model=Page[JobEventOut],
    responses={200: {"content": {"text/event-stream": {}}, "description": "JSON page or SSE."}},
)
def job_events(
    job_id: str,
    request: Request,
    session: SessionDep,
    principal: ReaderDep,
    page: PageDep,
    stream: Annotated[bool, Query(description="Server-sent events until the job ends.")] = False,
    accept: Annotated[str | None, Header()] = None,
    last_event_id: Annotated[str | None, Header(max_length=20)] = None,
) -> Any:
    """State changes and progress, as a page of JSON or as server-sent events."""
    job_service.get_job(session, job_id, _scope(principal))
    if stream or (accept or "").startswith("text/event-stream"):
        try:
            start = int(last_event_id) if last_event_id else 0
        except ValueError:
            raise Invalid(
                "Last-Event-ID must be an event id (an integer)", field="Last-Event-ID"
            ) from None
        return StreamingResponse(_sse(request, job_id, start), media_type="text/event-stream")
    stmt = select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)
    items, total = fetch_page(session, stmt, page)
    return Page(
        items=[JobEventOut.model_validate(e) for e in items],
        total=total,
        limit=page.limit,
        offset=page.offset,
    )


async def _sse(request: Request, job_id: str, after: int) -> AsyncIterator[str]:
    """Poll the events table and forward new rows; end once the job has ended and all is sent."""
    while not await request.is_disconnected():
        batch, last = await run_in_threadpool(_events_after, request, job_id, after)
        for event in batch:
            after = event["id"]
            yield f"id: {after}\nevent: {event['kind']}\ndata: {json.dumps(event)}\n\n"
        if last:
            yield "event: end\ndata: {}\n\n"
            return
        if not batch:
            yield ": keep-alive\n\n"
        await asyncio.sleep(0.25)


@router.get("/jobs/{job_id}/metrics", response_model=Page[JobMetricOut])
def job_metrics(
    job_id: str, session: SessionDep, principal: ReaderDep, page: PageDep
) -> Page[JobMetricOut]:
    """Progress reports: step, loss, accuracy, step time (compute and communication), WAN bytes."""
    job_service.get_job(session, job_id, _scope(principal))
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
