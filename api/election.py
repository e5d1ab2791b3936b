"""Which of `cpn serve --workers N`'s processes runs the background loops.

The controller and the lease monitor run in exactly one worker at a time: the one holding an
exclusive lock on a file in `workers_dir`. The kernel drops the lock with its holder, so when
that worker dies, another (or its replacement, which uvicorn's supervisor starts) takes the
loops over.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from api.config import Settings

log = logging.getLogger("cpn.api")
LOOPS_LOCK = "loops.lock"
RETRY_S = 1.0
"""How often a worker without the loops tries the lock, and how often the one that took it
retries starting them while the previous holder's controller row is still live (SQLite)."""


class ElectedLoops:
    """Runs `start` in this process once it holds the exclusive lock on `lock_path`, and
    `stop` at `end()` if it did. `start` raising (another controller still registered) is
    retried every `retry_s` until it succeeds or `end()` is called."""

    def __init__(
        self,
        lock_path: Path,
        start: Callable[[], None],
        stop: Callable[[], None],
        retry_s: float = RETRY_S,
    ) -> None:
        self.lock_path = lock_path
        self._start, self._stop = start, stop
        self.retry_s = retry_s
        self._ending = threading.Event()
        self._running = False
        self._fd: int | None = None
        self.tries = 0
        """Attempts at the lock so far (a test's way to know a waiter has been refused)."""
        self._thread = threading.Thread(target=self._run, name="cpn-loops-election", daemon=True)

    @property
    def running(self) -> bool:
        """Whether this process runs the loops now."""
        return self._running

    def begin(self) -> None:
        self._thread.start()

    def end(self) -> None:
        self._ending.set()
        self._thread.join(timeout=60)
        if self._running:
            self._stop()
            self._running = False
        if self._fd is not None:
            os.close(self._fd)  # releases the lock
            self._fd = None

    def _run(self) -> None:
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        self._fd = fd
        while True:
            self.tries += 1
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if self._ending.wait(self.retry_s):
                    return
        log.info("worker %d holds the background loops", os.getpid())
        failures = 0
        while not self._ending.is_set():
            try:
                self._start()
            except Exception as exc:  # said once, then retried quietly
                failures += 1
                level = logging.WARNING if failures == 1 else logging.DEBUG
                log.log(level, "cannot start the background loops yet (%s); retrying", exc)
                if self._ending.wait(self.retry_s):
                    return
                continue
            self._running = True
            return


def lock_path(settings: Settings) -> Path | None:
    """The election's lock file when this process is one of several workers."""
    return Path(settings.workers_dir) / LOOPS_LOCK if settings.workers_dir else None
