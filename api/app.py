"""The FastAPI application: routes, problems, metrics, and the controller's loops."""

from __future__ import annotations

import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
from fastapi import FastAPI
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from api import problems
from api.config import Settings
from api.metrics import Metrics, MetricsMiddleware
from api.routes import agent, clusters, health, jobs, links, pricing, tenants, usage
from controller import keys
from controller.db import is_sqlite, make_engine, make_sessionmaker
from controller.leases import LeaseMonitor, LeasePolicy
from controller.loop import Controller
from controller.migrate import pending_reason
from controller.models import ApiKey
from controller.resources import PeerTable

log = logging.getLogger("cpn.api")


class NotMigrated(RuntimeError):
    """The database schema is behind the code; the message names the fix."""


def bootstrap_admin(app: FastAPI) -> str | None:
    """Make sure an admin key exists; return a generated token (to print once) if one was made."""
    settings: Settings = app.state.settings
    with app.state.sessions() as session, session.begin():
        if settings.admin_token:
            if keys.authenticate(session, settings.admin_token) is None:
                exists = session.scalar(
                    select(ApiKey.id).where(ApiKey.key_hash == keys.hash_key(settings.admin_token))
                )
                if exists is None:
                    keys.create_key(session, "admin", None, "CPN_ADMIN_TOKEN", settings.admin_token)
            return None
        has_admin = session.scalar(
            select(ApiKey.id).where(ApiKey.role == "admin", ApiKey.revoked_at.is_(None)).limit(1)
        )
        if has_admin:
            return None
        _key, token = keys.create_key(session, "admin", None, "generated at first start")
        return token


def heartbeat_workers(database_url: str) -> int:
    """Threads that ingest heartbeats: SQLite takes one writer at a time; PostgreSQL waits on
    round trips and commits, so a few beats in flight keep it busy (within the 20+20 pool)."""
    return 1 if is_sqlite(database_url) else 8


def make_controller(settings: Settings, sessions: sessionmaker[Session]) -> Controller:
    return Controller(
        sessions,
        sqlite=is_sqlite(settings.database_url),
        interval_s=settings.reconcile_interval_s,
        replica_ttl_s=settings.replica_ttl_s,
        checkpoint_root=Path(settings.checkpoint_root).resolve(),
        ray_address=settings.ray_address,
        max_attempts=settings.max_attempts,
        ray_num_cpus=settings.ray_num_cpus,
        launch=settings.launch_jobs,
    )


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    engine = make_engine(settings.database_url)
    sessions = make_sessionmaker(engine)
    metrics = Metrics()
    policy = LeasePolicy(settings.heartbeat_interval_s, settings.lease_grace_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        reason = pending_reason(engine)
        if reason:
            raise NotMigrated(f"cpn serve cannot start: {reason}")
        token = bootstrap_admin(app)
        if token:
            print(
                f"cpn: generated the first admin key (shown once, store it): {token}",
                file=sys.stderr,
                flush=True,
            )
        monitor = None
        controller = None
        if settings.run_controller:

            def on_moved(moved: list[tuple[str, str, str]]) -> None:
                app.state.peers.invalidate()
                for _name, _from, to in moved:
                    metrics.lease_transitions.labels(to).inc()

            monitor = LeaseMonitor(sessions, policy, settings.monitor_period(), on_moved)
            monitor.start()
            controller = make_controller(settings, sessions)
            controller.start()
        try:
            yield
        finally:
            if controller:
                controller.stop()
            if monitor:
                monitor.stop()
            engine.dispose()

    app = FastAPI(
        title="cpn",
        version="0.1.0",
        summary="Cross-datacenter compute-network orchestrator",
        description="Admin API over clusters, links, GPUs, tenants and keys; the agent protocol.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.sessions = sessions
    app.state.metrics = metrics
    app.state.lease_policy = policy
    app.state.peers = PeerTable()
    app.state.principals = keys.PrincipalCache()
    app.state.heartbeat_workers = anyio.CapacityLimiter(heartbeat_workers(settings.database_url))
    problems.install(app)
    for module in (health, clusters, links, tenants, pricing, jobs, usage, agent):
        app.include_router(module.router)
    app.add_middleware(problems.BodySizeLimit, limit=settings.max_body_bytes)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app
