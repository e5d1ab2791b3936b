"""Event streams' limits: how many one key holds open, and how they give their place back.

A stream holds no database connection (each poll takes a short session), but it holds a
worker's attention and a socket for as long as it is open, so each key gets a few
(`CPN_MAX_STREAMS_PER_KEY`) and each stream a lifetime (`CPN_STREAM_MAX_S`), after which the
client reconnects with `Last-Event-ID`. Counts live in this process: with N replicas a key
may hold N times the setting.
"""

from __future__ import annotations

import math
import threading
from collections.abc import AsyncIterable
from dataclasses import dataclass, field

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

RETRY_AFTER_MAX_S = 30.0
"""A refused client is told to come back within this long, even when the key's oldest stream
runs longer: most streams end (their job ends, their client leaves) well before their limit."""


@dataclass
class StreamSlot:
    """One open stream's place in its key's count; `release` may be called any number of
    times (the stream's end and the response's end both call it)."""

    slots: StreamSlots
    key_id: str
    started: float
    released: bool = field(default=False)

    def release(self) -> None:
        self.slots.release(self)


class StreamSlots:
    """Open streams per API key, at most `per_key` each. Thread-safe: routes take slots on
    worker threads, streams give them back on the event loop. Callers pass `now`."""

    def __init__(self, per_key: int, max_s: float) -> None:
        if per_key < 1:
            raise ValueError("per_key must be at least 1")
        self.per_key = per_key
        self.max_s = max_s
        self._lock = threading.Lock()
        self._open: dict[str, list[StreamSlot]] = {}

    def acquire(self, key_id: str, now: float) -> StreamSlot | None:
        """A slot for one more stream of `key_id`, or None when it has `per_key` open."""
        with self._lock:
            held = self._open.setdefault(key_id, [])
            if len(held) >= self.per_key:
                return None
            slot = StreamSlot(self, key_id, now)
            held.append(slot)
            return slot

    def release(self, slot: StreamSlot) -> None:
        with self._lock:
            if slot.released:
                return
            slot.released = True
            held = self._open.get(slot.key_id, [])
            if slot in held:
                held.remove(slot)
            if not held:
                self._open.pop(slot.key_id, None)

    def open(self, key_id: str | None = None) -> int:
        """Streams open now: of one key, or of all."""
        with self._lock:
            if key_id is not None:
                return len(self._open.get(key_id, []))
            return sum(len(v) for v in self._open.values())

    def retry_after(self, key_id: str, now: float) -> int:
        """Whole seconds until a refused key surely has a free slot (its oldest stream reaches
        its lifetime), capped at `RETRY_AFTER_MAX_S`; at least 1."""
        with self._lock:
            oldest = min((s.started for s in self._open.get(key_id, [])), default=now)
        wait = oldest + self.max_s - now
        return max(1, math.ceil(min(wait, RETRY_AFTER_MAX_S)))


class EventStream(StreamingResponse):
    """Server-sent events that give their slot back however the response ends: the stream
    finished, the client left, or sending failed before the stream ever started."""

    def __init__(self, content: AsyncIterable[str], slot: StreamSlot) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.slot = slot

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.slot.release()
