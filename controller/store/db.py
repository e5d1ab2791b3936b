"""Engine and session factory: SQLite by default, PostgreSQL when the URL says so."""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import ConnectionPoolEntry

log = logging.getLogger(__name__)


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


SQLITE_SYNCHRONOUS = ("FULL", "NORMAL")

PING_AFTER_IDLE_S = 1.0
"""A pooled server connection that sat idle this long is pinged before use (a round trip);
one used more recently is not. A ping before every use (SQLAlchemy's `pool_pre_ping`) is a
round trip per request, a real share of a PostgreSQL job-list read's CPU under load
(measured: bench/results/api-throughput.md). A connection that died within the window fails
its request once, as a disconnect, which makes SQLAlchemy replace every connection of the
pool; the API answers that request 503."""


SIDE_FILES = ("", "-wal", "-shm", "-journal")
"""A SQLite database's files: SQLite gives its side files the main file's permissions."""


def private_files(database: Path) -> None:
    """Every tenant's jobs, the ledger and the audit log live in this file: readable by its
    owner only (0600). A new file is created so; an existing one readable by others is
    tightened, with a warning naming it."""
    if not database.exists():
        os.close(os.open(database, os.O_CREAT | os.O_WRONLY, 0o600))
    for suffix in SIDE_FILES:
        path = database.with_name(database.name + suffix)
        try:
            mode = stat.S_IMODE(path.stat().st_mode)
        except FileNotFoundError:
            continue
        if mode & 0o077:
            path.chmod(0o600)
            log.warning("%s was readable by others (%o): now 0600", path, mode)


def make_engine(
    url: str,
    *,
    sqlite_synchronous: str = "FULL",
    ping_after_idle_s: float = PING_AFTER_IDLE_S,
    **kwargs: Any,
) -> Engine:
    """Create an engine tuned for the backend.

    SQLite gets WAL (readers do not block the writer), a busy timeout instead of immediate
    'database is locked' errors, and foreign keys on; the file's folder is created if missing.
    `synchronous=FULL` syncs the WAL at every commit, so an acknowledged job or ledger row
    survives a power loss; NORMAL (faster) may lose the last commits then. A server database's
    pooled connections are pinged before use only after `ping_after_idle_s` idle.
    """
    if sqlite_synchronous not in SQLITE_SYNCHRONOUS:
        raise ValueError(f"sqlite_synchronous must be one of {SQLITE_SYNCHRONOUS}")
    if is_sqlite(url):
        database = make_url(url).database
        if database and database != ":memory:":
            Path(database).parent.mkdir(parents=True, exist_ok=True)
            private_files(Path(database))
        engine = create_engine(
            url, connect_args={"check_same_thread": False, "timeout": 30}, **kwargs
        )

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute(f"PRAGMA synchronous={sqlite_synchronous}")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        @event.listens_for(engine, "savepoint")
        def _begin_before_savepoint(conn: Connection, _name: str) -> None:
            # pysqlite sends BEGIN only before the first write: a SAVEPOINT issued before
            # one would open the transaction itself, and its RELEASE would COMMIT it, so a
            # placement rolled back (or killed) after its reservation kept the GPUs reserved.
            # IMMEDIATE: the write lock is taken now, waiting up to the busy timeout; a
            # deferred BEGIN read first and then failed at once ("database is locked", the
            # busy timeout never consulted) when another connection wrote meanwhile.
            dbapi_conn = conn.connection.dbapi_connection
            if dbapi_conn is not None and not dbapi_conn.in_transaction:
                dbapi_conn.execute("BEGIN IMMEDIATE")

        return engine
    if "poolclass" not in kwargs:
        kwargs.setdefault("pool_size", 20)
        kwargs.setdefault("max_overflow", 20)
    engine = create_engine(url, **kwargs)
    _ping_when_idle(engine, ping_after_idle_s)
    return engine


_IDLE_SINCE = "cpn.idle_since"


def _ping_when_idle(engine: Engine, after_s: float) -> None:
    """Ping a connection checked out after `after_s` idle; a dead one is replaced before use
    (raising `DisconnectionError` in a checkout hook makes the pool connect anew, up to
    three times). A new connection (no check-in yet) needs none."""

    @event.listens_for(engine, "checkin")
    def _idle_since(_dbapi_conn: Any, record: ConnectionPoolEntry) -> None:
        record.info[_IDLE_SINCE] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _ping(dbapi_conn: Any, record: ConnectionPoolEntry, _proxy: Any) -> None:
        since = record.info.get(_IDLE_SINCE)
        if since is None or time.monotonic() - since < after_s:
            return
        try:
            engine.dialect.do_ping(dbapi_conn)
        except engine.dialect.loaded_dbapi.Error as exc:
            raise DisconnectionError(f"pooled connection found dead: {exc}") from exc


def lock_for_update(session: Session) -> None:
    """Make the session's next read hold what `SELECT ... FOR UPDATE` holds on PostgreSQL.

    SQLite drops FOR UPDATE, and pysqlite begins a transaction only at the first write, so a
    row read to be changed could change underneath (an agent's heartbeat renewing a cluster
    between an admin's read and update of it made the update a 409). On SQLite this takes the
    database's write lock first (`BEGIN IMMEDIATE`; waits up to the busy timeout)."""
    conn = session.connection()
    if conn.dialect.name != "sqlite":
        return
    dbapi = conn.connection.dbapi_connection
    if dbapi is not None and not dbapi.in_transaction:
        dbapi.execute("BEGIN IMMEDIATE")


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def scratch_database(
    server_url: str, prefix: str = "cpn_scratch", template: str | None = None
) -> Iterator[str]:
    """A new PostgreSQL database on `server_url` for one test run or benchmark (empty, or a copy
    of the database `template` names); its URL is yielded, and it is dropped afterwards."""
    import uuid

    from sqlalchemy import text

    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    copy = f' TEMPLATE "{make_url(template).database}"' if template else ""
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"{copy}'))
    try:
        yield make_url(server_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = :n AND pid <> pg_backend_pid()"
                ),
                {"n": name},
            )
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
        admin.dispose()
