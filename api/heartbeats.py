"""Group commit for heartbeats: beats that arrive together are written in one transaction.

Each beat used to cost a transaction of its own, and its commit (an fsync on SQLite, a round
trip and a WAL flush on PostgreSQL) was most of its price. Here the first beat to find no
open batch opens one and leads it: it waits for a writer (`workers` at a time: one on SQLite,
whose writes serialize anyway, a few on PostgreSQL), then `window_s` more, and every beat
that arrives meanwhile joins. The leader closes the batch and writes it on a worker thread
in one transaction; every beat in it is answered only after that commit, so an agent still
gets its 200 once its report is durable.

Within a batch the latest report of each cluster wins (arrival order): an earlier one would
be overwritten in the same transaction anyway, and both are answered with the lease the
commit gave. A report the domain refuses (an unknown cluster, say) fails alone, with its own
problem, since it wrote nothing; a database error fails the whole batch, and every beat in it
is answered 503 with Retry-After (the agent retries), never 500.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import anyio
from sqlalchemy.orm import Session, sessionmaker

from agents.protocol import Heartbeat, PeerProbe
from controller import resources
from controller.clock import db_now
from controller.errors import CpnError
from controller.leases import LeasePolicy
from controller.resources import HeartbeatResult, PeerTable

log = logging.getLogger("cpn.api")

Outcome = HeartbeatResult | CpnError
"""What one cluster's report came to: its renewed lease, or the problem it was refused with."""


class BatchFailed(CpnError):
    """The transaction of a heartbeat batch failed: nothing in it was stored; retry."""

    status, slug, title = 503, "unavailable", "Service unavailable"
    retry_after_s = 1


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


@dataclass
class _Batch:
    bodies: list[Heartbeat] = field(default_factory=list)
    done: anyio.Event = field(default_factory=anyio.Event)
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    peers: list[PeerProbe] = field(default_factory=list)
    error: BaseException | None = None


class HeartbeatBatcher:
    """Coalesces concurrent heartbeats into group commits (see the module's docstring).

    `window_s`: how long a leader that got a writer still waits for more beats (0: none; the
    wait for a busy writer batches anyway). `max_batch`: a batch that reaches it closes at
    once and the next beat opens another."""

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
        self.sessions = sessions
        self.policy = policy
        self.peers = peers
        self.window_s = window_s
        self.max_batch = max_batch
        self.writers = anyio.CapacityLimiter(workers)
        self._open: _Batch | None = None
        self.batches = 0
        self.beats = 0

    async def ingest(self, body: Heartbeat) -> tuple[HeartbeatResult, list[PeerProbe]]:
        """Write `body` with whatever beats arrive with it; return once that is durable."""
        batch = self._open
        if batch is not None:
            batch.bodies.append(body)
            if len(batch.bodies) >= self.max_batch:
                self._open = None
            await batch.done.wait()
        else:
            batch = self._open = _Batch([body])
            # Shielded: the beats that joined wait on this batch, so neither a cancelled
            # leader (its client gone) nor anything else may leave it unwritten.
            with anyio.CancelScope(shield=True):
                await self._lead(batch)
        if batch.error is not None:
            raise BatchFailed(
                "the database could not store this heartbeat (its batch was rolled back); "
                "retry shortly"
            ) from batch.error
        outcome = batch.outcomes[body.cluster]
        if isinstance(outcome, CpnError):
            raise outcome
        return outcome, batch.peers

    async def _lead(self, batch: _Batch) -> None:
        try:
            async with self.writers:
                if self.window_s > 0 and self._open is batch:
                    await anyio.sleep(self.window_s)
                if self._open is batch:
                    self._open = None
                bodies = list(batch.bodies)
                batch.outcomes, batch.peers = await anyio.to_thread.run_sync(
                    write_batch, self.sessions, bodies, self.policy, self.peers
                )
                self.batches += 1
                self.beats += len(bodies)
        except Exception as exc:
            log.error("a batch of %d heartbeats failed: %s", len(batch.bodies), exc)
            batch.error = exc
        finally:
            if self._open is batch:
                self._open = None
            batch.done.set()
