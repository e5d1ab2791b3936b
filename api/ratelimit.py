"""Rate limits: per API key, per agent key, failed authentications per address, quotes per tenant.

The decisions are pure (`api.limits`: data and `now` in, a `Refusal` or None out); the
middleware and the quote dependency here only read the request, ask, and answer a 429 problem
with `Retry-After`. Limits live in this process: with N replicas the
effective limit is N times each setting.

Keys are told apart by the SHA-256 of the bearer token (what the key table stores), so the
per-key limit needs no database round trip, and an address over its failed-authentication
limit is refused before its token reaches the database.

Agents (`/v1/agent/*`) draw from buckets of their own (`CPN_AGENT_RATE_LIMIT`, high: a beat
every few seconds is the norm), so tenant traffic, however heavy, never spends an agent's
allowance; and a key this process already knows as live passes an address that is over its
failed-authentication limit (its lookup costs no query), so an agent behind the same NAT as a
junk-token flood keeps beating.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.deps import app_state, get_principal
from api.limits import RateLimits, Refusal, credential_tag
from api.metrics import Metrics
from api.problems import problem
from api.sessions import SESSION_COOKIE
from controller.access.keys import Principal, PrincipalCache, hash_key

AGENT_PREFIX = "/v1/agent/"


class TooManyRequests(Exception):
    """Raised by a dependency; answered as a 429 problem by the handler `install` adds."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.detail)
        self.refusal = refusal


def too_many(refusal: Refusal, instance: str | None) -> JSONResponse:
    return problem(
        429,
        "Too many requests",
        refusal.detail,
        slug="rate-limited",
        instance=instance,
        headers={"Retry-After": refusal.retry_after()},
    )


def _bearer(scope: Scope) -> str | None:
    """The bearer token, parsed as `HTTPBearer` does (None when absent or not bearer)."""
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token:
                return token
            return None
    return None


def _has_session_cookie(scope: Scope) -> bool:
    return any(
        name == b"cookie" and SESSION_COOKIE.encode() + b"=" in value
        for name, value in scope.get("headers", [])
    )


class RateLimitMiddleware:
    """Refuses over-limit requests before routing (so before any key lookup), and counts
    each 401 against the address that earned it."""

    def __init__(
        self,
        app: ASGIApp,
        limits: RateLimits,
        principals: PrincipalCache,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app = app
        self.limits = limits
        self.principals = principals
        self.metrics = metrics
        self.clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        token = _bearer(scope)
        key_hash = hash_key(token) if token else None
        client = scope.get("client")
        address = client[0] if client else "unknown"
        # a console session cookie is looked up in the database too, so a junk one counts
        cookie = token is None and _has_session_cookie(scope)
        tag = credential_tag(token)
        refusal = (
            self.limits.admit_lookup(address, self.clock())
            if cookie
            else self.limits.admit(
                address=address,
                key_hash=key_hash,
                known_key=key_hash is not None and self.principals.get(key_hash) is not None,
                agent=scope.get("path", "").startswith(AGENT_PREFIX),
                now=self.clock(),
                tag=tag,
            )
        )
        if refusal is not None:
            self.metrics.rate_limited.labels(refusal.limit.value).inc()
            await too_many(refusal, scope.get("path"))(scope, receive, send)
            return

        presented = token is not None or cookie

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 401:
                self.metrics.auth_failures.labels("rejected" if presented else "missing").inc()
                if presented:  # only what cost a lookup counts; a missing key costs nothing
                    self.limits.auth_failed(address, self.clock(), tag)
            await send(message)

        await self.app(scope, receive, send_wrapper)


async def limit_quotes(
    request: Request, principal: Annotated[Principal, Depends(get_principal)]
) -> None:
    """The quote route's dependency: after authentication, before the body is validated, a
    session is opened or the planner runs, spend one of the tenant's quotes (429 when there is
    none). On that route alone: as a dependency of every jobs route it cost each submission
    and list read a dependency solve for nothing."""
    if principal.role != "tenant" or principal.scope is None:
        return  # an admin is refused by the route itself (tenants only)
    state = app_state(request)
    refusal = state.rate_limits.admit_quote(principal.scope, time.monotonic())
    if refusal is not None:
        state.metrics.rate_limited.labels(refusal.limit.value).inc()
        raise TooManyRequests(refusal)


def install(app: FastAPI, limits: RateLimits, metrics: Metrics) -> None:
    """Answer `TooManyRequests` as a 429 problem and add the middleware over `limits` (the
    app's own, `AppState.rate_limits`; call it where it should sit: outside body parsing,
    inside request metrics)."""

    async def _too_many(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, TooManyRequests)
        return too_many(exc.refusal, request.url.path)

    app.add_exception_handler(TooManyRequests, _too_many)
    app.add_middleware(
        RateLimitMiddleware, limits=limits, principals=app.state.cpn.principals, metrics=metrics
    )
