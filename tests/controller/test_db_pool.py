"""Pooled PostgreSQL connections: pinged before use only after sitting idle (`controller.store.db`).

A backend is terminated by PostgreSQL itself (`pg_terminate_backend`), the way a server
restart or an idle timeout kills it, while its connection waits in the pool."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import DBAPIError

from api.processes import wait_until
from controller.store.db import make_engine

pytestmark = pytest.mark.postgres


def _pid(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())


def _terminate(url: str, pid: int) -> None:
    # each statement its own transaction: pg_stat_activity is read once a transaction
    admin = make_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})

            def gone() -> bool:
                alive = conn.execute(
                    text("SELECT count(*) FROM pg_stat_activity WHERE pid = :pid"), {"pid": pid}
                )
                return alive.scalar_one() == 0

            wait_until(gone, 10, f"backend {pid} to exit")
    finally:
        admin.dispose()


@pytest.mark.parametrize("migrated_url", ["postgres"], indirect=True)
def test_an_idle_connection_found_dead_is_replaced_before_use(migrated_url: str) -> None:
    engine = make_engine(migrated_url, pool_size=1, ping_after_idle_s=0)
    try:
        first = _pid(engine)
        _terminate(migrated_url, first)
        assert _pid(engine) != first  # no error: the ping found it dead, the pool reconnected
    finally:
        engine.dispose()


@pytest.mark.parametrize("migrated_url", ["postgres"], indirect=True)
def test_a_recently_used_connection_found_dead_fails_once(migrated_url: str) -> None:
    """Not pinged within its idle window: its request fails as a disconnect (the API's 503),
    and the pool has replaced it for the next one."""
    engine = make_engine(migrated_url, pool_size=1, ping_after_idle_s=3600)
    try:
        first = _pid(engine)
        _terminate(migrated_url, first)
        with pytest.raises(DBAPIError) as failed:
            _pid(engine)
        assert failed.value.connection_invalidated
        assert _pid(engine) != first
    finally:
        engine.dispose()
