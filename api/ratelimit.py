"""Rate limits: per API key, per agent key, failed authentications per address, quotes per tenant.

The decisions are pure (`TokenBucket`, `BucketTable`, `RateLimits`: data and `now` in, a
`Refusal` or None out); the middleware and the quote dependency only read the request, ask,
and answer a 429 problem with `Retry-After`. Limits live in this process: with N replicas the
effective limit is N times each setting.

Keys are told apart by the SHA-256 of the bearer token (what the key table stores), so the
per-key limit needs no database round trip, and an address over its failed-authentication
limit is refused before its token reaches the database. Tables are LRU-bounded: junk tokens or
addresses can only evict others' buckets, and an evicted bucket comes back full, so a flood
makes the limits looser for a moment, never shuts out a good caller.

Agents (`/v1/agent/*`) draw from buckets of their own (`CPN_AGENT_RATE_LIMIT`, high: a beat
every few seconds is the norm), so tenant traffic, however heavy, never spends an agent's
allowance; and a key this process already knows as live passes an address that is over its
failed-authentication limit (its lookup costs no query), so an agent behind the same NAT as a
junk-token flood keeps beating.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.config import Settings
from api.deps import app_state, get_principal
from api.metrics import Metrics
from api.problems import problem
from api.sessions import SESSION_COOKIE
from controller.access.keys import Principal, PrincipalCache, hash_key

AGENT_PREFIX = "/v1/agent/"
MAX_ENTRIES = 50_000
"""Buckets kept per table: ~10 MB at most, far more keys and addresses than one replica
serves at once."""


class Limit(StrEnum):
    """Which limit refused a request (the `limit` label of `cpn_rate_limited_total`)."""

    KEY = "key"
    AGENT = "agent"
    AUTH_FAILURES = "auth_failures"
    QUOTES = "quotes"


@dataclass(frozen=True)
class Refusal:
    limit: Limit
    retry_after_s: float
    detail: str

    def retry_after(self) -> str:
        """Whole seconds for the `Retry-After` header: never 0 (that invites a busy loop)."""
        return str(max(1, math.ceil(self.retry_after_s)))


@dataclass
class TokenBucket:
    """`rate` tokens a second up to `burst`; a request takes one. Pure: callers pass `now`."""

    rate: float
    burst: float
    tokens: float
    stamp: float

    @classmethod
    def full(cls, rate: float, burst: float, now: float) -> TokenBucket:
        return cls(rate, burst, burst, now)

    def _refill(self, now: float) -> None:
        elapsed = max(0.0, now - self.stamp)  # a clock that steps back refills nothing
        self.tokens = min(self.burst, self.tokens + elapsed * self.rate)
        self.stamp = max(self.stamp, now)

    def wait(self, now: float, cost: float = 1.0) -> float:
        """Seconds until `cost` tokens are there (0: now); takes nothing."""
        self._refill(now)
        missing = cost - self.tokens
        if missing <= 0:
            return 0.0
        return math.inf if self.rate <= 0 else missing / self.rate

    def take(self, now: float, cost: float = 1.0) -> float:
        """Take `cost` tokens and return 0, or take none and return the seconds to wait."""
        wait = self.wait(now, cost)
        if wait == 0.0:
            self.tokens -= cost
        return wait


class BucketTable:
    """One bucket per key, the least recently used dropped beyond `max_entries`."""

    def __init__(self, rate: float, burst: float, max_entries: int = MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.rate = rate
        self.burst = burst
        self.max_entries = max_entries
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def _bucket(self, key: str, now: float) -> TokenBucket:
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = TokenBucket.full(self.rate, self.burst, now)
            self._buckets[key] = bucket
            if len(self._buckets) > self.max_entries:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
        return bucket

    def take(self, key: str, now: float) -> float:
        """Take one token from `key`'s bucket: 0, or the seconds until one is there."""
        return self._bucket(key, now).take(now)

    def wait(self, key: str, now: float) -> float:
        """Seconds until `key` has a token; a key with no bucket has a full one (0)."""
        bucket = self._buckets.get(key)
        return 0.0 if bucket is None else bucket.wait(now)


def _per_second(rate: float) -> BucketTable | None:
    """A table allowing `rate`/s with a burst of twice that (at least one); None when 0 (off)."""
    return BucketTable(rate, max(2 * rate, 1.0)) if rate > 0 else None


def _per_minute(count: int) -> BucketTable | None:
    """A table allowing `count` at once and `count` a minute after that; None when 0 (off)."""
    return BucketTable(count / 60.0, float(count)) if count > 0 else None


class RateLimits:
    """Every limit's buckets and the decisions over them; no I/O, no clock of its own."""

    def __init__(
        self, key_rate: float, agent_rate: float, auth_fail_limit: int, quote_limit: int
    ) -> None:
        self.key_rate, self.agent_rate = key_rate, agent_rate
        self.auth_fail_limit, self.quote_limit = auth_fail_limit, quote_limit
        self.keys = _per_second(key_rate)
        self.agents = _per_second(agent_rate)
        self.auth_failures = _per_minute(auth_fail_limit)
        self.quotes = _per_minute(quote_limit)

    @classmethod
    def from_settings(cls, settings: Settings) -> RateLimits:
        return cls(
            settings.key_rate_limit,
            settings.agent_rate_limit,
            settings.auth_fail_limit,
            settings.quote_rate_limit,
        )

    def admit(
        self, *, address: str, key_hash: str | None, known_key: bool, agent: bool, now: float
    ) -> Refusal | None:
        """Whether a request may go on, before anyone looks its key up.

        `known_key`: the key is live in the principal cache (no query to authenticate it).
        A request without a key passes: it gets its 401 without touching the database."""
        if key_hash is None:
            return None
        if not known_key and (refused := self.admit_lookup(address, now)):
            return refused
        table, limit, rate = (
            (self.agents, Limit.AGENT, self.agent_rate)
            if agent
            else (self.keys, Limit.KEY, self.key_rate)
        )
        if table is None:
            return None
        wait = table.take(key_hash, now)
        if wait > 0:
            setting = "CPN_AGENT_RATE_LIMIT" if agent else "CPN_KEY_RATE_LIMIT"
            return Refusal(
                limit,
                wait,
                f"this key sent more than {rate:g} requests a second ({setting}, burst "
                f"{table.burst:g}); slow down and retry after Retry-After seconds",
            )
        return None

    def admit_lookup(self, address: str, now: float) -> Refusal | None:
        """Whether a credential from `address` may be looked up in the database (a key not
        cached here, a console session cookie): not once the address is over its limit of
        failed authentications."""
        if self.auth_failures is None:
            return None
        wait = self.auth_failures.wait(address, now)
        if wait <= 0:
            return None
        return Refusal(
            Limit.AUTH_FAILURES,
            wait,
            "too many failed authentications from this address (more than "
            f"{self.auth_fail_limit} a minute, CPN_AUTH_FAIL_LIMIT); send a valid key "
            "after Retry-After seconds",
        )

    def auth_failed(self, address: str, now: float) -> None:
        """Count a presented key that failed to authenticate against its address."""
        if self.auth_failures is not None:
            self.auth_failures.take(address, now)

    def admit_quote(self, tenant_id: str, now: float) -> Refusal | None:
        """Take one of the tenant's quotes (all its keys share them), or refuse."""
        if self.quotes is None:
            return None
        wait = self.quotes.take(tenant_id, now)
        if wait > 0:
            return Refusal(
                Limit.QUOTES,
                wait,
                f"this tenant asked for more than {self.quote_limit} quotes a minute "
                "(CPN_QUOTE_RATE_LIMIT, shared by all its keys); reuse a quote you have, or "
                "retry after Retry-After seconds",
            )
        return None


# ---- the edges: middleware, quote dependency, 429 answers -----------------------------------


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
        refusal = (
            self.limits.admit_lookup(address, self.clock())
            if cookie
            else self.limits.admit(
                address=address,
                key_hash=key_hash,
                known_key=key_hash is not None and self.principals.get(key_hash) is not None,
                agent=scope.get("path", "").startswith(AGENT_PREFIX),
                now=self.clock(),
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
                    self.limits.auth_failed(address, self.clock())
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
