"""FastAPI dependencies: the database session and the calling principal.

Agents' routes (`/v1/agent/*`) draw sessions from a small pool of their own and look keys up
on threads of their own, so heartbeats never queue behind tenant traffic for a connection or
a thread (that pool also serves the lease monitor)."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any, cast

import anyio
from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import Engine
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session, sessionmaker

from api.config import Settings
from api.heartbeats import HeartbeatBatcher
from api.job_list import RenderedJobs
from api.limits import RateLimits
from api.metrics import Metrics
from api.sessions import CSRF_HEADER, SESSION_COOKIE, ConsoleSession, ConsoleSessions, csrf_ok
from api.streams import StreamSlots
from api.submissions import SubmissionBatcher
from controller.access.keys import Principal, PrincipalCache, authenticate_cached, hash_key
from controller.network.leases import LeasePolicy
from controller.network.resources import PeerTable
from controller.store.models import AuditLog, utcnow

log = logging.getLogger("cpn.api")
_bearer = HTTPBearer(auto_error=False, description="An API key: `Authorization: Bearer cpn_...`")
AGENT_PATHS = "/v1/agent/"


@dataclass(eq=False)
class AppState:
    """What one app holds for its requests, typed: built once by `api.app.create_app`, kept
    as `app.state.cpn` (the only attribute there) and read through `app_state`."""

    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    agent_engine: Engine
    """The agents' own pool (module docstring)."""
    agent_sessions: sessionmaker[Session]
    agent_threads: anyio.CapacityLimiter
    db_slots: anyio.Semaphore
    """The replica's database slots a request takes before it opens a session."""
    streams: StreamSlots
    failure_audit: FailureAudit
    metrics: Metrics
    lease_policy: LeasePolicy
    peers: PeerTable
    principals: PrincipalCache
    rendered_jobs: RenderedJobs
    heartbeats: HeartbeatBatcher
    submissions: SubmissionBatcher
    console_sessions: ConsoleSessions
    rate_limits: RateLimits


def app_state(request: Request) -> AppState:
    """The app's typed state (a dependency, and a plain function for middleware)."""
    return cast(AppState, request.app.state.cpn)


StateDep = Annotated[AppState, Depends(app_state)]


def is_agent_path(path: str) -> bool:
    return path.startswith(AGENT_PATHS)


def sessions_for(request: Request) -> sessionmaker[Session]:
    """The agents' pool for the agent protocol, the shared one for everything else."""
    state = app_state(request)
    return state.agent_sessions if is_agent_path(request.url.path) else state.sessions


async def get_settings(request: Request) -> Settings:
    return app_state(request).settings


async def get_session(request: Request) -> AsyncIterator[Session]:
    """A session per request; routes commit what they change, the rest is rolled back.

    A request first takes one of the replica's database slots (`db_request_slots`), waiting
    on the event loop, so no worker thread ever blocks on the connection pool: a thread
    waiting for a connection while the connections' requests wait for a thread (FastAPI
    validates a sync route's answer on one) stalled the API at ~40 concurrent reads.

    Async so that FastAPI opens it on the event loop (a session connects lazily, on its first
    query, in the route's thread). Closing ends its transaction: in-process on SQLite, a
    round trip on a server database, so there a session still in one is closed on a thread
    (one that read with `autocommit_read` is in none).
    """
    slots = app_state(request).db_slots
    try:  # a free slot (the common case) is taken without a cancel scope or a checkpoint
        slots.acquire_nowait()
    except anyio.WouldBlock:
        timeout = app_state(request).settings.db_pool_timeout_s
        with anyio.move_on_after(timeout) as waited:
            await slots.acquire()
        if waited.cancelled_caught:
            raise PoolTimeout(
                f"no database slot of this replica was free within {timeout:g} s"
            ) from None
    try:
        session = sessions_for(request)()
        try:
            yield session
        finally:
            if (
                session.in_transaction()
                and session.get_bind().dialect.name != "sqlite"
                and not session.info.get(_NO_TRANSACTION)
            ):
                with anyio.CancelScope(shield=True):  # a client gone still frees the connection
                    await anyio.to_thread.run_sync(session.close)
            else:
                session.close()
    finally:
        slots.release()


def autocommit_read(session: Session) -> dict[str, Any]:
    """Execution options for a read whose statements need no snapshot in common: on a server
    database, no transaction, so no `BEGIN` and `ROLLBACK` round trips around it (the job
    list: its keys and count are one statement, and it answers rows read after them as
    read). SQLite's transactions cost no round trip: none asked there."""
    if session.get_bind().dialect.name == "sqlite":
        return {}
    session.info[_NO_TRANSACTION] = True  # so closing it needs no round trip, nor a thread
    return {"isolation_level": "AUTOCOMMIT"}


_NO_TRANSACTION = "cpn.no_transaction"


SessionDep = Annotated[Session, Depends(get_session)]
SettingsDep = Annotated[Settings, Depends(get_settings)]


async def get_principal(
    request: Request,
    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    """The caller, from the in-process cache when it can (no thread, no query), else the DB.

    A bearer key wins; without one, the console's session cookie names the key. The lookup
    uses a session of its own, so no request holds a pooled connection while it waits for a
    worker thread (which deadlocked the pool under many concurrent requests).
    """
    if creds is None or creds.scheme.lower() != "bearer" or not creds.credentials:
        key_hash = await console_key_hash(request)
        if key_hash is None:
            raise HTTPException(
                401,
                "missing bearer API key: send `Authorization: Bearer <key>`",
                headers={"WWW-Authenticate": "Bearer"},
            )
    else:
        key_hash = hash_key(creds.credentials)
    principal = await current_principal(request, key_hash)
    if principal is None:
        await audit_failure(request)
        raise HTTPException(
            401,
            "API key is unknown, revoked or expired: ask an admin for a valid key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return principal


async def request_principal(request: Request) -> Principal:
    """`get_principal` outside FastAPI's dependency solving (a handler, a route that reads
    the header itself)."""
    return await get_principal(request, await _bearer(request))


async def caller_key_hash(request: Request) -> str | None:
    """The hash of the request's bearer key, else of its console session's key (None:
    neither): what an open stream checks for liveness again and again."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token:
        return hash_key(token)
    session = await console_session(request)
    return session.key_hash if session else None


async def console_session(request: Request) -> ConsoleSession | None:
    """The live console sign-in named by the request's session cookie, if any (a database
    read on a worker thread; none without a cookie)."""
    store = app_state(request).console_sessions
    sid = request.cookies.get(SESSION_COOKIE)
    if not sid:
        return None
    return await anyio.to_thread.run_sync(store.get, sid, utcnow())


async def console_key_hash(request: Request) -> str | None:
    """The key hash of the request's console session (None: no session). A request that
    changes something must carry the session's CSRF token, or it is refused (403)."""
    session = await console_session(request)
    if session is None:
        return None
    if not csrf_ok(session, request.method, request.headers.get(CSRF_HEADER)):
        raise HTTPException(
            403,
            f"a console request that changes something needs the {CSRF_HEADER} header of its "
            "page; reload the page and retry",
        )
    # The rate-limit middleware tells keys apart by their bearer header; a console request has
    # none, so its key's bucket is taken here (the same bucket its bearer calls take from).
    limits = app_state(request).rate_limits
    address = request.client.host if request.client else "unknown"
    refusal = limits.admit(
        address=address,
        key_hash=session.key_hash,
        known_key=True,
        agent=False,
        now=time.monotonic(),
    )
    if refusal:
        app_state(request).metrics.rate_limited.labels(refusal.limit.value).inc()
        raise HTTPException(429, refusal.detail, headers={"Retry-After": refusal.retry_after()})
    return session.key_hash


async def current_principal(request: Request, key_hash: str) -> Principal | None:
    """The live principal of the key with hash `key_hash` now (None: unknown, revoked or
    expired). Open event streams ask again every second, so a revoked key's streams end."""
    state = app_state(request)
    cache = state.principals
    principal = None if cache.stale() else cache.get(key_hash)
    if principal is None:
        agent = is_agent_path(request.url.path)
        principal = await anyio.to_thread.run_sync(
            authenticate_cached,
            cache,
            state.agent_sessions if agent else state.sessions,
            key_hash,
            limiter=state.agent_threads if agent else None,
        )
    return principal


class FailureAudit:
    """Which failed authentications get an audit row: at most one per client address per
    `period_s` (the row counts the failures held back since), so a flood of junk keys costs a
    write a minute per address, not one per request. Pure: callers pass `now`."""

    def __init__(self, period_s: float = 60.0, max_entries: int = 10_000) -> None:
        self.period_s = period_s
        self.max_entries = max_entries
        self._seen: OrderedDict[str, tuple[float, int]] = OrderedDict()

    def record(self, address: str, now: float) -> int | None:
        """Count one failure from `address`: the failures the new row should carry, or None
        when that address had a row less than `period_s` ago."""
        last, held = self._seen.get(address, (None, 0))
        if last is not None and now - last < self.period_s:
            self._seen[address] = (last, held + 1)
            self._seen.move_to_end(address)
            return None
        self._seen[address] = (now, 0)
        self._seen.move_to_end(address)
        while len(self._seen) > self.max_entries:
            self._seen.popitem(last=False)
        return held + 1


async def audit_failure(request: Request) -> None:
    """Write the audit row of a presented key that failed, when `FailureAudit` says so (the
    count goes to `cpn_auth_failures_total` in the rate-limit middleware). Never the key."""
    state = app_state(request)
    address = request.client.host if request.client else "unknown"
    failures = state.failure_audit.record(address, anyio.current_time())
    if failures is None:
        return
    row: dict[str, Any] = {"path": request.url.path[:200], "failures": failures}
    try:
        await anyio.to_thread.run_sync(_write_failure, sessions_for(request), address, row)
    except Exception:  # the 401 matters more than its audit row
        log.exception("could not audit a failed authentication from %s", address)


def _write_failure(sessions: sessionmaker[Session], address: str, detail: dict[str, Any]) -> None:
    with sessions() as session:
        session.add(
            AuditLog(
                actor_key_id=None,
                action="auth.fail",
                target_type="client",
                target_id=address[:64],
                detail=detail,
            )
        )
        session.commit()


def require(*roles: str) -> Callable[[Principal], Awaitable[Principal]]:
    """A dependency that admits only keys of the given roles."""

    async def check(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
        if principal.role not in roles:
            raise HTTPException(
                403, f"this endpoint needs a key of role {' or '.join(roles)}, not {principal.role}"
            )
        return principal

    return check


AdminDep = Annotated[Principal, Depends(require("admin"))]
AgentDep = Annotated[Principal, Depends(require("agent"))]
ReaderDep = Annotated[Principal, Depends(require("tenant", "admin"))]
"""A tenant (routes scope it to its own objects) or an admin: who may read jobs and usage."""
PricerDep = Annotated[Principal, Depends(require("admin", "provider"))]
"""An admin (the operator's clusters) or a provider (its own clusters): who posts prices."""
