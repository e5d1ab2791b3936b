"""The rate limits' decisions, pure: `TokenBucket`, `BucketTable` and `RateLimits` take data
and `now` and answer a `Refusal` or None. Tables are LRU-bounded: junk tokens or addresses can
only evict others' buckets, and an evicted bucket comes back full, so a flood makes the limits
looser for a moment, never shuts out a good caller. `api.ratelimit` asks them from the
middleware and the quote dependency."""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from enum import StrEnum

from api.config import Settings

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


FLOOD_FACTOR = 10
"""An address's failed authentications, of all its keys together, may reach this many times
`CPN_AUTH_FAIL_LIMIT` a minute before its unknown keys are refused: the limit itself counts
per key (`credential_tag`), so others' wrong keys behind the same NAT never refuse a good one;
this bound keeps a flood of random keys from costing a lookup each."""

TAG_CHARS = 20
"""`cpn_tenant_` and the 8 characters of a minted key's prefix, and a little more."""


def credential_tag(token: str | None) -> str:
    """What failures are counted by besides the address: the start of the presented key (a
    minted key's role and prefix), never enough of it to matter (the rest is 35+ random
    characters); "" for a session cookie or no key."""
    return "" if token is None else token[:TAG_CHARS]


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
        """Per address and credential tag: a key guessed at from one address backs off."""
        self.address_failures = _per_minute(auth_fail_limit * FLOOD_FACTOR)
        """Per address, all tags together: the flood bound."""
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
        self,
        *,
        address: str,
        key_hash: str | None,
        known_key: bool,
        agent: bool,
        now: float,
        tag: str = "",
    ) -> Refusal | None:
        """Whether a request may go on, before anyone looks its key up.

        `known_key`: the key is live in the principal cache (no query to authenticate it);
        `tag`: the key's `credential_tag`. A request without a key passes: it gets its 401
        without touching the database."""
        if key_hash is None:
            return None
        if not known_key and (refused := self.admit_lookup(address, now, tag)):
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

    def admit_lookup(self, address: str, now: float, tag: str = "") -> Refusal | None:
        """Whether a credential from `address` may be looked up in the database (a key not
        cached here, a console session cookie): not while keys with its `tag` failed more
        than the limit a minute from that address, nor while the address's failures of all
        keys together are over `FLOOD_FACTOR` times the limit."""
        if self.auth_failures is None or self.address_failures is None:
            return None
        wait = self.auth_failures.wait(f"{address} {tag}", now)
        if wait > 0:
            return Refusal(
                Limit.AUTH_FAILURES,
                wait,
                "too many failed authentications of this key from this address (more than "
                f"{self.auth_fail_limit} a minute, CPN_AUTH_FAIL_LIMIT); send a valid key "
                "after Retry-After seconds",
            )
        wait = self.address_failures.wait(address, now)
        if wait > 0:
            return Refusal(
                Limit.AUTH_FAILURES,
                wait,
                "too many failed authentications from this address (more than "
                f"{self.auth_fail_limit * FLOOD_FACTOR} a minute, {FLOOD_FACTOR} x "
                "CPN_AUTH_FAIL_LIMIT); send a valid key after Retry-After seconds",
            )
        return None

    def auth_failed(self, address: str, now: float, tag: str = "") -> None:
        """Count a presented key that failed to authenticate against its address and tag."""
        if self.auth_failures is not None and self.address_failures is not None:
            self.auth_failures.take(f"{address} {tag}", now)
            self.address_failures.take(address, now)

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
