"""Shared fixtures: real databases (SQLite file, PostgreSQL) and a real uvicorn server."""

from __future__ import annotations

import functools
import os
import re
import socket
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from sqlalchemy import create_engine, text

if TYPE_CHECKING:
    import uvicorn

    from api.client import Client


def _testbed_prefix(worker: str | None, base: str) -> str:
    """The WAN testbed prefix of one xdist worker (`gw1` -> `cpntb1`): each worker's testbed has
    its own namespaces and state directory, and `down` never touches another's."""
    if not worker:
        return base
    number = worker.removeprefix("gw")
    return base[: 11 - len(number)] + number


# The interpreted scheduler, even after `make compile`: some tests look inside its search
# (monkeypatching a compiled class does nothing); tests/scheduler/test_native.py checks the
# compiled build against it. Set before any test imports scheduler.
os.environ.setdefault("CPN_COMPILED", "0")
# testbed.layout reads CPN_TESTBED_PREFIX once, at import: set it before any test imports it.
os.environ["CPN_TESTBED_PREFIX"] = _testbed_prefix(
    os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("CPN_TESTBED_PREFIX", "cpntb")
)
# The CLI reads contexts from a config file (api.cli.contexts): never the developer's own. A
# path that does not exist: no context unless a test writes one (its own CPN_CONFIG).
os.environ["CPN_CONFIG"] = str(Path(tempfile.gettempdir()) / f"cpn-tests-{os.getpid()}-none.yaml")
_TESTS = Path(__file__).resolve().parent
_BROAD_SCOPE = re.compile(r"""scope=["'](class|module|package)["']""")
_ONE_UNIT = ("tests/testbed",)
"""Folders whose tests run one after another on one worker: two WAN testbeds training at once
on the same cores would make the shaped links' measurements measure the cores."""


@functools.cache
def _broad_scope(path: str) -> str | None:
    """The broadest fixture scope narrower than the session declared in this file."""
    file = _TESTS.parent / path
    found = set(_BROAD_SCOPE.findall(file.read_text())) if file.is_file() else set()
    for scope in ("package", "module", "class"):
        if scope in found:
            return scope
    return None


def work_unit(nodeid: str) -> str:
    """What one xdist worker runs as a whole, for a test id: its package when a conftest there
    declares a package-wide fixture (the security worlds, one per backend), its file when it
    or a conftest above it declares a module- or class-wide one (a server, a browser, a
    checkov run: set up once, not once per worker), else the test alone (best balance)."""
    path = nodeid.split("::")[0]
    for folder in _ONE_UNIT:
        if path.startswith(folder + "/"):
            return folder
    parts = path.split("/")
    for depth in range(1, len(parts)):
        folder = "/".join(parts[:depth])
        scope = _broad_scope(f"{folder}/conftest.py")
        if scope == "package":
            backend = "postgres" if "[postgres" in nodeid or "-postgres" in nodeid else ""
            return f"{folder}:{backend}"
        if scope is not None:
            return path
    return path if _broad_scope(path) else nodeid


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadscope` with cpn's units (`work_unit`), handed out in collection order (the
    slow tests first, see below) instead of largest unit first.

    pytest-xdist's own `--dist loadgroup` cannot be used: it marks a group by appending to
    `item._nodeid`, which pytest 9.2 no longer reads, so its groups are silently ignored."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Units(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False
    return Units(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist the slow end-to-end tests are handed out first, so the last minutes are
    not one worker alone on a long test while the other has finished."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


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
    from controller.store.db import scratch_database

    with scratch_database(PG_URL, "cpn_test") as url:
        yield url


@pytest.fixture(scope="session", params=["sqlite", "postgres"])
def migrated_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A database at the newest migration, on each backend."""
    from controller.store.migrate import upgrade

    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('db') / 'cpn.db'}"
    else:
        url = request.getfixturevalue("pg_server_url")
    upgrade(url)
    return url


APPEND_ONLY_TABLES = ("ledger", "postings", "payouts")


def clear_tables(url: str) -> None:
    from controller.store.db import make_engine
    from controller.store.models import Base

    engine = make_engine(url)
    with engine.begin() as conn:
        # The books' append-only triggers refuse DELETE: lift them for this transaction only.
        if conn.dialect.name == "sqlite":
            triggers = conn.execute(
                text("SELECT name, sql FROM sqlite_master WHERE type = 'trigger'")
            ).all()
            for name, _sql in triggers:
                conn.execute(text(f'DROP TRIGGER "{name}"'))
        else:
            triggers = []
            for table in APPEND_ONLY_TABLES:
                conn.execute(text(f"ALTER TABLE {table} DISABLE TRIGGER USER"))
        for table in reversed(Base.metadata.sorted_tables):
            conn.execute(table.delete())
        if conn.dialect.name == "sqlite":
            for _name, sql in triggers:
                conn.execute(text(sql))
        else:
            for table in APPEND_ONLY_TABLES:
                conn.execute(text(f"ALTER TABLE {table} ENABLE TRIGGER USER"))
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
