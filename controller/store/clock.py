"""The database's clock: the one time every replica judges leases and liveness by.

Replicas write times (a replica's `seen_at`, a cluster's lease) that other replicas compare
with their own "now"; with each replica's wall clock, a replica whose clock runs an hour
ahead would declare every other one dead and adopt their jobs, or keep an expired lease
alive. As Kubernetes' and SkyPilot's leases do, the times that decide liveness come from one
clock: the database server's. On PostgreSQL the offset between the server's clock and this
process's is sampled (`SELECT clock_timestamp()`, the midpoint of the round trip) and kept
for `refresh_s` seconds, so the hot paths (a heartbeat, a lease check) cost no round trip;
on SQLite the database lives on this host (and serves one replica), so its clock is the local
one.

A clock is kept per engine (`clock_of`); a test or a process whose local time must come
from elsewhere installs its own (`use_clock`) with the local time source it wants.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from datetime import datetime, timedelta

from sqlalchemy import Connection, Engine, text
from sqlalchemy.orm import Session, sessionmaker

from controller.store.models import utcnow

log = logging.getLogger("cpn.clock")

REFRESH_S = 5.0
"""How long a sampled offset is used before it is sampled again."""

_SERVER_NOW = text("SELECT clock_timestamp()")

Bind = Engine | Connection | Session | sessionmaker[Session]


class DbClock:
    """The database server's time, read as the local time plus a sampled offset.

    `local` is this process's time source (UTC-aware); `monotonic` paces the refresh, so a
    local clock that jumps never delays or hurries it.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        local: Callable[[], datetime] = utcnow,
        refresh_s: float = REFRESH_S,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.local = local
        self.refresh_s = refresh_s
        self.monotonic = monotonic
        self.server_side = engine.dialect.name == "postgresql"
        self.offset = timedelta(0)
        """Server time minus local time, as last sampled."""
        self._sampled_at: float | None = None
        self._lock = threading.Lock()

    def now(self, bind: Session | Connection | None = None) -> datetime:
        """The database's time now. `bind`: a session or connection to sample on when the
        offset is due (inside the caller's transaction: no second connection is taken)."""
        if self.server_side and self._due():
            self._refresh(bind)
        return self.local() + self.offset

    def _due(self) -> bool:
        sampled = self._sampled_at
        return sampled is None or self.monotonic() - sampled >= self.refresh_s

    def _refresh(self, bind: Session | Connection | None) -> None:
        # One thread samples; the others go on with the offset they have, once there is one.
        if not self._lock.acquire(blocking=self._sampled_at is None):
            return
        try:
            if not self._due():  # another thread sampled while this one waited
                return
            if isinstance(bind, Session):
                self._sample(bind.connection())
            elif bind is not None:
                self._sample(bind)
            else:
                with self.engine.connect() as conn:
                    self._sample(conn)
        finally:
            self._lock.release()

    def _sample(self, conn: Connection) -> None:
        before = self.local()
        server: datetime = conn.execute(_SERVER_NOW).scalar_one()
        after = self.local()
        offset = server - (before + (after - before) / 2)
        if abs(offset - self.offset) > timedelta(seconds=1):
            log.info("database clock is %+.3fs from this host's", offset.total_seconds())
        self.offset = offset
        self._sampled_at = self.monotonic()


_clocks: weakref.WeakKeyDictionary[Engine, DbClock] = weakref.WeakKeyDictionary()
_clocks_lock = threading.Lock()


def _engine_of(bind: Bind) -> Engine:
    if isinstance(bind, Engine):
        return bind
    if isinstance(bind, Connection):
        return bind.engine
    if isinstance(bind, Session):
        return _engine_of(bind.get_bind())
    engine = bind.kw.get("bind")
    if not isinstance(engine, Engine | Connection):
        raise ValueError("the session factory is bound to no engine; bind it to one")
    return _engine_of(engine)


def clock_of(bind: Bind) -> DbClock:
    """The clock of the database `bind` reaches (made on first use, then kept)."""
    engine = _engine_of(bind)
    clock = _clocks.get(engine)
    if clock is None:
        with _clocks_lock:
            clock = _clocks.get(engine)
            if clock is None:
                clock = _clocks[engine] = DbClock(engine)
    return clock


def use_clock(engine: Engine, clock: DbClock) -> DbClock:
    """Make `clock` the one every use of `engine` reads (e.g. a local time source of its own)."""
    with _clocks_lock:
        _clocks[engine] = clock
    return clock


def db_now(session: Session) -> datetime:
    """The database's time now, read in `session` (no round trip unless the offset is due)."""
    return clock_of(session).now(session)
