"""The controller: one loop per `cpn serve` that places jobs, runs them and recovers them.

Replicas register in the database and heartbeat there; a job is run only by the replica that
owns it, and a job whose owner stopped heartbeating is adopted by a live replica (restarted
from its last checkpoint). Heartbeats and liveness are judged by the database's clock
(`controller.store.clock`), so a replica whose own clock is off neither looks dead nor declares the
others dead. Adopting a job bumps its fencing epoch (`Job.fence`): the old run, should it
still be alive, writes no more progress and settles nothing. On SQLite only one replica may
run the loop.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import delete, func, or_, select, update
from sqlalchemy.orm import Session, sessionmaker

import scheduler
from controller.loop.launcher import Launcher, LauncherConfig
from controller.loop.placement import Placed, place_pending
from controller.money.metering import pause_billing
from controller.network.snapshot import Calibration, calibration
from controller.store.clock import DbClock, clock_of
from controller.store.models import Job, JobEvent, Replica, StepObservation
from grammar.states import ACTIVE

log = logging.getLogger("cpn.controller")


class ReplicaConflict(RuntimeError):
    """Another replica runs the loop on a database that supports only one."""


def live_replicas(session: Session, ttl_s: float, now: datetime | None = None) -> list[Replica]:
    """Replicas seen within `ttl_s` of `now` (default: the database's clock)."""
    cutoff = (now or clock_of(session).now(session)) - timedelta(seconds=ttl_s)
    return list(session.scalars(select(Replica).where(Replica.seen_at >= cutoff)))


def check_single_replica(
    factory: sessionmaker[Session], ttl_s: float, me: str | None = None
) -> None:
    """On SQLite: raise ReplicaConflict (saying what to do) if another replica is alive."""
    with factory() as session:
        others = [r for r in live_replicas(session, ttl_s) if r.id != me]
    if others:
        r = others[0]
        raise ReplicaConflict(
            f"another cpn serve (replica {r.id}, pid {r.pid} on {r.host or 'this host'}) runs the "
            "controller on this SQLite database, which supports one replica; stop it, or use "
            "PostgreSQL (CPN_DATABASE_URL) to run several"
        )


class Controller:
    def __init__(
        self,
        factory: sessionmaker[Session],
        *,
        sqlite: bool,
        interval_s: float = 1.0,
        replica_ttl_s: float = 15.0,
        checkpoint_root: str | Path = Path("var/checkpoints"),
        ray_address: str | None = None,
        max_attempts: int = 3,
        ray_num_cpus: int | None = None,
        launch: bool = True,
        clock: DbClock | None = None,
    ) -> None:
        self.launch = launch
        self.factory = factory
        self.clock = clock or clock_of(factory)
        """The database's clock: this replica's `seen_at` and its judgement of the others'."""
        self.sqlite = sqlite
        self.interval_s = interval_s
        self.replica_ttl_s = replica_ttl_s
        self.id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.launcher = Launcher(
            factory,
            LauncherConfig(
                replica_id=self.id,
                checkpoint_root=checkpoint_root,
                ray_address=ray_address,
                max_attempts=max_attempts,
                ray_num_cpus=ray_num_cpus,
            ),
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpn-controller", daemon=True)
        self._calibration: Calibration | None = None
        self._waits: dict[str, scheduler.Wait] = {}  # see `place_pending`
        self._observed_upto: int | None = None  # newest StepObservation fitted
        self._ticks = 0
        self.on_placed: Callable[[Placed], None] | None = None
        """Told of each job this replica places (the API's metrics time placements)."""

    def start(self) -> None:
        if self.sqlite:
            check_single_replica(self.factory, self.replica_ttl_s)
        self._heartbeat()
        self._thread.start()
        log.info("controller replica %s started", self.id)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.launcher.shutdown()
        with self.factory() as session, session.begin():
            session.execute(delete(Replica).where(Replica.id == self.id))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception:  # the loop must outlive any one bad pass
                log.exception("controller tick failed; retrying next interval")

    def tick(self) -> None:
        self._ticks += 1
        self._heartbeat()
        self._adopt_orphans()
        self._recalibrate()
        placed = place_pending(self.factory, self.id, self._calibration, waits=self._waits)
        if self.on_placed is not None:
            for one in placed:
                self.on_placed(one)
        if not self.launch:
            return
        self.launcher.tick()
        with self.factory() as session:
            mine = session.scalars(
                select(Job.id).where(Job.owner == self.id, Job.state.in_(ACTIVE))
            ).all()
        for job_id in mine:
            if job_id not in self.launcher.handles:
                self.launcher.launch(job_id)

    def _heartbeat(self) -> None:
        with self.factory() as session, session.begin():
            now = self.clock.now(session)
            row = session.get(Replica, self.id)
            if row is None:
                session.add(
                    Replica(
                        id=self.id,
                        host=socket.gethostname(),
                        pid=os.getpid(),
                        started_at=now,
                        seen_at=now,
                    )
                )
            else:
                row.seen_at = now

    def _adopt_orphans(self) -> None:
        """Take over jobs whose owner is gone: their runs died with it; restart from checkpoint.

        Each adoption bumps the job's fencing epoch, in the same conditional UPDATE that takes
        it: should the old run be alive after all (its replica only paused), its progress and
        settlement are refused from then on, and its checkpoints by the store."""
        with self.factory() as session, session.begin():
            now = self.clock.now(session)
            live = {r.id for r in live_replicas(session, self.replica_ttl_s, now)}
            orphans = session.execute(
                select(Job.id, Job.owner).where(
                    Job.state.in_(ACTIVE),
                    or_(Job.owner.is_(None), Job.owner.not_in(live)),
                )
            ).all()
            seen = dict(
                session.execute(
                    select(Replica.id, Replica.seen_at).where(
                        Replica.id.in_([o for _, o in orphans if o])
                    )
                ).all()
            )
            for job_id, old in orphans:
                taken = session.execute(
                    update(Job)
                    .where(
                        Job.id == job_id,
                        Job.state.in_(ACTIVE),
                        (Job.owner == old) if old else Job.owner.is_(None),
                    )
                    .values(owner=self.id, fence=Job.fence + 1, version=Job.version + 1)
                    .execution_options(synchronize_session=False)
                )
                if taken.rowcount == 1:  # type: ignore[attr-defined]
                    # Its run died with its replica: bill up to the replica's last heartbeat
                    # (or now, if it left cleanly), nothing until the relaunch.
                    job = session.get(Job, job_id)
                    assert job is not None
                    pause_billing(session, job, min(seen.get(old, now) if old else now, now))
                    session.add(
                        JobEvent(
                            job_id=job_id,
                            kind="info",
                            message=f"adopted by replica {self.id} (owner {old} is gone); "
                            "restarting from the last checkpoint",
                        )
                    )
                    log.warning("adopted job %s from %s", job_id, old)

    def _recalibrate(self) -> None:
        """Fit GPU efficiency from observed step times so estimates improve as jobs run: on
        the first pass after new observations, so the next job placed already uses them."""
        with self.factory() as session:
            newest = session.scalar(select(func.max(StepObservation.id)))
            if newest is None or newest == self._observed_upto:
                return
            self._observed_upto = newest
            self._calibration = calibration(session)
        self.launcher.calibration = self._calibration
        log.info("calibrated efficiency: %s", self._calibration.fleet)
