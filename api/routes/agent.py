"""The agent protocol's server side: heartbeats renew leases, link reports update links."""

from __future__ import annotations

from fastapi import APIRouter, Request

from agents.protocol import Heartbeat, HeartbeatAck, LinkReport
from api.deps import AgentDep, SessionDep
from api.schemas import LinkReportAck
from controller import resources
from controller.errors import Forbidden

router = APIRouter(prefix="/v1/agent", tags=["agent protocol"])


def _bound(principal_scope: str | None, cluster: str) -> None:
    if principal_scope != cluster:
        raise Forbidden(
            f"this agent key is bound to cluster {principal_scope!r} and cannot report for "
            f"{cluster!r}; use the key minted for {cluster!r}",
            field="cluster",
        )


@router.post("/heartbeat", response_model=HeartbeatAck)
def heartbeat(
    body: Heartbeat, request: Request, session: SessionDep, agent: AgentDep
) -> HeartbeatAck:
    """Renew the cluster's lease and sync its GPUs; the answer lists peers to probe."""
    _bound(agent.scope, body.cluster)
    state = request.app.state
    result = resources.ingest_heartbeat(session, body, state.lease_policy)
    session.commit()
    if result.changed_state:
        state.peers.invalidate()
    state.metrics.heartbeats.inc()
    peers, _version = state.peers.get(session)
    settings = state.settings
    return HeartbeatAck(
        cluster=body.cluster,
        state=result.state,
        lease_expires_at=result.lease_expires_at,
        heartbeat_interval_s=settings.heartbeat_interval_s,
        probe_interval_s=settings.probe_interval_s,
        probe_bytes=settings.probe_bytes,
        peers=[p for p in peers if p.cluster != body.cluster],
    )


@router.post("/links", response_model=LinkReportAck)
def links(body: LinkReport, session: SessionDep, agent: AgentDep) -> LinkReportAck:
    """Store the reporting cluster's measured links."""
    _bound(agent.scope, body.cluster)
    stored = resources.ingest_links(session, body)
    session.commit()
    return LinkReportAck(stored=stored)
