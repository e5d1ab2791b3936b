"""Cluster health from agent leases, as Kubernetes node leases do it.

A cluster is READY while heartbeats arrive, SUSPECT once a beat is missed, DOWN when its lease
(last heartbeat + grace) expires, and READY again at its next heartbeat. Heartbeats are stamped
and leases judged by the database's clock (`controller.store.clock`), so replicas whose clocks
disagree agree on every lease.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from controller.store.clock import clock_of
from controller.store.models import Cluster, ClusterTransition
from grammar.states import LIVE, ClusterState

log = logging.getLogger("cpn.leases")

MISSED_BEAT_FACTOR = 1.5
"""A beat counts as missed after 1.5 intervals, so normal jitter never flips a cluster."""


@dataclass(frozen=True)
class LeasePolicy:
    heartbeat_interval_s: float
    grace_s: float

    def expiry(self, heartbeat_at: datetime) -> datetime:
        return heartbeat_at + timedelta(seconds=self.grace_s)

    def state_at(
        self, now: datetime, last_heartbeat: datetime | None, current: ClusterState
    ) -> ClusterState:
        """The state a cluster should be in at `now`; PENDING stays until a first heartbeat."""
        if last_heartbeat is None:
            return current
        silent = (now - last_heartbeat).total_seconds()
        if silent > self.grace_s:
            return ClusterState.DOWN
        if silent > self.heartbeat_interval_s * MISSED_BEAT_FACTOR:
            return ClusterState.SUSPECT
        return ClusterState.READY


def check_leases(
    factory: sessionmaker[Session], policy: LeasePolicy, now: datetime | None = None
) -> list[tuple[str, str, str]]:
    """Move clusters whose heartbeats stopped to SUSPECT/DOWN; return (name, from, to).

    Each move is a conditional UPDATE on the state read, so with several controller replicas
    exactly one of them records a given transition. `now`: the database's clock unless given.
    """
    moved: list[tuple[str, str, str]] = []
    with factory() as session:
        now = now or clock_of(session).now(session)
        rows = session.execute(
            select(Cluster.id, Cluster.name, Cluster.state, Cluster.last_heartbeat_at).where(
                Cluster.state.in_(LIVE)
            )
        ).all()
    for cid, name, state, last in rows:
        target = policy.state_at(now, last, state)
        if target == state or target == ClusterState.READY:
            continue
        silent = (now - last).total_seconds() if last else 0.0
        reason = f"no heartbeat for {silent:.1f}s" + (
            f" (lease grace {policy.grace_s:g}s expired)" if target == ClusterState.DOWN else ""
        )
        with factory() as session, session.begin():
            result = session.execute(
                update(Cluster)
                .where(Cluster.id == cid, Cluster.state == state, Cluster.last_heartbeat_at == last)
                .values(state=target, version=Cluster.version + 1)
                .execution_options(synchronize_session=False)
            )
            if result.rowcount != 1:  # type: ignore[attr-defined]
                continue  # a heartbeat or another replica got there first
            session.add(
                ClusterTransition(cluster_id=cid, from_state=state, to_state=target, reason=reason)
            )
        moved.append((name, state, target))
        log.warning("cluster %s %s -> %s: %s", name, state, target, reason)
    return moved


class LeaseMonitor:
    """Runs `check_leases` every `period` seconds on a daemon thread until stopped."""

    def __init__(
        self,
        factory: sessionmaker[Session],
        policy: LeasePolicy,
        period: float,
        on_moved: Callable[[list[tuple[str, str, str]]], None] | None = None,
    ) -> None:
        self._factory = factory
        self._policy = policy
        self._period = period
        self._on_moved = on_moved
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpn-lease-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            try:
                moved = check_leases(self._factory, self._policy)
                if moved and self._on_moved:
                    self._on_moved(moved)
            except Exception:  # the loop must outlive a database hiccup
                log.exception("lease check failed; retrying next period")
