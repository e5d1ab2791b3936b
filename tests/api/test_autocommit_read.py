"""`api.deps.autocommit_read`: a read outside any transaction, and a pool left as it was.

The job list reads with it on a server database (no `BEGIN`/`ROLLBACK` round trips). What
must hold: the read really runs outside a transaction, and the connection it used goes back
to the pool transactional, so the next request's writes are still all-or-nothing."""

from __future__ import annotations

from sqlalchemy import func, select

from api.deps import autocommit_read
from controller.store.db import make_engine, make_sessionmaker
from controller.store.models import Tenant


def test_an_autocommit_read_leaves_the_next_session_transactional(db_url: str) -> None:
    engine = make_engine(db_url, pool_size=1, max_overflow=0)  # one connection: reused
    sessions = make_sessionmaker(engine)
    postgres = engine.dialect.name == "postgresql"
    try:
        with sessions() as s:
            conn = s.connection(execution_options=autocommit_read(s))
            assert conn.execute(select(func.count()).select_from(Tenant)).scalar() == 0
            if postgres:  # psycopg: IDLE, not INTRANS: no BEGIN was sent
                assert conn.connection.dbapi_connection.info.transaction_status == 0  # type: ignore[union-attr]
        with sessions() as s:  # the same pooled connection
            s.add(Tenant(name="rolled-back"))
            s.flush()
            s.rollback()
        with sessions() as s:
            assert s.scalar(select(func.count()).select_from(Tenant)) == 0
    finally:
        engine.dispose()
