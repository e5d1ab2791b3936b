"""What a scheduler is judged by, from one simulated run."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from bench.sim.engine import Outcome


@dataclass(frozen=True)
class Metrics:
    mean_jct_s: float
    p95_jct_s: float
    queue_s: float  # mean wait from arrival to placement
    utilisation: float  # GPU-seconds held / (fleet GPUs x span from first arrival to last end)
    cost: float  # $ for all jobs: GPU-hours at list price + WAN egress
    wan_bytes: int
    deadline_misses: int
    fairness: float  # Jain's index over tenants' mean slowdown (JCT / run time alone); 1 = equal
    finished: int
    unfinished: int
    split_jobs: int  # jobs placed across more than one cluster
    sim_jobs_per_cpu_min: float

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def jain(values: list[float]) -> float:
    if not values:
        return math.nan
    sq = sum(v * v for v in values)
    return sum(values) ** 2 / (len(values) * sq) if sq > 0 else 1.0


def measure(out: Outcome) -> Metrics:
    runs = out.runs
    jcts = [r.finish_s - r.job.arrival_s for r in runs]
    slow: dict[str, list[float]] = {}
    for r, jct in zip(runs, jcts, strict=True):
        slow.setdefault(r.job.tenant, []).append(jct / r.job.run_s)
    if runs:
        span = max(r.finish_s for r in runs) - min(r.job.arrival_s for r in runs)
        held = sum((r.finish_s - r.start_s) * r.job.gpus for r in runs)
        util = held / (out.fleet_gpus * span) if span > 0 else 0.0
    else:
        util = 0.0
    n = len(runs) + out.unfinished
    return Metrics(
        mean_jct_s=sum(jcts) / len(jcts) if jcts else math.nan,
        p95_jct_s=_pct(jcts, 0.95),
        queue_s=sum(r.start_s - r.job.arrival_s for r in runs) / len(runs) if runs else math.nan,
        utilisation=util,
        cost=sum(r.cost for r in runs),
        wan_bytes=sum(r.wan_bytes for r in runs),
        deadline_misses=sum(
            1 for r in runs if r.job.deadline_s is not None and r.finish_s > r.job.deadline_s
        ),
        fairness=jain([sum(v) / len(v) for v in slow.values()]),
        finished=len(runs),
        unfinished=out.unfinished,
        split_jobs=sum(1 for r in runs if r.clusters > 1),
        sim_jobs_per_cpu_min=60.0 * n / out.cpu_s if out.cpu_s > 0 else math.inf,
    )
