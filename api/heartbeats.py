"""Group commit for heartbeats (`api.group_commit`): beats that arrive together are written
in one transaction, so an agent still gets its 200 once its report is durable.

Within a batch the latest report of each cluster wins (arrival order): an earlier one would
be overwritten in the same transaction anyway, and both are answered with the lease the
commit gave. A report the domain refuses (an unknown cluster, say) fails alone, with its own
problem, since it wrote nothing; a database error fails the whole batch, and every beat in it
is answered 503 with Retry-After (the agent retries), never 500.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy.orm import Session, sessionmaker

from agents.protocol import Heartbeat, PeerProbe
from api.group_commit import GroupCommit
from controller.network import resources
from controller.network.leases import LeasePolicy
from controller.network.resources import HeartbeatResult, PeerTable
from controller.store.clock import db_now
from controller.values.errors import CpnError

Outcome = HeartbeatResult | CpnError
"""What one cluster's report came to: its renewed lease, or the problem it was refused with."""
Answer = tuple[HeartbeatResult, list[PeerProbe]]
"""A stored beat's answer: its lease, and the peer table the agent probes."""


def latest_per_cluster(bodies: Sequence[Heartbeat]) -> dict[str, Heartbeat]:
    """The report each cluster's batch entry stands for: its last one (arrival order)."""
    latest: dict[str, Heartbeat] = {}
    for body in bodies:
        latest.pop(body.cluster, None)  # re-inserted: written in the order the last ones came
        latest[body.cluster] = body
    return latest


def write_batch(
    sessions: sessionmaker[Session],
    bodies: Sequence[Heartbeat],
    policy: LeasePolicy,
    peers: PeerTable,
) -> tuple[dict[str, Outcome], list[PeerProbe]]:
    """Ingest `bodies` (latest per cluster) in one transaction; each cluster's outcome, and
    the peer table to answer with. A database error propagates: nothing was committed."""
    with sessions() as session:
        now = db_now(session)
        latest = latest_per_cluster(bodies)
        outcomes = resources.ingest_heartbeats(session, list(latest.values()), policy, now)
        session.commit()
        changed = any(isinstance(o, HeartbeatResult) and o.changed_state for o in outcomes.values())
        if changed:
            peers.invalidate()
        table, _version = peers.get(session)
    return outcomes, table


class HeartbeatBatcher(GroupCommit[Heartbeat, Answer]):
    """Coalesces concurrent heartbeats into group commits (`api.group_commit`)."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        policy: LeasePolicy,
        peers: PeerTable,
        *,
        workers: int,
        window_s: float = 0.002,
        max_batch: int = 500,
    ) -> None:
        super().__init__(
            self._write, what="heartbeat", workers=workers, window_s=window_s, max_batch=max_batch
        )
        self.sessions = sessions
        self.policy = policy
        self.peers = peers

    def _write(self, bodies: list[Heartbeat]) -> list[Answer | CpnError]:
        outcomes, table = write_batch(self.sessions, bodies, self.policy, self.peers)
        answers: list[Answer | CpnError] = []
        for body in bodies:
            outcome = outcomes[body.cluster]
            answers.append(outcome if isinstance(outcome, CpnError) else (outcome, table))
        return answers

    async def ingest(self, body: Heartbeat) -> Answer:
        """Write `body` with whatever beats arrive with it; return once that is durable."""
        return await self.run(body)
