"""`cpn serve`: the API and the controller's background loops under uvicorn."""

from __future__ import annotations

import gc
import logging
import os
import sys

import typer

from api.cli.errors import FAILED, fail


def serve(
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8000, min=0, max=65535, help="Port to listen on."),
    no_controller: bool = typer.Option(
        False, "--no-controller", help="Serve the API only; run no background loops."
    ),
    log_level: str = typer.Option("info", help="uvicorn log level."),
    workers: int = typer.Option(
        1,
        min=1,
        max=64,
        help="API processes sharing the port (use the host's cores); one of them runs the "
        "controller's loops. Each holds its own rate-limit buckets and stream slots.",
    ),
) -> None:
    """Run the control plane (settings from CPN_* environment variables)."""
    import uvicorn

    from api.app import create_app
    from api.config import Settings, admin_token_problem
    from controller.db import is_sqlite, make_engine
    from controller.migrate import pending_reason

    settings = Settings()
    refused = admin_token_problem(settings.admin_token)
    if refused:
        raise fail("serve", None, refused)
    if no_controller:
        settings.run_controller = False
    engine = make_engine(settings.database_url)
    reason = pending_reason(engine)
    engine.dispose()
    if reason:
        raise fail("serve", None, reason, FAILED)
    if settings.run_controller and is_sqlite(settings.database_url):
        from controller.db import make_sessionmaker
        from controller.loop import ReplicaConflict, check_single_replica

        engine = make_engine(settings.database_url)
        try:
            check_single_replica(make_sessionmaker(engine), settings.replica_ttl_s)
        except ReplicaConflict as exc:
            raise fail("serve", None, str(exc), FAILED) from None
        finally:
            engine.dispose()
    configure_logging(log_level)
    shield_environment()
    if workers > 1:
        from api import workers as several
        from api.app import bootstrap_admin, say_generated
        from controller.db import make_sessionmaker

        # Once, here: workers starting together would each generate a first admin key.
        engine = make_engine(settings.database_url)
        try:
            written = bootstrap_admin(settings, make_sessionmaker(engine))
        finally:
            engine.dispose()
        if written:
            say_generated(written)
        os.environ[LOG_LEVEL_ENV] = log_level
        several.serve(settings, host, port, log_level, workers)
        return
    app = create_app(settings)
    settle_collector()
    uvicorn.run(app, host=host, port=port, log_level=log_level)


LOG_LEVEL_ENV = "CPN_SERVE_LOG_LEVEL"
"""How `cpn serve --workers` tells its worker processes its --log-level."""


def configure_logging(log_level: str) -> None:
    """cpn's own loggers (controller loop, launcher, lease monitor) at the same level as
    uvicorn's; uvicorn keeps its handlers and does not propagate, so nothing doubles."""
    level = log_level.upper()
    logging.basicConfig(
        level=level if level in logging.getLevelNamesMapping() else logging.DEBUG,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


GC_THRESHOLDS = (50_000, 20, 100)
"""The cyclic collector's thresholds in a serving process (Python's: 700, 10, 10)."""


def settle_collector() -> None:
    """Freeze what start-up built and collect generation 0 less often.

    A request allocates thousands of container objects (pydantic models, SQLAlchemy rows,
    ASGI scopes), so Python's threshold of 700 ran a collection every request or two, and
    each older collection walked the app, its routes, schemas and mappers, which live as long
    as the process. Frozen, they are never walked again; at 50,000 a collection runs every few
    dozen requests and holds at most a few MB of cyclic garbage meanwhile. Heartbeats at
    1,000/s offered, one worker: p99 465 -> 235 and 679 -> 137 ms on SQLite, 5.1 -> 0.17 and
    4.7 -> 0.32 s on PostgreSQL (bench/results/api-throughput.md)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def shield_environment() -> None:
    """Make this process non-dumpable: other processes of the same user (the embedded Ray's
    workers run tenant code) can then no longer read /proc/<pid>/environ, which holds the
    control plane's secrets. Root and CAP_SYS_PTRACE still can: use a separate Ray
    (CPN_RAY_ADDRESS) when tenants are not trusted."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_dumpable = 4
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_dumpable, 0, 0, 0, 0)


def register(app: typer.Typer) -> None:
    """Attach `cpn serve`."""
    app.command("serve")(serve)
