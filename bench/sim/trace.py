"""A synthetic job trace shaped like published GPU-cluster traces (seeded, reproducible).

Shape, after the published statistics of Microsoft Philly (Jeon et al., "Analysis of
Large-Scale Multi-Tenant GPU Clusters for DNN Training Workloads", USENIX ATC 2019) and
SenseTime Helios (Hu et al., "Characterization and Prediction of Deep Learning Workloads in
Large-Scale GPU Datacenters", SC 2021) — approximations of their CDFs, not their data:
- arrivals: Poisson with a diurnal rate (peak 1.5x, trough 0.5x the mean, 24 h period);
- GPUs per job: 1 (60 %), 2 (10 %), 4 (12 %), 8 (10 %), 16 (5 %), 32 (2 %), 64 (1 %) — most
  jobs take one GPU, the few large ones hold most GPU time;
- run time on the requested GPUs (reference V100): log-normal, median 20 min x gpus^0.3,
  sigma 1.6, clipped to [1 min, 5 days] — the heavy tail both traces report;
- model size: log-normal around 100 M parameters x sqrt(gpus), clipped to [5 M, 7 B];
- tenants: 12 (Philly's virtual clusters), Zipf-weighted;
- 15 % of jobs carry a deadline: arrival + 2.5 x run time + 10 min.
The mean arrival rate is set so that the offered load is `load` x the fleet's capacity in
reference-GPU equivalents (an H100 counts as 989/125 V100s: datasheet peak ratio).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

GPU_SIZES: tuple[tuple[int, float], ...] = (
    (1, 0.60),
    (2, 0.10),
    (4, 0.12),
    (8, 0.10),
    (16, 0.05),
    (32, 0.02),
    (64, 0.01),
)
REF_GPU = "V100"
STEP_S = 0.5  # seconds a step takes on the requested GPUs: sets steps from the run time
TENANTS = 12
DEADLINE_SHARE = 0.15
MEDIAN_S, SIGMA = 1200.0, 1.6
MIN_S, MAX_S = 60.0, 5 * 86400.0


@dataclass(frozen=True)
class TraceJob:
    id: str
    tenant: str
    arrival_s: float
    gpus: int
    run_s: float  # on `gpus` reference GPUs in one cluster
    params: int
    deadline_s: float | None  # absolute, simulated clock

    @property
    def steps(self) -> int:
        return max(10, round(self.run_s / STEP_S))

    @property
    def step_time_s_ref(self) -> float:
        """Seconds one reference GPU takes for the whole global batch."""
        return self.run_s * self.gpus / self.steps


def _mean_gpu_seconds(rng: random.Random, n: int = 20_000) -> float:
    return sum(g * r for g, r in (_size_and_run(rng) for _ in range(n))) / n


def _size_and_run(rng: random.Random) -> tuple[int, float]:
    g = rng.choices([s for s, _ in GPU_SIZES], [w for _, w in GPU_SIZES])[0]
    run = MEDIAN_S * g**0.3 * math.exp(rng.gauss(0.0, SIGMA))
    return g, min(MAX_S, max(MIN_S, run))


def synthetic(n_jobs: int, capacity: float, load: float = 0.9, seed: int = 0) -> list[TraceJob]:
    """`capacity`: the fleet in reference-GPU equivalents (`Network.capacity`)."""
    rng = random.Random(seed)
    rate = load * capacity / _mean_gpu_seconds(random.Random(seed + 1))  # jobs per second
    weights = [1.0 / (k + 1) for k in range(TENANTS)]
    jobs: list[TraceJob] = []
    t = 0.0
    while len(jobs) < n_jobs:
        t += rng.expovariate(1.5 * rate)  # thinning against the peak rate
        if rng.random() > (1.0 + 0.5 * math.sin(2 * math.pi * t / 86400.0)) / 1.5:
            continue
        g, run = _size_and_run(rng)
        params = int(min(7e9, max(5e6, 1e8 * math.sqrt(g) * math.exp(rng.gauss(0.0, 1.0)))))
        deadline = t + 2.5 * run + 600.0 if rng.random() < DEADLINE_SHARE else None
        tenant = f"t{rng.choices(range(TENANTS), weights)[0]:02d}"
        jobs.append(TraceJob(f"j{len(jobs):06d}", tenant, t, g, run, params, deadline))
    return jobs
