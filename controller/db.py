"""Engine and session factory: SQLite by default, PostgreSQL when the URL says so."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


SQLITE_SYNCHRONOUS = ("FULL", "NORMAL")


def make_engine(url: str, *, sqlite_synchronous: str = "FULL", **kwargs: Any) -> Engine:
    """Create an engine tuned for the backend.

    SQLite gets WAL (readers do not block the writer), a busy timeout instead of immediate
    'database is locked' errors, and foreign keys on; the file's folder is created if missing.
    `synchronous=FULL` syncs the WAL at every commit, so an acknowledged job or ledger row
    survives a power loss; NORMAL (faster) may lose the last commits then.
    """
    if sqlite_synchronous not in SQLITE_SYNCHRONOUS:
        raise ValueError(f"sqlite_synchronous must be one of {SQLITE_SYNCHRONOUS}")
    if is_sqlite(url):
        database = make_url(url).database
        if database and database != ":memory:":
            Path(database).parent.mkdir(parents=True, exist_ok=True)
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
            dbapi_conn = conn.connection.dbapi_connection
            if dbapi_conn is not None and not dbapi_conn.in_transaction:
                dbapi_conn.execute("BEGIN")

        return engine
    if "poolclass" not in kwargs:
        kwargs.setdefault("pool_size", 20)
        kwargs.setdefault("max_overflow", 20)
    kwargs.setdefault("pool_pre_ping", True)
    return create_engine(url, **kwargs)


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
