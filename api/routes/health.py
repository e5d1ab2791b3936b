"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import func, select

from api.problems import problem
from controller.lifecycle import STATES
from controller.migrate import pending_reason
from controller.models import Cluster, GpuInventory, Job

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """The process is up and serving."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "Not ready; the detail says why."}})
def readyz(request: Request) -> JSONResponse:
    """Ready when the database answers and its migrations are current."""
    reason = pending_reason(request.app.state.engine)
    if reason:
        return problem(503, "Not ready", reason, slug="not-ready", instance="/readyz")
    return JSONResponse({"status": "ready"})


@router.get("/metrics", response_class=Response)
def metrics(request: Request) -> Response:
    """Prometheus exposition: HTTP, heartbeats, clusters and jobs by state, GPUs by model."""
    state = request.app.state
    m = state.metrics
    with state.sessions() as session:
        counts = dict(
            session.execute(select(Cluster.state, func.count()).group_by(Cluster.state)).all()
        )
        gpus = session.execute(
            select(
                GpuInventory.model,
                func.sum(GpuInventory.count),
                func.sum(GpuInventory.allocatable),
                func.sum(GpuInventory.in_use),
            ).group_by(GpuInventory.model)
        ).all()
        jobs = dict(session.execute(select(Job.state, func.count()).group_by(Job.state)).all())
    for s in ("PENDING", "READY", "SUSPECT", "DOWN"):
        m.cluster_states.labels(s).set(counts.get(s, 0))
    for s in STATES:
        m.jobs.labels(s).set(jobs.get(s, 0))
    for model, count, alloc, in_use in gpus:
        m.gpus.labels(model, "count").set(count or 0)
        m.gpus.labels(model, "allocatable").set(alloc or 0)
        m.gpus.labels(model, "in_use").set(in_use or 0)
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)
