"""Execution layer: training across clusters on Ray actors, data parallel (compressed and
loosely synchronised between clusters) or as a pipeline of stages (and hybrid).

`run(spec, on_progress, should_stop) -> TrainReport` is the one entry for the controller and
the CLI, for a `TrainSpec` or a `training.pipeline.PipelineSpec`; importing this package stays
light (torch and Ray load on `run`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from training.placement import cluster_resource
from training.results import WanBytes
from training.spec import LinkSpec, Progress, TrainReport, TrainSpec

if TYPE_CHECKING:
    from training.faults import Membership
    from training.pipeline.spec import PipelineSpec
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
    spec: TrainSpec | PipelineSpec,
    on_progress: Callable[[Progress], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    pool: WorkerPool | None = None,
    membership: Callable[[], Membership | None] | None = None,
) -> TrainReport:
    """Run a training job to the end: `training.runner.run` for data parallelism (`pool`
    keeps its workers for the next run; `membership` moves it to other clusters mid-run),
    `training.pipeline.report.run` for a pipeline."""
    if isinstance(spec, TrainSpec):
        from training.runner import run as data_parallel

        return data_parallel(spec, on_progress, should_stop, pool, membership)
    from training.pipeline.report import run as pipelined

    return pipelined(spec, on_progress, should_stop)
