"""What the control plane tells callers it does not know (issue 14, item 7): readiness
without error text, documentation and metrics behind a key when an admin says so, and no
internals in any problem. Real servers, both database backends."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from controller.store.migrate import upgrade
from tests.conftest import ADMIN_TOKEN, LiveServer, start_server

DOCS = ("/docs", "/redoc", "/openapi.json")


@pytest.fixture(params=["sqlite", "postgres"])
def breakable(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[LiveServer, str]]:
    """A server on a database of its own, and the backend's name: the test breaks it."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'cpn.db'}"
        upgrade(url)
        live = start_server(database_url=url, run_controller=False)
        yield live, "sqlite"
        live.stop()
        return
    from controller.store.db import scratch_database

    with scratch_database(request.getfixturevalue("pg_server_url"), "cpn_ready") as url:
        upgrade(url)
        live = start_server(database_url=url, run_controller=False)
        yield live, "postgres"
        live.stop()


def break_database(live: LiveServer, backend: str) -> list[str]:
    """Make the server's database fail under it; returns what its error text would name."""
    url = make_url(live.database_url)
    if backend == "sqlite":
        # The server's open connections keep reading a replaced or deleted file: break the
        # table it reads instead (a view of a table that is gone).
        engine = create_engine(url)
        with engine.begin() as conn:
            conn.execute(text("DROP TABLE alembic_version"))
            conn.execute(text("CREATE VIEW alembic_version AS SELECT version_num FROM gone"))
        engine.dispose()
        return ["no such table", "gone", "SELECT", "sqlite", str(Path(str(url.database)).name)]
    admin = create_engine(url.set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(
            text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = :n AND pid <> pg_backend_pid()"
            ),
            {"n": url.database},
        )
        conn.execute(text(f'DROP DATABASE "{url.database}"'))
    admin.dispose()
    return ["does not exist", str(url.database), str(url.host), "postgres"]


def test_readyz_says_not_ready_and_nothing_else(breakable: tuple[LiveServer, str]) -> None:
    live, backend = breakable
    assert httpx.get(f"{live.url}/readyz").json() == {"status": "ready"}
    internals = break_database(live, backend)
    answer = httpx.get(f"{live.url}/readyz")
    assert answer.status_code == 503
    body = answer.json()
    assert body["detail"] == "the control plane is not ready; its log says why"
    for word in internals:
        assert word not in answer.text, word


def test_docs_and_metrics_are_public_by_default(live_server: LiveServer) -> None:
    for path in (*DOCS, "/metrics"):
        assert httpx.get(f"{live_server.url}{path}").status_code == 200, path


@pytest.fixture
def guarded(db_url: str) -> Iterator[LiveServer]:
    live = start_server(
        database_url=db_url, run_controller=False, protect_docs=True, protect_metrics=True
    )
    yield live
    live.stop()


def test_docs_and_metrics_need_a_key_when_protected(guarded: LiveServer) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    with guarded.client() as client:
        tenant = client.post("/v1/tenants", {"name": "reader"})
        token = client.create_api_key("tenant", tenant["id"])["token"]
    as_tenant = {"Authorization": f"Bearer {token}"}
    for path in (*DOCS, "/metrics"):
        for headers in ({}, {"Authorization": "Bearer cpn_junk-0123456789abcdef"}):
            answer = httpx.get(f"{guarded.url}{path}", headers=headers)
            assert answer.status_code == 401, (path, answer.text)
            assert answer.headers["content-type"].startswith("application/problem+json")
    for path in DOCS:
        assert httpx.get(f"{guarded.url}{path}", headers=as_tenant).status_code == 200, path
    spec = httpx.get(f"{guarded.url}/openapi.json", headers=as_tenant).json()
    assert "/v1/jobs" in spec["paths"]
    assert httpx.get(f"{guarded.url}/metrics", headers=as_tenant).status_code == 403
    metrics = httpx.get(f"{guarded.url}/metrics", headers=admin)
    assert metrics.status_code == 200 and "cpn_" in metrics.text
    assert httpx.get(f"{guarded.url}/healthz").status_code == 200
    assert httpx.get(f"{guarded.url}/readyz").status_code == 200


SQL = "SELECT key_hash FROM api_keys WHERE role = 'admin'"


def test_an_unexpected_error_is_a_problem_without_its_text(db_url: str) -> None:
    """The last-resort handler: a route that fails in a way nobody planned for (here one
    added for the test, raising an error whose text holds SQL and a path)."""
    import uvicorn

    from api.app import create_app
    from api.config import Settings

    app = create_app(Settings(admin_token=ADMIN_TOKEN, database_url=db_url, run_controller=False))

    @app.get("/v1/explode")
    def explode() -> None:
        raise RuntimeError(f"(psycopg.errors.InternalError) {SQL} at /srv/cpn/controller/x.py")

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        answer = None
        for _ in range(500):
            if server.started:
                answer = httpx.get(f"{url}/v1/explode")
                break
            threading.Event().wait(0.02)
        assert answer is not None, "uvicorn did not start"
        assert answer.status_code == 500
        assert answer.headers["content-type"].startswith("application/problem+json")
        body = answer.json()
        assert body["title"] == "Internal error" and "reference" in body["detail"]
        for leak in ("SELECT", "api_keys", "/srv/cpn", "psycopg", "RuntimeError"):
            assert leak not in answer.text
    finally:
        server.should_exit = True
        thread.join(timeout=15)


def test_a_validation_problem_does_not_echo_the_input(live_server: LiveServer) -> None:
    with live_server.client() as client:
        tenant = client.post("/v1/tenants", {"name": "echo"})
    bad = f"{SQL} -- /etc/passwd"
    answer = httpx.patch(
        f"{live_server.url}/v1/tenants/{tenant['id']}",
        json={"priority_ceiling": bad, "gpu_quota": bad},
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    )
    assert answer.status_code == 422
    assert {e["field"] for e in answer.json()["errors"]} == {"priority_ceiling", "gpu_quota"}
    assert "SELECT" not in answer.text and "passwd" not in answer.text


def test_serve_makes_itself_non_dumpable() -> None:
    """`cpn serve` hides its environment (secrets) from same-user processes via prctl."""
    import subprocess
    import sys

    code = (
        "import ctypes; from api.process import shield_environment; libc = ctypes.CDLL(None);"
        " before = libc.prctl(3, 0, 0, 0, 0); shield_environment();"
        " print(before, libc.prctl(3, 0, 0, 0, 0))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "0"]  # PR_GET_DUMPABLE: dumpable before, not after


def test_docs_assets_are_served_by_cpn(live_server: LiveServer) -> None:
    """The documentation pages load their scripts from cpn itself, never from a CDN."""
    for page, assets in (
        ("/docs", ("swagger-ui-bundle.js", "swagger-ui.css")),
        ("/redoc", ("redoc.standalone.js",)),
    ):
        html = httpx.get(f"{live_server.url}{page}").text
        assert "cdn." not in html and "fonts.googleapis" not in html, page
        for asset in assets:
            assert f'"/docs/assets/{asset}"' in html, (page, asset)
            answer = httpx.get(f"{live_server.url}/docs/assets/{asset}")
            assert answer.status_code == 200 and len(answer.content) > 100_000, asset


def test_openapi_documents_the_problems_the_server_sends(live_server: LiveServer) -> None:
    """Every error an operation can answer is documented as application/problem+json with
    the Problem schema, and a real one matches it (schemathesis checks the rest)."""
    spec = httpx.get(f"{live_server.url}/openapi.json").json()
    assert "HTTPValidationError" not in str(spec)
    problem = spec["components"]["schemas"]["Problem"]
    assert set(problem["required"]) == {"type", "title", "status", "detail"}
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            if path.startswith("/v1/"):
                assert {"401", "403", "429", "503"} <= set(responses), (method, path)
            for code, answer in responses.items():
                if int(code) >= 400:
                    content = answer["content"]["application/problem+json"]
                    assert content["schema"] == {"$ref": "#/components/schemas/Problem"}
    cancel = spec["paths"]["/v1/jobs/{job_id}/cancel"]["post"]["responses"]
    assert {"404", "409", "412", "422"} <= set(cancel)
    answer = httpx.get(f"{live_server.url}/v1/jobs/nope")
    assert answer.status_code == 401
    assert answer.headers["content-type"].startswith("application/problem+json")
    assert set(problem["required"]) <= set(answer.json())


@pytest.mark.slow
def test_spectral_finds_no_error_in_the_openapi(tmp_path: Path) -> None:
    """Stoplight's spectral (its `spectral:oas` ruleset, from npm) reads the document as
    generated clients do; warnings (missing descriptions) are allowed, errors are not."""
    import json
    import os
    import shutil
    import subprocess

    from api.app import create_app
    from api.config import Settings

    npx = shutil.which("npx")
    if npx is None:
        if os.environ.get("CI") == "true":
            pytest.fail("npx is missing: install Node.js")
        pytest.skip("npx is missing")
    document = tmp_path / "openapi.json"
    app = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'cpn.db'}"))
    document.write_text(json.dumps(app.openapi()))
    (tmp_path / ".spectral.yaml").write_text('extends: ["spectral:oas"]\n')
    ran = subprocess.run(
        [npx, "--yes", "@stoplight/spectral-cli@6", "lint", str(document), "--fail-severity",
         "error", "-r", str(tmp_path / ".spectral.yaml")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-2000:]
    assert "(0 errors" in ran.stdout or "No results" in ran.stdout, ran.stdout[-3000:]
