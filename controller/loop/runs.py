"""A run in this controller: what its thread hands to the loop, and what the loop asks of it.

The run's thread (`controller.loop.ray_run`) only appends progress and sets `report` or `error`;
the controller loop is the only writer to the database: it flushes the progress
(`controller.loop.progress`), asks the run to stop (`stop`), and settles it once it is done
(`controller.loop.settle`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from controller.loop.policy import Stop
from controller.store.models import utcnow
from training import LinkSpec, Progress, TrainReport
from training.faults import Membership


@dataclass(frozen=True)
class RunLayout:
    """Where a plan puts its run on `clusters`: their ring order, the links to emulate or
    pace, what each paced cluster's sends keep to, each cluster's share of the batch."""

    clusters: dict[str, int]
    links: tuple[LinkSpec, ...]
    wan_kbps: dict[str, int]
    batch_shares: dict[str, float]


@dataclass
class RunHandle:
    """A job's run: its unflushed progress, why it should stop, how it ended."""

    job_id: str
    clusters: dict[str, int]
    gpu_models: dict[str, str]
    flops_per_step: float
    predicted_step_s: float | None
    fence: int | None = None
    """The job's fencing epoch this run was launched with (`Job.fence`): once the job's moves
    on (adopted, launched again), this run's progress and settlement are refused. None: no
    run was launched (a launch that failed is settled as its job's attempt, unfenced)."""
    stop: Stop | None = None
    pending: list[Progress] = field(default_factory=list)
    wan_seen: dict[tuple[str, str], int] = field(default_factory=dict)
    wan_since: datetime = field(default_factory=utcnow)
    last_compute: tuple[int, dict[str, float]] | None = None
    reserved_kbps: dict[str, int] = field(default_factory=dict)
    """The WAN rate the run keeps to on each paced cluster (`TrainSpec.wan_kbps`)."""
    batch_shares: dict[str, float] = field(default_factory=dict)
    """Each cluster's share of the global batch (`TrainSpec.batch_shares`); empty: equal
    per worker."""
    wire_seen: tuple[float, dict[str, int]] | None = None
    """The last report's exchange seconds and bytes sent by each cluster."""
    short_reports: dict[str, int] = field(default_factory=dict)
    """Reports in a row in which a cluster sent below its reservation while exchanging."""
    live: bool = False
    """The run shrinks and grows in place (`training.faults`): a lost cluster leaves it."""
    wanted: Membership | None = None
    """The clusters the controller wants the run on (the run reads it between segments)."""
    running: dict[str, int] = field(default_factory=dict)
    """The clusters the run trains on now, from its last report."""
    step: int = 0
    """The steps the run has made, from its last report."""
    changes: list[dict[str, Any]] = field(default_factory=list)
    """Every cluster that left or joined the run so far (`Progress.membership`)."""
    changes_seen: int = 0
    """How many of the run's membership changes the controller has written down."""
    decisions_seen: int = 0
    """How many of the run's auto decisions (`Progress.auto_decisions`) are events already."""
    log_lines: int | None = None
    """The job's log lines (`JobLog`) after this run's last batch (None: none written yet):
    past `LOGS_KEPT`, the oldest are trimmed."""
    report: TrainReport | None = None
    error: BaseException | None = None
    ended_at: datetime | None = None
    """When the run's workers stopped: billing ends there, however late it is settled."""
    done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def should_stop(self) -> bool:
        return self.stop is not None

    def request_stop(self, stop: Stop) -> None:
        """Ask the run to stop, unless it was asked already (the first cause is kept)."""
        if self.stop is None:
            self.stop = stop

    def on_progress(self, progress: Progress) -> None:
        with self.lock:
            self.pending.append(progress)
            if progress.clusters:
                self.running = dict(progress.clusters)
            self.step = max(self.step, progress.step)
            self.changes = list(progress.membership)

    def new_changes(self) -> list[dict[str, Any]]:
        """The run's membership changes the controller has not written down yet."""
        with self.lock:
            out = self.changes[self.changes_seen :]
            self.changes_seen = len(self.changes)
        return out

    def membership(self) -> Membership | None:
        return self.wanted

    def want(self, clusters: dict[str, int], layout: RunLayout | None = None) -> None:
        """Ask the run to go on on `clusters` (a cluster left, or one joins), laid out as
        `layout` says (the job's plan on them; None: as the run sees fit)."""
        version = self.wanted.version + 1 if self.wanted is not None else 1
        if layout is None:
            self.wanted = Membership(version, dict(clusters))
            return
        self.wanted = Membership(
            version,
            {c: clusters[c] for c in layout.clusters if c in clusters}
            | {c: n for c, n in clusters.items() if c not in layout.clusters},
            links=layout.links,
            wan_kbps=dict(layout.wan_kbps),
            batch_shares=dict(layout.batch_shares),
        )

    def take(self) -> list[Progress]:
        with self.lock:
            out, self.pending = self.pending, []
        return out
