"""Keeping PostgreSQL's statistics of `jobs` current through a tenant's burst of submissions.

The job list reads a tenant's newest page along an index of `created_at` only when
PostgreSQL expects the tenant to have many jobs. A tenant whose jobs arrived since `jobs` was
last analyzed is estimated at a row or two, so every read of its list scans and sorts all of
them instead of stopping after a page of the index, until autovacuum's next analyze, up to
its naptime (a minute by default) later. Autovacuum counts the table's changes, not a
tenant's share, so a burst in a large table may not trigger it at all
(measured: bench/results/replicas.md).

The submission batcher knows each burst as it writes it: `BurstPolicy` (pure) says when a
tenant has inserted enough jobs since the last analyze this process ran, and `BurstAnalyzer`
runs `ANALYZE jobs` then, on a thread of its own, one at a time. ANALYZE reads a bounded
sample (30,000 rows at the default statistics target), whatever the table's size.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from sqlalchemy import text
from sqlalchemy.engine import Engine

log = logging.getLogger("cpn.controller")


@dataclass
class BurstPolicy:
    """When to analyze: a tenant has inserted `min_jobs` since the last analyze, and the last
    one started at least `min_interval_s` ago (so many busy tenants cost one analyze an
    interval, not one each). Counted per process: a burst spread over N replicas reaches each
    one's count after N x `min_jobs`, so the count is low (a list of that many jobs still
    sorts cheaply) and the interval bounds the cost (bench/results/replicas.md)."""

    min_jobs: int = 250
    min_interval_s: float = 10.0
    since: Counter[str] = field(default_factory=Counter)
    last_at: float | None = None
    most: int = 0
    """The largest count in `since` (counts only grow until cleared): no scan of every tenant
    on each batch."""

    def inserted(self, tenants: Iterable[str], now: float, busy: bool = False) -> bool:
        """Count newly inserted jobs by tenant; whether to analyze now (never while one is
        `busy`). A yes resets the counts: the analyze it starts sees every job inserted
        before it."""
        for tenant in tenants:
            self.since[tenant] += 1
            self.most = max(self.most, self.since[tenant])
        if busy or self.most < self.min_jobs:
            return False
        if self.last_at is not None and now - self.last_at < self.min_interval_s:
            return False
        self.since.clear()
        self.most = 0
        self.last_at = now
        return True


class BurstAnalyzer:
    """Runs `ANALYZE jobs` when `BurstPolicy` says so, on a daemon thread, never two at once;
    a failed analyze is logged and left to autovacuum. PostgreSQL only: cpn never analyzes a
    SQLite database, whose planner then goes by fixed rules, not row estimates."""

    def __init__(
        self,
        engine: Engine,
        policy: BurstPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.policy = policy or BurstPolicy()
        self.clock = clock
        self._lock = threading.Lock()
        self._running = threading.Event()
        self.analyzed = 0

    def inserted(self, tenants: Iterable[str]) -> None:
        """Note jobs just committed (one tenant id each); maybe start an analyze."""
        with self._lock:
            due = self.policy.inserted(tenants, self.clock(), busy=self._running.is_set())
            if due:
                self._running.set()
        if due:
            threading.Thread(target=self._analyze, name="cpn-analyze-jobs", daemon=True).start()

    def _analyze(self) -> None:
        try:
            with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                conn.execute(text("ANALYZE jobs"))
            self.analyzed += 1
        except Exception as exc:  # the list only reads slower until autovacuum's analyze
            log.warning("ANALYZE jobs after a burst of submissions failed: %s", exc)
        finally:
            self._running.clear()
