"""Fit efficiency factors (fraction of peak FLOPS reached) from observed step times — the
modelling function of Y.2501: estimates improve as the system runs."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from scheduler.gpus import peak_tflops

POOLED = "*"
"""The key of the fit over every observation: the efficiency assumed for GPU models (or
clusters) not observed yet. Without it an unobserved model keeps the datasheet prior, which on
a fleet running far below datasheet makes it look the fastest and draws every placement."""


@dataclass(frozen=True)
class Observation:
    """One measured compute step: `flops` of work on `gpus` GPUs of `gpu_model` took
    `compute_s` seconds (compute only, communication excluded). `key` groups observations
    (a GPU model, or a cluster name for per-cluster factors); it defaults to the model."""

    gpu_model: str
    gpus: int
    flops: float
    compute_s: float
    key: str | None = None
    gpu_tflops: float | None = None


def calibrate(observations: Iterable[Observation], min_count: int = 1) -> dict[str, float]:
    """Least-squares efficiency per key, clipped to (0, 1].

    The model predicts t = a / e with a = flops / (gpus x peak); minimising sum (t - a x)^2 over
    x = 1/e gives x = sum(a t) / sum(a^2). Keys with fewer than `min_count` observations are
    left out so the caller keeps its prior for them; `POOLED` fits all of them together.
    """
    sums: dict[str, tuple[float, float, int]] = {}
    for ob in observations:
        peak = ob.gpu_tflops if ob.gpu_tflops is not None else peak_tflops(ob.gpu_model)
        if peak is None or ob.gpus < 1 or ob.compute_s <= 0 or ob.flops <= 0:
            raise ValueError(
                f"observation for {ob.gpu_model!r}: needs a known GPU model (or gpu_tflops), "
                "gpus >= 1, compute_s > 0 and flops > 0"
            )
        a = ob.flops / (ob.gpus * peak * 1e12)
        for key in (ob.key or ob.gpu_model, POOLED):
            s_at, s_aa, n = sums.get(key, (0.0, 0.0, 0))
            sums[key] = (s_at + a * ob.compute_s, s_aa + a * a, n + 1)
    out: dict[str, float] = {}
    for key, (s_at, s_aa, n) in sorted(sums.items()):
        if n < min_count or s_at <= 0:
            continue
        out[key] = min(1.0, s_aa / s_at)
    return out


def fit_step_overhead(residuals: Iterable[float]) -> float:
    """The per-step time the cost model leaves out, from finished multi-worker jobs: each
    residual is observed step minus observed compute minus the estimate's communication
    (`step_time_s - compute_s - step_overhead_s` of its placement). The median, so one job
    slowed by a neighbour does not set it; never negative."""
    values = [r for r in residuals if math.isfinite(r)]
    return max(0.0, min(statistics.median(values), 3599.0)) if values else 0.0


def fit_steps_factor(ratios: Iterable[float]) -> float:
    """A sync mode's statistical efficiency from observed runs: each ratio is the samples the
    mode took to reach a target over the samples every-step took to reach it (same task, same
    clusters; `bench.modes` measures both). The median, never below 1: a mode that happened to
    win one run is not assumed to need fewer samples in general. 1 without observations."""
    values = [r for r in ratios if math.isfinite(r) and r > 0]
    return max(1.0, statistics.median(values)) if values else 1.0
