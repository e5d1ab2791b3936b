"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Depends, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from sqlalchemy import func, select

from api.deps import app_state, request_principal
from api.problems import problem
from controller.access.keys import Principal
from controller.jobs.lifecycle import STATES
from controller.network import allocations
from controller.network.resources import effective_links
from controller.store.migrate import pending_reason
from controller.store.models import Cluster, ClusterGpus, Job, Link, Usage
from grammar.states import ClusterState

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
    """Prometheus exposition: HTTP, heartbeats, clusters and jobs by state, GPUs by model,
    placement latency, link bandwidth and RTT, WAN bytes metered per link."""
    state = app_state(request)
    m = state.metrics
    with state.sessions() as session:
        counts = dict(
            session.execute(select(Cluster.state, func.count()).group_by(Cluster.state)).all()
        )
        gpus = session.execute(
            select(
                ClusterGpus.model,
                func.sum(ClusterGpus.count),
                func.sum(ClusterGpus.allocatable),
                func.sum(ClusterGpus.in_use),
            ).group_by(ClusterGpus.model)
        ).all()
        jobs = dict(session.execute(select(Job.state, func.count()).group_by(Job.state)).all())
        links = [
            (k.src.name, k.dst.name, k.source, k.bandwidth_gbps, k.rtt_ms)
            for k in effective_links(session.scalars(select(Link)).unique().all())
        ]
        wan_ports = allocations.ports(session)
        wan = session.execute(
            select(Usage.cluster, Usage.dst_cluster, func.sum(Usage.quantity))
            .where(Usage.kind == "wan_bytes")
            .group_by(Usage.cluster, Usage.dst_cluster)
        ).all()
    m.cluster_states.set_all({(s,): counts.get(s, 0) for s in ClusterState})
    m.jobs.set_all({(s,): jobs.get(s, 0) for s in STATES})
    m.gpus.set_all(
        {
            (model, kind): value or 0
            for model, count, alloc, in_use in gpus
            for kind, value in (("count", count), ("allocatable", alloc), ("in_use", in_use))
        }
    )
    m.link_bandwidth.set_all({(src, dst, source): gbps for src, dst, source, gbps, _ in links})
    m.link_rtt.set_all({(src, dst, source): rtt for src, dst, source, _, rtt in links})
    port_values: dict[tuple[str, ...], float] = {}
    for port in wan_ports:
        port_values[(port.cluster, port.direction, "reserved")] = port.reserved_kbps * 1000.0
        if port.capacity_kbps is not None:
            port_values[(port.cluster, port.direction, "capacity")] = port.capacity_kbps * 1000.0
    m.wan_ports.set_all(port_values)
    m.wan_bytes.set_all({(src, dst or ""): float(total or 0) for src, dst, total in wan})
    return Response(m.exposition(), media_type=CONTENT_TYPE_LATEST)
