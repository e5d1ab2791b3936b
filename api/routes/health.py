"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import logging
from collections import defaultdict

from fastapi import APIRouter, Depends, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.deps import app_state, request_principal
from api.metrics import Metrics
from api.problems import problem
from controller.access.keys import Principal
from controller.jobs.lifecycle import STATES
from controller.network import allocations
from controller.network.resources import effective_links
from controller.store.migrate import pending_reason
from controller.store.models import (
    Allocation,
    Cluster,
    ClusterGpus,
    Job,
    Link,
    Payout,
    Posting,
    Provider,
    Tenant,
    Usage,
)
from grammar.states import TERMINAL, ClusterState

router = APIRouter(tags=["health"])
log = logging.getLogger("cpn.api")


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """The process is up and serving."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "Not ready; the server's log says why."}})
def readyz(request: Request) -> JSONResponse:
    """Ready when the database answers and its migrations are current.

    Unauthenticated, so it says only ready or not: why not (a database error names hosts
    and users) goes to the log."""
    reason = pending_reason(app_state(request).engine)
    if reason:
        log.warning("not ready: %s", reason)
        return problem(
            503,
            "Not ready",
            "the control plane is not ready; its log says why",
            slug="not-ready",
            instance="/readyz",
        )
    return JSONResponse({"status": "ready"})


async def authenticated(request: Request) -> Principal:
    """The caller's key, for routes public unless a setting protects them (so their OpenAPI
    entry claims no security scheme: the header is read here, not declared)."""
    return await request_principal(request)


async def metrics_reader(request: Request) -> None:
    """With CPN_PROTECT_METRICS, only admin keys read /metrics; otherwise anyone."""
    if not app_state(request).settings.protect_metrics:
        return
    principal = await authenticated(request)
    if principal.role != "admin":
        raise HTTPException(403, "/metrics needs an admin key (CPN_PROTECT_METRICS is on)")


@router.get("/metrics", response_class=Response, dependencies=[Depends(metrics_reader)])
def metrics(request: Request) -> Response:
    """Prometheus exposition: HTTP, heartbeats, clusters and jobs by state, GPUs by model and
    cluster, placement latency, link bandwidth and RTT, WAN bytes metered per link, and each
    tenant's queue, GPUs, quota and money."""
    state = app_state(request)
    with state.sessions() as session:
        _scrape(session, state.metrics)
    return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


def _scrape(session: Session, m: Metrics) -> None:
    """Set every database-backed metric from one read of the database."""
    counts = dict(
        session.execute(select(Cluster.state, func.count()).group_by(Cluster.state)).all()
    )
    gpus = session.execute(
        select(
            Cluster.name,
            ClusterGpus.model,
            func.sum(ClusterGpus.count),
            func.sum(ClusterGpus.allocatable),
            func.sum(ClusterGpus.in_use),
        )
        .join(Cluster, Cluster.id == ClusterGpus.cluster_id)
        .group_by(Cluster.name, ClusterGpus.model)
    ).all()
    jobs = dict(session.execute(select(Job.state, func.count()).group_by(Job.state)).all())
    effective = effective_links(session.scalars(select(Link)).unique().all())
    links = [(k.src.name, k.dst.name, k.source, k.bandwidth_gbps, k.rtt_ms) for k in effective]
    free = {(k.src.name, k.dst.name): k.free_gbps for k in effective if k.free_gbps is not None}
    wan_ports = allocations.ports(session)
    wan = session.execute(
        select(Usage.cluster, Usage.dst_cluster, func.sum(Usage.quantity))
        .where(Usage.kind == "wan_bytes")
        .group_by(Usage.cluster, Usage.dst_cluster)
    ).all()
    unfinished = [s for s in STATES if s not in TERMINAL]
    queued = session.execute(
        select(Tenant.name, Job.state, func.count())
        .join(Tenant, Tenant.id == Job.tenant_id)
        .where(Job.state.in_(unfinished))
        .group_by(Tenant.name, Job.state)
    ).all()
    held = session.execute(
        select(
            Tenant.name,
            Cluster.name,
            func.sum(Allocation.gpus),
            func.count(Allocation.job_id.distinct()),
        )
        .join(Job, Job.id == Allocation.job_id)
        .join(Tenant, Tenant.id == Job.tenant_id)
        .join(Cluster, Cluster.id == Allocation.cluster_id)
        .where(Allocation.ended_at.is_(None))
        .group_by(Tenant.name, Cluster.name)
    ).all()
    tenants = session.execute(
        select(
            Tenant.name, Tenant.gpu_quota, Tenant.budget, Tenant.charged_micros, Tenant.held_micros
        ).where(Tenant.deleted_at.is_(None))
    ).all()

    m.cluster_states.set_all({(s,): counts.get(s, 0) for s in ClusterState})
    m.jobs.set_all({(s,): jobs.get(s, 0) for s in STATES})
    by_model: dict[tuple[str, ...], float] = defaultdict(float)
    by_cluster: dict[tuple[str, ...], float] = defaultdict(float)
    for cluster, model, count, alloc, in_use in gpus:
        for kind, value in (("count", count), ("allocatable", alloc), ("in_use", in_use)):
            by_model[(model, kind)] += value or 0
            by_cluster[(cluster, kind)] += value or 0
    m.gpus.set_all(by_model)
    m.cluster_gpus.set_all(by_cluster)
    m.link_bandwidth.set_all({(s, d, src): gbps * 1e9 / 8 for s, d, src, gbps, _ in links})
    m.link_rtt.set_all({(s, d, src): rtt / 1000 for s, d, src, _, rtt in links})
    m.link_free.set_all({key: gbps * 1e9 / 8 for key, gbps in free.items()})
    port_values: dict[tuple[str, ...], float] = {}
    for port in wan_ports:
        port_values[(port.cluster, port.direction, "reserved")] = port.reserved_kbps * 125.0
        if port.capacity_kbps is not None:
            port_values[(port.cluster, port.direction, "capacity")] = port.capacity_kbps * 125.0
    m.wan_ports.set_all(port_values)
    m.wan_bytes.set_all({(src, dst or ""): float(total or 0) for src, dst, total in wan})

    live = {name for name, *_ in tenants}
    m.tenant_jobs.set_all(
        {(t, s): 0.0 for t in live for s in unfinished}
        | {(t, str(s)): float(n) for t, s, n in queued if t in live}
    )
    tenant_gpus: dict[tuple[str, ...], float] = {(t, "in_use"): 0.0 for t in live}
    cluster_jobs: dict[tuple[str, ...], float] = defaultdict(float)
    for tenant, cluster, n_gpus, n_jobs in held:
        if tenant in live:
            tenant_gpus[(tenant, "in_use")] += n_gpus or 0
        cluster_jobs[(cluster,)] += n_jobs
    money: dict[tuple[str, ...], float] = {}
    for name, quota, budget, charged, held_micros in tenants:
        if quota is not None:
            tenant_gpus[(name, "quota")] = float(quota)
        if budget is not None:
            money[(name, "budget")] = float(budget)
        money[(name, "charged")] = charged / 1e6
        money[(name, "held")] = held_micros / 1e6
    m.tenant_gpus.set_all(tenant_gpus)
    m.tenant_dollars.set_all(money)
    earned = dict(
        session.execute(
            select(Posting.party_id, func.sum(Posting.amount))
            .where(Posting.account == "provider")
            .group_by(Posting.party_id)
        ).all()
    )
    paid = dict(
        session.execute(
            select(Payout.provider_id, func.sum(Payout.amount)).group_by(Payout.provider_id)
        ).all()
    )
    books: dict[tuple[str, ...], float] = {}
    for pid, name in session.execute(select(Provider.id, Provider.name)):
        e, p = float(earned.get(pid) or 0), float(paid.get(pid) or 0)
        books |= {(name, "earned"): e, (name, "paid"): p, (name, "owed"): e - p}
    m.provider_dollars.set_all(books)
    m.cluster_jobs.set_all(
        {(c.name,): cluster_jobs.get((c.name,), 0.0) for c in session.scalars(select(Cluster))}
    )
