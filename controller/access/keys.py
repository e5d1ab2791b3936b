"""API keys: minted with enough entropy that a plain SHA-256 is a safe stored form.

A key is live until revoked or past its expiry. Of a minted key cpn keeps a short prefix of
its random part (8 characters of 43) to tell keys apart in lists; of a key handed in from
outside (CPN_ADMIN_TOKEN, a benchmark's fixed tokens) it keeps nothing but the hash.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import event, func, select
from sqlalchemy.orm import ORMExecuteState, Session, sessionmaker

from controller.store.models import ApiKey, utcnow

ROLES = ("admin", "tenant", "agent", "provider")
PREFIX_CHARS = 8
"""Characters of a minted key's random part kept in plain text (48 of its 256 bits)."""
ENV_KEY_NAME = "CPN_ADMIN_TOKEN"
"""The name of the admin key that CPN_ADMIN_TOKEN provides."""


@dataclass(frozen=True)
class Principal:
    """Who is calling: the key's id, role and scope (tenant id, cluster name or provider id),
    and until when
    the key is good (None: until revoked)."""

    key_id: str
    role: str
    scope: str | None
    expires_at: datetime | None = None

    def expired(self, now: datetime) -> bool:
        return self.expires_at is not None and now >= self.expires_at


def hash_key(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def mint(role: str) -> str:
    return f"cpn_{role}_{secrets.token_urlsafe(32)}"


def prefix_of(role: str, token: str, minted: bool) -> str:
    """What is stored in plain text of `token`: the start of a minted key's random part (so
    `cpn_tenant_AbCdEfGh...` lists as `AbCdEfGh`), nothing of a key cpn did not mint."""
    head = f"cpn_{role}_"
    if not minted or not token.startswith(head):
        return ""
    return token[len(head) : len(head) + PREFIX_CHARS]


def create_key(
    session: Session,
    role: str,
    scope: str | None,
    name: str = "",
    token: str | None = None,
    *,
    expires_at: datetime | None = None,
    from_env: bool = False,
) -> tuple[ApiKey, str]:
    """Store a new key and return it with its plaintext, which is never stored or shown again.

    `token`: a key made elsewhere (stored by hash only, no prefix); None mints one."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}")
    minted = token is None
    token = token or mint(role)
    key = ApiKey(
        name=name,
        key_hash=hash_key(token),
        prefix=prefix_of(role, token, minted),
        role=role,
        scope=scope,
        expires_at=expires_at,
        from_env=from_env,
    )
    session.add(key)
    session.flush()
    return key, token


def authenticate(session: Session, token: str) -> Principal | None:
    """The principal for a live key, or None if unknown, revoked or expired."""
    return authenticate_hash(session, hash_key(token))


def authenticate_hash(session: Session, key_hash: str) -> Principal | None:
    """`authenticate` by the key's hash (what a console session keeps)."""
    row = session.execute(
        select(ApiKey.id, ApiKey.role, ApiKey.scope, ApiKey.revoked_at, ApiKey.expires_at).where(
            ApiKey.key_hash == key_hash
        )
    ).first()
    if row is None or row.revoked_at is not None:
        return None
    principal = Principal(row.id, row.role, row.scope, row.expires_at)
    return None if principal.expired(utcnow()) else principal


def revoke(keys: Sequence[ApiKey], now: datetime | None = None) -> list[ApiKey]:
    """Revoke the live ones of `keys` (through the ORM, so every cache here forgets them at
    commit); return those that were live."""
    now = now or utcnow()
    live = [k for k in keys if k.revoked_at is None]
    for key in live:
        key.revoked_at = now
    return live


def revoke_scope(session: Session, role: str, scope: str) -> list[ApiKey]:
    """Revoke every live key of `role` bound to `scope` (a deleted tenant's, a deleted
    cluster's: a cluster re-created under the same name must not accept them)."""
    return revoke(
        session.scalars(
            select(ApiKey).where(
                ApiKey.role == role, ApiKey.scope == scope, ApiKey.revoked_at.is_(None)
            )
        ).all()
    )


@dataclass(frozen=True)
class EnvAdmin:
    """What adopting CPN_ADMIN_TOKEN did: its key, whether it was new, the keys it replaced."""

    key: ApiKey
    created: bool
    replaced: list[ApiKey]


def adopt_env_admin(session: Session, token: str) -> EnvAdmin:
    """Make `token` (CPN_ADMIN_TOKEN) an admin key and revoke the environment's earlier ones.

    A key revoked through the API stays revoked even if the environment still names it; every
    replica must be given the same token (each start revokes the environment keys it does not
    know)."""
    key = session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(token)))
    created = key is None
    if key is None:
        key, _ = create_key(session, "admin", None, ENV_KEY_NAME, token, from_env=True)
    elif key.role == "admin" and not key.from_env:
        key.from_env = True  # a minted admin key now handed in by the environment
    earlier = session.scalars(
        select(ApiKey).where(
            ApiKey.from_env.is_(True), ApiKey.id != key.id, ApiKey.revoked_at.is_(None)
        )
    ).all()
    return EnvAdmin(key, created, revoke(earlier))


# ---- principal cache -----------------------------------------------------------------------


class PrincipalCache:
    """Live principals by key hash, so most requests need no query to know their caller.

    Revocation bites at once in this process: a commit that changed an `ApiKey` evicts it
    (see the session events below) before the revoking request answers. Revocations made
    elsewhere (another replica, plain SQL) are seen through a watermark, the count and latest
    `revoked_at` of revoked keys, read at most every `check_s` seconds; a change clears the
    cache. A lookup that raced an eviction never puts its stale answer back (generations).
    """

    def __init__(self, check_s: float = 1.0, max_entries: int = 100_000) -> None:
        self.check_s = check_s
        self._max = max_entries
        self._lock = threading.Lock()
        self._entries: dict[str, Principal] = {}
        self._generation = 0
        self._checked_at = 0.0
        self._watermark: tuple[int, datetime | None] | None = None
        _caches.add(self)

    def get(self, key_hash: str) -> Principal | None:
        """The live principal of `key_hash`, if cached; an expired one is dropped."""
        principal = self._entries.get(key_hash)
        if principal is None or principal.expires_at is None:
            return principal
        if principal.expired(utcnow()):
            with self._lock:
                self._entries.pop(key_hash, None)
            return None
        return principal

    def generation(self) -> int:
        return self._generation

    def put(self, key_hash: str, principal: Principal, generation: int) -> None:
        """Keep `principal` unless something was evicted since `generation` was read."""
        with self._lock:
            if generation != self._generation:
                return
            if len(self._entries) >= self._max:
                self._entries.clear()
            self._entries[key_hash] = principal

    def evict(self, key_hashes: set[str] | None) -> None:
        """Forget these keys (None: all of them)."""
        with self._lock:
            self._generation += 1
            if key_hashes is None:
                self._entries.clear()
            else:
                for h in key_hashes:
                    self._entries.pop(h, None)

    def stale(self) -> bool:
        """Whether the watermark is due for a read (a peek: claims nothing)."""
        return time.monotonic() - self._checked_at >= self.check_s

    def due(self) -> bool:
        """Whether the revocation watermark should be read again; claims the check if so."""
        now = time.monotonic()
        with self._lock:
            if now - self._checked_at < self.check_s:
                return False
            self._checked_at = now
            return True

    def check(self, session: Session) -> None:
        """Read the revocation watermark; clear the cache if keys were revoked since."""
        count, latest = session.execute(
            select(func.count(), func.max(ApiKey.revoked_at)).where(ApiKey.revoked_at.is_not(None))
        ).one()
        mark = (int(count), latest)
        if mark != self._watermark:
            self.evict(None)
            self._watermark = mark


_caches: weakref.WeakSet[PrincipalCache] = weakref.WeakSet()
_CHANGED = "cpn.changed_api_keys"


def authenticate_cached(
    cache: PrincipalCache, sessions: sessionmaker[Session], key_hash: str
) -> Principal | None:
    """`authenticate_hash` through `cache`, with short sessions of its own (no connection
    kept)."""
    if cache.due():
        with sessions() as session:
            cache.check(session)
    principal = cache.get(key_hash)
    if principal is not None:
        return principal
    generation = cache.generation()
    with sessions() as session:
        principal = authenticate_hash(session, key_hash)
    if principal is not None:
        cache.put(key_hash, principal, generation)
    return principal


def _mark(session: Session | None, key_hash: str | None) -> None:
    if session is not None:
        changed = session.info.setdefault(_CHANGED, set())
        changed.add(key_hash)  # None stands for "some key, unknown which"


@event.listens_for(ApiKey, "after_update")
@event.listens_for(ApiKey, "after_delete")
def _key_changed(_mapper: Any, _conn: Any, key: ApiKey) -> None:
    _mark(Session.object_session(key), key.key_hash)


@event.listens_for(Session, "do_orm_execute")
def _bulk_key_change(state: ORMExecuteState) -> None:
    if (state.is_update or state.is_delete) and any(m.class_ is ApiKey for m in state.all_mappers):
        _mark(state.session, None)


@event.listens_for(Session, "after_commit")
def _evict_committed(session: Session) -> None:
    changed: set[str | None] | None = session.info.pop(_CHANGED, None)
    if changed:
        hashes = None if None in changed else {h for h in changed if h is not None}
        for cache in list(_caches):
            cache.evict(hashes)


@event.listens_for(Session, "after_rollback")
def _forget_rolled_back(session: Session) -> None:
    session.info.pop(_CHANGED, None)
