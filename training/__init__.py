"""Execution layer: compressed-gradient data parallelism across clusters on Ray actors.

`run(TrainSpec(...), on_progress, should_stop) -> TrainReport` is the library entry for the
controller and the CLI; importing this package stays light (torch and Ray load on `run`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from training.placement import cluster_resource
from training.results import WanBytes
from training.spec import LinkSpec, Progress, TrainReport, TrainSpec

if TYPE_CHECKING:
    from training.runner import WorkerPool

__all__ = [
    "LinkSpec",
    "Progress",
    "TrainReport",
    "TrainSpec",
    "WanBytes",
    "cluster_resource",
    "run",
]


def run(
    spec: TrainSpec,
    on_progress: Callable[[Progress], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    pool: WorkerPool | None = None,
) -> TrainReport:
    """Run a training job to the end; see `training.runner.run`."""
    from training.runner import run as _run

    return _run(spec, on_progress, should_stop, pool)
