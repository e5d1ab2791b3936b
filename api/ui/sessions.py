"""Console sign-ins: an opaque cookie naming a server-side session that holds the API key.

The key never reaches the page's script: the browser keeps only a random session id in an
HttpOnly, SameSite=Strict cookie. Requests that change something and arrive with the cookie
must also carry the session's CSRF token in a header, which only the console's own pages can
read and set (another origin can neither read it nor send a custom header without a CORS
preflight that cpn never answers). Sessions live in this process: behind several replicas,
route a browser to one (sticky sessions) or sign in again after a restart.
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass

SESSION_COOKIE = "cpn_session"
CSRF_HEADER = "X-CPN-CSRF"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
SESSION_TTL_S = 12 * 3600.0
"""A console sign-in lasts this long (the key's own revocation or expiry ends it sooner)."""


@dataclass(frozen=True)
class ConsoleSession:
    token: str
    """The API key signed in with (kept here, never sent back to the browser)."""
    csrf: str
    expires: float


class ConsoleSessions:
    """Open sign-ins by session id, at most `max_entries` (the oldest go first). Thread-safe;
    callers pass `now` (a monotonic clock)."""

    def __init__(self, ttl_s: float = SESSION_TTL_S, max_entries: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._open: OrderedDict[str, ConsoleSession] = OrderedDict()

    def open(self, token: str, now: float) -> tuple[str, ConsoleSession]:
        sid = secrets.token_urlsafe(32)
        session = ConsoleSession(token, secrets.token_urlsafe(32), now + self.ttl_s)
        with self._lock:
            self._open[sid] = session
            while len(self._open) > self.max_entries:
                self._open.popitem(last=False)
        return sid, session

    def get(self, sid: str | None, now: float) -> ConsoleSession | None:
        if not sid:
            return None
        with self._lock:
            session = self._open.get(sid)
            if session is not None and session.expires <= now:
                del self._open[sid]
                return None
            return session

    def close(self, sid: str | None) -> None:
        with self._lock:
            self._open.pop(sid or "", None)


def csrf_ok(session: ConsoleSession, method: str, sent: str | None) -> bool:
    """Whether a cookie-authenticated request may go on: reads always, changes only with the
    session's CSRF token in the header."""
    if method.upper() in SAFE_METHODS:
        return True
    return sent is not None and secrets.compare_digest(sent, session.csrf)
