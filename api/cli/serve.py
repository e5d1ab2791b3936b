"""`cpn serve`: the API and the controller's background loops under uvicorn."""

from __future__ import annotations

import os

import typer

from api.cli.errors import FAILED, fail
from api.cli.errors import settings as cli_settings


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
    from api.config import admin_token_problem
    from api.process import (
        LOG_LEVEL_ENV,
        configure_logging,
        private_umask,
        settle_collector,
        shield_environment,
    )
    from controller.store.db import is_sqlite, make_engine
    from controller.store.migrate import pending_reason

    settings = cli_settings("serve")
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
        from controller.loop.controller import ReplicaConflict, check_single_replica
        from controller.store.db import make_sessionmaker

        engine = make_engine(settings.database_url)
        try:
            check_single_replica(make_sessionmaker(engine), settings.replica_ttl_s)
        except ReplicaConflict as exc:
            raise fail("serve", None, str(exc), FAILED) from None
        finally:
            engine.dispose()
    configure_logging(log_level)
    private_umask()
    shield_environment()
    if workers > 1:
        from api import process
        from api.app import bootstrap_admin, say_generated
        from controller.store.db import make_sessionmaker

        # Once, here: workers starting together would each generate a first admin key.
        engine = make_engine(settings.database_url)
        try:
            written = bootstrap_admin(settings, make_sessionmaker(engine))
        finally:
            engine.dispose()
        if written:
            say_generated(written)
        os.environ[LOG_LEVEL_ENV] = log_level
        process.serve(settings, host, port, log_level, workers)
        return
    app = create_app(settings)
    settle_collector()
    uvicorn.run(app, host=host, port=port, log_level=log_level)


def register(app: typer.Typer) -> None:
    """Attach `cpn serve`."""
    app.command("serve")(serve)
