"""Console sign-ins: an opaque cookie naming a server-side session that names the API key.

The key never reaches the page's script: the browser keeps only a random session id in an
HttpOnly, SameSite=Strict cookie. Requests that change something and arrive with the cookie
must also carry the session's CSRF token in a header, which only the console's own pages can
read and set (another origin can neither read it nor send a custom header without a CORS
preflight that cpn never answers).

Sessions live in the database (`console_sessions`), so every worker process and every replica
knows them and a sign-out ends one everywhere. A row is keyed by the SHA-256 of the cookie's
id and names the key by its hash: the table holds nothing a caller could present.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, select
from sqlalchemy.orm import Session, sessionmaker

from controller.store.models import ConsoleSignIn

SESSION_COOKIE = "cpn_session"
CSRF_HEADER = "X-CPN-CSRF"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
SESSION_TTL_S = 12 * 3600.0
"""A console sign-in lasts this long (the key's own revocation or expiry ends it sooner)."""
MAX_PER_KEY = 20
"""Open sign-ins one key may hold; a new one beyond ends its oldest (a script signing in in a
loop fills no table)."""


@dataclass(frozen=True)
class ConsoleSession:
    key_hash: str
    """The SHA-256 of the API key signed in with (the key itself is never kept)."""
    csrf: str
    expires: datetime


def _row_id(sid: str) -> str:
    return hashlib.sha256(sid.encode()).hexdigest()


class ConsoleSessions:
    """Open sign-ins, read and written through short sessions of their own (call from a
    worker thread: each method is a database round trip). Callers pass `now` (UTC)."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        ttl_s: float = SESSION_TTL_S,
        max_per_key: int = MAX_PER_KEY,
    ) -> None:
        self.sessions = sessions
        self.ttl_s = ttl_s
        self.max_per_key = max_per_key

    def open(self, key_hash: str, now: datetime) -> tuple[str, ConsoleSession]:
        """A new sign-in for the key of `key_hash`: its cookie value and its session. Expired
        sign-ins, and this key's oldest beyond `max_per_key`, go in the same transaction."""
        sid = secrets.token_urlsafe(32)
        session = ConsoleSession(
            key_hash, secrets.token_urlsafe(32), now + timedelta(seconds=self.ttl_s)
        )
        with self.sessions() as db, db.begin():
            db.execute(delete(ConsoleSignIn).where(ConsoleSignIn.expires_at <= now))
            keep = self.max_per_key - 1
            older = db.scalars(
                select(ConsoleSignIn.id)
                .where(ConsoleSignIn.key_hash == key_hash)
                .order_by(ConsoleSignIn.created_at.desc(), ConsoleSignIn.id)
                .offset(keep)
            ).all()
            if older:
                db.execute(delete(ConsoleSignIn).where(ConsoleSignIn.id.in_(older)))
            db.add(
                ConsoleSignIn(
                    id=_row_id(sid),
                    key_hash=key_hash,
                    csrf=session.csrf,
                    created_at=now,
                    expires_at=session.expires,
                )
            )
        return sid, session

    def get(self, sid: str | None, now: datetime) -> ConsoleSession | None:
        """The live sign-in named by cookie value `sid` (None: none, or expired)."""
        if not sid or len(sid) > 128:
            return None
        with self.sessions() as db:
            row = db.get(ConsoleSignIn, _row_id(sid))
            if row is None or row.expires_at <= now:
                return None
            return ConsoleSession(row.key_hash, row.csrf, row.expires_at)

    def close(self, sid: str | None) -> None:
        if not sid or len(sid) > 128:
            return
        with self.sessions() as db, db.begin():
            db.execute(delete(ConsoleSignIn).where(ConsoleSignIn.id == _row_id(sid)))


def csrf_ok(session: ConsoleSession, method: str, sent: str | None) -> bool:
    """Whether a cookie-authenticated request may go on: reads always, changes only with the
    session's CSRF token in the header."""
    if method.upper() in SAFE_METHODS:
        return True
    return sent is not None and secrets.compare_digest(sent, session.csrf)
