"""The FastAPI application: routes, problems, metrics, and the controller's loops."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
from fastapi import FastAPI
from sqlalchemy import Engine, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import QueuePool

from api import docs, election, problems, ratelimit
from api.config import Settings, admin_token_problem
from api.deps import AppState, FailureAudit
from api.heartbeats import HeartbeatBatcher
from api.job_list import RenderedJobs
from api.limits import RateLimits
from api.metrics import Metrics, MetricsMiddleware
from api.routes import agent, clusters, health, jobs, links, pricing, providers, tenants, usage
from api.sessions import ConsoleSessions
from api.streams import StreamSlots
from api.submissions import SubmissionBatcher
from api.ui import routes as console
from api.version import VERSION
from controller.access import keys, scrub
from controller.loop.controller import Controller
from controller.network import resources
from controller.network.leases import LeaseMonitor, LeasePolicy
from controller.network.resources import PeerTable
from controller.store.db import is_sqlite, make_engine, make_sessionmaker
from controller.store.migrate import pending_reason
from controller.store.models import ApiKey, utcnow
from controller.store.table_stats import BurstAnalyzer
from training.location import absolute

log = logging.getLogger("cpn.api")


class NotMigrated(RuntimeError):
    """The database schema is behind the code; the message names the fix."""


def bootstrap_admin(settings: Settings, sessions: sessionmaker[Session]) -> Path | None:
    """Make sure an admin key exists; return the file a generated one was written to, if any.

    CPN_ADMIN_TOKEN becomes an admin key, and the environment's earlier keys are revoked (a
    rotated token must not leave the old one working). Without it, and with no live admin key,
    one is generated and written to `admin_token_file` (mode 0600) before the transaction that
    stores it commits: never a key nobody can read, never a key in the log."""
    try:
        return _bootstrap(settings, sessions)
    except IntegrityError:  # another replica stored the same token just now: adopt its row
        return _bootstrap(settings, sessions)


def _bootstrap(settings: Settings, sessions: sessionmaker[Session]) -> Path | None:
    with sessions() as session, session.begin():
        if settings.admin_token:
            adopted = keys.adopt_env_admin(session, settings.admin_token)
            for old in adopted.replaced:
                resources.audit(
                    session, None, "key.revoke", "api_key", old.id, reason="CPN_ADMIN_TOKEN changed"
                )
            if adopted.replaced:
                log.warning(
                    "CPN_ADMIN_TOKEN changed: revoked the admin key it replaced (%s)",
                    ", ".join(k.id for k in adopted.replaced),
                )
            return None
        now = utcnow()
        has_admin = session.scalar(
            select(ApiKey.id)
            .where(
                ApiKey.role == "admin",
                ApiKey.revoked_at.is_(None),
                or_(ApiKey.expires_at.is_(None), ApiKey.expires_at > now),
            )
            .limit(1)
        )
        if has_admin:
            return None
        _key, token = keys.create_key(session, "admin", None, "generated at first start")
        path = Path(settings.admin_token_file).resolve()
        try:
            write_secret(path, token)
        except OSError as exc:
            raise AdminKeyFile(
                f"cpn serve cannot start: cannot write the generated admin key to {path} "
                f"({exc.strerror or exc}); set CPN_ADMIN_TOKEN_FILE to a writable path, or set "
                "CPN_ADMIN_TOKEN"
            ) from None
        return path


def say_generated(path: Path) -> None:
    print(
        f"cpn: generated the first admin key into {path} (readable by its owner only); it is "
        "not printed: read it from that file",
        file=sys.stderr,
        flush=True,
    )


class AdminKeyFile(RuntimeError):
    """The generated admin key could not be written; the message names the fix."""


def write_secret(path: Path, text: str) -> None:
    """Write `text` to `path`, readable and writable by its owner only (0600).

    Written to a new file beside it and renamed over it: a file or symlink already there is
    replaced, never followed or widened."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def group_writers(database_url: str) -> int:
    """Group-commit batches written at once (`api.group_commit`), of heartbeats (each on a
    connection of the agents' own pool, sized from this) and of job submissions. SQLite
    takes one writer at a time. On PostgreSQL two: one batch is written while the next
    gathers. A batch is a few statements whatever its size
    (`controller.network.resources.ingest_heartbeats`), so more writers only cut beats into
    smaller batches, each paying those statements and a thread's turn at the GIL: eight
    writers cost more CPU a beat and a longer tail than two
    (measured: bench/results/api-throughput.md)."""
    return 1 if is_sqlite(database_url) else 2


def engine_options(settings: Settings) -> dict[str, Any]:
    """The engine's pool and durability settings (unset pool sizes keep the backend's)."""
    options: dict[str, Any] = {
        "pool_timeout": settings.db_pool_timeout_s,
        "sqlite_synchronous": settings.sqlite_synchronous,
    }
    if settings.db_pool_size is not None:
        options["pool_size"] = settings.db_pool_size
    if settings.db_max_overflow is not None:
        options["max_overflow"] = settings.db_max_overflow
    return options


SQLITE_REQUEST_SLOTS = 2
"""SQLite reads hand the GIL back and forth once per row, so more threads reading at once
are slower in all (bench/results/api-throughput.md): two at a time keep both cores busy."""


def request_slots(settings: Settings, engine: Engine) -> int:
    """How many requests may use the database at once: fewer than the pool holds, so the
    controller, event streams and key lookups always find a connection too."""
    if settings.db_request_slots is not None:
        return settings.db_request_slots
    pool = engine.pool
    size = pool.size() if isinstance(pool, QueuePool) else 1
    # QueuePool has no public getter for its overflow limit
    room = size + (pool._max_overflow if isinstance(pool, QueuePool) else 0)
    wanted = SQLITE_REQUEST_SLOTS if is_sqlite(settings.database_url) else size
    return max(1, min(wanted, room - 1))


def make_controller(settings: Settings, sessions: sessionmaker[Session]) -> Controller:
    return Controller(
        sessions,
        sqlite=is_sqlite(settings.database_url),
        interval_s=settings.reconcile_interval_s,
        replica_ttl_s=settings.replica_ttl_s,
        checkpoint_root=absolute(settings.checkpoint_root),
        ray_address=settings.ray_address,
        max_attempts=settings.max_attempts,
        ray_num_cpus=settings.ray_num_cpus,
        launch=settings.launch_jobs,
    )


def agent_engine_options(settings: Settings) -> dict[str, Any]:
    """The agents' own pool: heartbeat threads, link reports and key lookups, the lease
    monitor. Small, and never drawn on by tenant or admin requests, so no stream or burst of
    them can make a heartbeat wait for a connection."""
    return {
        **engine_options(settings),
        "pool_size": group_writers(settings.database_url) + 2,
        "max_overflow": 2,
    }


class BackgroundLoops:
    """The lease monitor and the controller's reconcile loop of one app, started together."""

    def __init__(
        self,
        app: FastAPI,
        settings: Settings,
        sessions: sessionmaker[Session],
        agent_sessions: sessionmaker[Session],
        policy: LeasePolicy,
    ) -> None:
        self.app, self.settings, self.policy = app, settings, policy
        self.sessions, self.agent_sessions = sessions, agent_sessions
        self.monitor: LeaseMonitor | None = None
        self.controller: Controller | None = None

    def start(self) -> None:
        state: AppState = self.app.state.cpn
        metrics = state.metrics

        def on_moved(moved: list[tuple[str, str, str]]) -> None:
            state.peers.invalidate()
            for _name, _from, to in moved:
                metrics.lease_transitions.labels(to).inc()

        controller = make_controller(self.settings, self.sessions)
        controller.on_placed = lambda p: metrics.observe_placement(p.waited_s, p.decided_s)
        controller.start()  # first: on SQLite it refuses while another controller is live
        self.controller = controller
        period = self.settings.monitor_period()
        self.monitor = LeaseMonitor(self.agent_sessions, self.policy, period, on_moved)
        self.monitor.start()

    def stop(self) -> None:
        if self.controller:
            self.controller.stop()
            self.controller = None
        if self.monitor:
            self.monitor.stop()
            self.monitor = None


ROUTERS = (agent, jobs, health, clusters, links, tenants, pricing, usage, providers)
"""Included hottest first: FastAPI tries routers in this order and each its routes in turn, so
otherwise every heartbeat would match its path against every admin route first, a visible
share of its CPU (measured: bench/results/api-throughput.md)."""
DOCS_ORDER = (health, clusters, links, tenants, pricing, jobs, usage, providers, agent)
"""The documentation's sections in reading order, whatever the routing order."""

AGENT_THREADS = 2
"""Threads for agents' key lookups and link reports, apart from the shared pool of 40 that
tenant requests may fill."""


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    refused = admin_token_problem(settings.admin_token)
    if refused:
        raise ValueError(refused)
    engine = make_engine(settings.database_url, **engine_options(settings))
    sessions = make_sessionmaker(engine)
    agent_engine = make_engine(settings.database_url, **agent_engine_options(settings))
    agent_sessions = make_sessionmaker(agent_engine)
    metrics = Metrics()
    policy = LeasePolicy(settings.heartbeat_interval_s, settings.lease_grace_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        reason = pending_reason(engine)
        if reason:
            raise NotMigrated(f"cpn serve cannot start: {reason}")
        written = bootstrap_admin(settings, sessions)
        if written:
            say_generated(written)
        loops = BackgroundLoops(app, settings, sessions, agent_sessions, policy)
        elected = None
        if settings.run_controller:
            where = election.lock_path(settings)
            if where is None:
                loops.start()
            else:  # one of several workers: the one holding the lock runs them
                elected = election.ElectedLoops(where, loops.start, loops.stop)
                elected.begin()
        try:
            yield
        finally:
            if elected is not None:
                elected.end()
            else:
                loops.stop()
            engine.dispose()
            agent_engine.dispose()

    app = FastAPI(
        title="cpn",
        version=VERSION,
        summary="Cross-datacenter compute-network orchestrator",
        description="Admin API over clusters, links, GPUs, tenants and keys; the agent protocol.",
        lifespan=lifespan,
        openapi_tags=[{"name": str(m.router.tags[0])} for m in DOCS_ORDER],
        **docs.fastapi_urls(settings),
    )
    docs.install(app, settings)
    docs.document_problems(app)
    # Error text a tenant may read (worker errors in job events) masks these too.
    scrub.remember(settings.admin_token, settings.database_url)
    peers = PeerTable(discovery=settings.link_discovery)
    app.state.cpn = AppState(
        settings=settings,
        engine=engine,
        sessions=sessions,
        agent_engine=agent_engine,
        agent_sessions=agent_sessions,
        agent_threads=anyio.CapacityLimiter(AGENT_THREADS),
        db_slots=anyio.Semaphore(request_slots(settings, engine)),
        streams=StreamSlots(settings.max_streams_per_key, settings.stream_max_s),
        failure_audit=FailureAudit(),
        metrics=metrics,
        lease_policy=policy,
        peers=peers,
        principals=keys.PrincipalCache(),
        rendered_jobs=RenderedJobs(),
        heartbeats=HeartbeatBatcher(
            agent_sessions,
            policy,
            peers,
            workers=group_writers(settings.database_url),
            window_s=settings.heartbeat_batch_window_s,
            max_batch=settings.heartbeat_batch_max,
        ),
        console_sessions=ConsoleSessions(sessions),
        rate_limits=RateLimits.from_settings(settings),
        submissions=SubmissionBatcher(
            sessions,
            task_modules=settings.task_prefixes(),
            max_queued=settings.max_queued_jobs,
            workers=group_writers(settings.database_url),
            analyzer=None if is_sqlite(settings.database_url) else BurstAnalyzer(engine),
        ),
    )
    problems.install(app)
    for module in ROUTERS:
        app.include_router(module.router)
    console.install(app)  # the web console at /ui
    app.add_middleware(problems.BodySizeLimit, limit=settings.max_body_bytes)
    ratelimit.install(app, app.state.cpn.rate_limits, metrics)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app
