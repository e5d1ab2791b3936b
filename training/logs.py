"""What a worker prints: its stdout and stderr lines, kept for the job's log.

Each worker process installs one `Capture` on `sys.stdout` and `sys.stderr`: writes still go
where they went (Ray's worker log), and each complete line is also kept, bounded, until the
worker's next report takes it (`SegmentResult.logs`). Python-level writes only: what C code
writes to the file descriptors directly (gloo's own messages) is not seen.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TextIO

MAX_LINE_CHARS = 2000
"""A longer line is cut (and says so)."""
MAX_KEPT_LINES = 2000
"""Lines a worker keeps between two reports; older ones go first (the count is reported)."""


@dataclass(frozen=True)
class LogLine:
    """One line a worker (or the driver) wrote: `source` names it (`cluster/rank`, `driver`)."""

    at: float
    """Unix time the line was completed."""
    source: str
    stream: str
    """stdout or stderr."""
    text: str


class _Tee:
    """A text stream that writes through to `inner` and hands complete lines to `keep`."""

    def __init__(self, inner: TextIO, stream: str, capture: Capture) -> None:
        self.inner, self.stream, self.capture = inner, stream, capture
        self.partial = ""
        self.lock = threading.Lock()  # a sync mode's pool threads print too

    def write(self, text: str) -> int:
        written = self.inner.write(text)
        with self.lock:
            *lines, self.partial = (self.partial + text).split("\n")
            if len(self.partial) > MAX_LINE_CHARS:
                lines.append(self.partial)
                self.partial = ""
            for line in lines:
                self.capture.keep(self.stream, line)
        return written

    def flush(self) -> None:
        self.inner.flush()

    def __getattr__(self, name: str) -> object:  # encoding, isatty, fileno, ...
        return getattr(self.inner, name)


class Capture:
    """This process's kept lines; `source` is set by the worker that runs here now."""

    def __init__(self) -> None:
        self.source = "worker"
        self.lines: deque[LogLine] = deque(maxlen=MAX_KEPT_LINES)
        self.dropped = 0
        self.lock = threading.Lock()

    def keep(self, stream: str, text: str) -> None:
        text = text.rstrip("\r").replace("\x00", "\ufffd")  # no database stores a NUL
        if len(text) > MAX_LINE_CHARS:
            text = text[:MAX_LINE_CHARS] + f" [cut: {len(text)} characters]"
        with self.lock:
            if len(self.lines) == self.lines.maxlen:
                self.dropped += 1
            self.lines.append(LogLine(time.time(), self.source, stream, text))

    def take(self) -> tuple[LogLine, ...]:
        """The lines kept since the last take (a line saying how many were dropped first)."""
        with self.lock:
            out = list(self.lines)
            self.lines.clear()
            dropped, self.dropped = self.dropped, 0
        if dropped:
            note = f"[{dropped} earlier lines dropped: more than {MAX_KEPT_LINES} a report]"
            out.insert(0, LogLine(out[0].at if out else time.time(), self.source, "stderr", note))
        return tuple(out)


_CAPTURE: Capture | None = None


def capture(source: str) -> Capture:
    """This process's capture, installed on first use, now kept under `source`."""
    global _CAPTURE
    if _CAPTURE is None:
        _CAPTURE = Capture()
        sys.stdout = _Tee(sys.stdout, "stdout", _CAPTURE)
        sys.stderr = _Tee(sys.stderr, "stderr", _CAPTURE)
    _CAPTURE.source = source
    return _CAPTURE
