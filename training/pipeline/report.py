"""A pipeline (or hybrid) run as every run is seen from outside: its segments as `Progress`,
its end as a `TrainReport`, the pipeline's own figures in `sync_stats`."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from training.pipeline.driver import run_pipeline
from training.pipeline.spec import PipelineReport, PipelineSpec, StageResult
from training.results import WanBytes
from training.spec import Progress, TrainReport


def stage_progress(
    spec: PipelineSpec,
    step: int,
    results: list[StageResult],
    wall_s: float,
    last_loss: float = 0.0,
) -> Progress:
    """A segment of a pipeline run as the controller's progress report: the activation bytes
    so far per link are what `controller.loop.progress` meters, like a data-parallel run's WAN
    bytes; compute and wait are the slowest stage replica's. The loss is the last stage's;
    without it, `last_loss` (the previous report's: JSON columns refuse NaN)."""
    wan = WanBytes()
    raw = 0
    compute: dict[str, float] = {}
    for r in results:
        wan = wan + r.wan
        raw += r.raw_bytes
        compute[r.cluster] = max(compute.get(r.cluster, 0.0), r.compute_s)
    loss = next((r.loss for r in results if r.loss is not None), None)
    return Progress(
        step=step,
        total_steps=spec.train.steps,
        loss=last_loss if loss is None else loss,
        accuracy=None,
        wall_s=wall_s,
        compute_s=max((r.compute_s for r in results), default=0.0),
        comm_s=max((r.wait_s for r in results), default=0.0),
        wan_bytes=wan,
        wan_bytes_total=wan.total,
        compression_ratio=raw / wan.total if wan.total else 1.0,
        compression=str(spec.activations),
        compute_by_cluster=compute,
    )


def report_of(spec: PipelineSpec, report: PipelineReport) -> TrainReport:
    """A pipeline run's report in the data-parallel report's shape (what settlement stores);
    the pipeline's own figures go in `sync_stats`."""
    wan = report.activation_bytes
    clusters: dict[str, int] = {}
    for row in report.pipelines or [report.stage_clusters] * report.replicas:
        for c in row:
            clusters[c] = clusters.get(c, 0) + report.tensor
    return TrainReport(
        task=report.task,
        clusters=clusters,
        compression=report.activations,
        sync=str(spec.train.sync),
        steps=report.steps,
        final_loss=report.final_loss,
        final_accuracy=report.final_accuracy,
        final_eval_loss=report.final_eval_loss,
        wall_s=report.wall_s,
        compute_s=max(report.stage_compute_s, default=0.0),
        comm_s=max(report.stage_wait_s, default=0.0),
        wan_s=0.0,
        wan_bytes=wan,
        wan_bytes_total=wan.total,
        compression_ratio=report.compression_ratio,
        wan_emulated=report.wan_emulated,
        links=[],
        restarts=0,
        resumed_from_step=report.resumed_from_step,
        stopped=report.steps < spec.train.steps,
        history=[{k: v for k, v in h.items() if v is not None} for h in report.history],
        sync_stats={
            "stages": float(len(report.stage_clusters)),
            "replicas": float(report.replicas),
            "whole_pipelines": float(bool(report.pipelines)),
            "tensor": float(report.tensor),
            "micro_batches": float(report.micro_batches),
            "bubble_fraction": report.bubble_fraction,
            "measured_bubble": report.measured_bubble,
        },
    )


def run(
    spec: PipelineSpec,
    on_progress: Callable[[Progress], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> TrainReport:
    """Train a pipeline (or hybrid) run to the end, reporting progress and the result as a
    data-parallel run does (`training.run` calls this for a `PipelineSpec`)."""
    t0 = time.perf_counter()
    last = [0.0]

    def segment(step: int, results: list[StageResult]) -> None:
        p = stage_progress(spec, step, results, time.perf_counter() - t0, last[0])
        last[0] = p.loss
        if on_progress is not None:
            on_progress(p)

    report = run_pipeline(spec, on_results=segment, should_stop=should_stop)
    out = report_of(spec, report)
    if on_progress is None:
        return out
    # the final evaluation's forward pass crossed the links too: metered with the rest
    on_progress(
        Progress(
            step=out.steps,
            total_steps=spec.train.steps,
            loss=last[0] if math.isnan(out.final_loss) else out.final_loss,
            accuracy=None if math.isnan(out.final_accuracy) else out.final_accuracy,
            wall_s=out.wall_s,
            compute_s=out.compute_s,
            comm_s=out.comm_s,
            wan_bytes=out.wan_bytes,
            wan_bytes_total=out.wan_bytes_total,
            compression_ratio=out.compression_ratio,
            compression=out.compression,
        )
    )
    return out
