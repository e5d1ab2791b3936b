"""The agent protocol's server side: heartbeats renew leases, link reports update links."""

from __future__ import annotations

from typing import Any

import anyio
from fastapi import APIRouter, Request

from agents.protocol import Heartbeat, HeartbeatAck, LinkReport
from api.deps import AgentDep, app_state
from api.schemas import LinkReportAck
from controller.network import resources
from controller.values.errors import Forbidden

router = APIRouter(prefix="/v1/agent", tags=["agent protocol"])


def _bound(principal_scope: str | None, cluster: str) -> None:
    if principal_scope != cluster:
        raise Forbidden(
            f"this agent key is bound to cluster {principal_scope!r} and cannot report for "
            f"{cluster!r}; use the key minted for {cluster!r}",
            field="cluster",
        )


@router.post("/heartbeat", response_model=HeartbeatAck)
async def heartbeat(body: Heartbeat, request: Request, agent: AgentDep) -> HeartbeatAck:
    """Renew the cluster's lease and sync its GPUs; the answer lists peers to probe.

    The control plane's hot path: beats that arrive together are written in one transaction
    (a group commit, `api.heartbeats`) on a worker thread of their own, with a connection
    from the agents' own pool (tenant requests and streams never hold those); each is
    answered once its batch has committed. A failed batch answers 503 with Retry-After.
    """
    _bound(agent.scope, body.cluster)
    resources.check_gpus(body.gpus)  # refused alone, before it joins a batch
    state = app_state(request)
    result, peers = await state.heartbeats.ingest(body)
    state.metrics.heartbeats.inc()
    settings = state.settings
    return HeartbeatAck(
        cluster=body.cluster,
        state=result.state,
        lease_expires_at=result.lease_expires_at,
        heartbeat_interval_s=settings.heartbeat_interval_s,
        probe_interval_s=settings.probe_interval_s,
        probe_bytes=settings.probe_bytes,
        peers=state.peers.visible(body.cluster, peers),
    )


def _store_links(state: Any, body: LinkReport) -> int:
    with state.agent_sessions() as session:
        stored = resources.ingest_links(session, body, discovery=state.settings.link_discovery)
        session.commit()
    return stored


@router.post("/links", response_model=LinkReportAck)
async def links(body: LinkReport, request: Request, agent: AgentDep) -> LinkReportAck:
    """Store the reporting cluster's measured links (the agents' threads and pool, as beats)."""
    _bound(agent.scope, body.cluster)
    state = app_state(request)
    stored = await anyio.to_thread.run_sync(_store_links, state, body, limiter=state.agent_threads)
    return LinkReportAck(stored=stored)
