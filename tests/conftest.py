"""Shared fixtures: real databases (SQLite file, PostgreSQL) and a real uvicorn server."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from sqlalchemy import create_engine, text

if TYPE_CHECKING:
    import uvicorn

    from api.client import Client

PG_URL = os.environ.get("CPN_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
ADMIN_TOKEN = "cpn_admin_test-token-0123456789abcdef"


def _pg_available() -> str | None:
    """None when PostgreSQL answers, else why not."""
    try:
        engine = create_engine(PG_URL, connect_args={"connect_timeout": 3})
        with engine.connect() as conn:
            conn.execute(text("select 1"))
        engine.dispose()
        return None
    except Exception as exc:
        return f"{exc.__class__.__name__}: {str(exc).splitlines()[0]}"


@pytest.fixture(scope="session")
def pg_server_url() -> Iterator[str]:
    """A fresh PostgreSQL database for this test session, dropped at the end."""
    reason = _pg_available()
    if reason:
        message = (
            f"PostgreSQL not reachable at {PG_URL} ({reason}); start it or set CPN_TEST_PG_URL "
            "to a server with trust auth to run the PostgreSQL tests"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    from controller.db import scratch_database

    with scratch_database(PG_URL, "cpn_test") as url:
        yield url


@pytest.fixture(scope="session", params=["sqlite", "postgres"])
def migrated_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A database at the newest migration, on each backend."""
    from controller.migrate import upgrade

    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('db') / 'cpn.db'}"
    else:
        url = request.getfixturevalue("pg_server_url")
    upgrade(url)
    return url


def clear_tables(url: str) -> None:
    from controller.db import make_engine
    from controller.models import Base

    engine = make_engine(url)
    with engine.begin() as conn:
        # The ledger's append-only triggers refuse DELETE: lift them for this transaction only.
        if conn.dialect.name == "sqlite":
            triggers = conn.execute(
                text("SELECT name, sql FROM sqlite_master WHERE type = 'trigger'")
            ).all()
            for name, _sql in triggers:
                conn.execute(text(f'DROP TRIGGER "{name}"'))
        else:
            triggers = []
            conn.execute(text("ALTER TABLE ledger DISABLE TRIGGER USER"))
        for table in reversed(Base.metadata.sorted_tables):
            conn.execute(table.delete())
        if conn.dialect.name == "sqlite":
            for _name, sql in triggers:
                conn.execute(text(sql))
        else:
            conn.execute(text("ALTER TABLE ledger ENABLE TRIGGER USER"))
    engine.dispose()


@pytest.fixture
def db_url(migrated_url: str) -> str:
    """A migrated, empty database on each backend."""
    clear_tables(migrated_url)
    return migrated_url


@dataclass
class LiveServer:
    """A running control plane: where it listens, its admin key, its database; `stop()` it."""

    url: str
    admin_token: str
    database_url: str
    server: uvicorn.Server = field(repr=False)
    thread: threading.Thread = field(repr=False)

    def client(self, token: str | None = None) -> Client:
        from api.client import Client

        return Client(self.url, token or self.admin_token, timeout=30)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


def start_server(**settings_kwargs: object) -> LiveServer:
    """A real uvicorn server on a real socket in a thread (same process, real HTTP)."""
    import uvicorn

    from api.app import create_app
    from api.config import Settings

    settings = Settings(admin_token=ADMIN_TOKEN, **settings_kwargs)  # type: ignore[arg-type]
    app = create_app(settings)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    ready = threading.Event()
    for _ in range(500):
        if server.started:
            ready.set()
            break
        if not thread.is_alive():
            break
        threading.Event().wait(0.02)
    if not ready.is_set():
        raise RuntimeError("uvicorn did not start")
    return LiveServer(
        f"http://127.0.0.1:{port}", ADMIN_TOKEN, settings.database_url, server, thread
    )


@pytest.fixture
def live_server(db_url: str) -> Iterator[LiveServer]:
    """The control plane on a real socket, over a fresh database of each backend."""
    live = start_server(database_url=db_url)
    yield live
    live.stop()


@pytest.fixture
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent
