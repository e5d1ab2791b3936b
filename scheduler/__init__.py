"""Control-layer decisions: the cost model, placement optimizer and QoS rules.

Pure code (no I/O, database, Ray or web): data in, data out, deterministic. Compiled by
mypyc when `make compile` has built it from these sources (`scheduler.native`).
"""

# ruff: noqa: E402 (the modules below are imported after the compiled build is on the path)
from scheduler.native import enable as _enable

COMPILED = _enable(__path__)
"""Whether the decision modules below are the compiled build."""

from scheduler.calibrate import (
    POOLED,
    Observation,
    calibrate,
    fit_step_overhead,
    fit_steps_factor,
)
from scheduler.compression import (
    CompressorModel,
    SyncModel,
    compressor_model,
    sync_model,
)
from scheduler.cost import (
    CostModel,
    estimate,
    reference_run_s,
    ring_allreduce_time,
    setup_of,
    step_time,
)
from scheduler.gpus import DEFAULT_EFFICIENCY, GPU_PEAK_TFLOPS, peak_tflops
from scheduler.optimizer import check_placement, evaluate, plan
from scheduler.rules import (
    QueuedJob,
    QueueOrder,
    Release,
    exclusions,
    order_queue,
    preemption_candidates,
    quota_left,
    release,
    tenant_usage,
)
from scheduler.types import (
    OBJECTIVES,
    Assignment,
    Cluster,
    Estimate,
    Infeasible,
    JobRequest,
    Link,
    Objective,
    Placement,
    Plan,
    PlanResult,
    Port,
    QoS,
    RunningJob,
    Snapshot,
    both_ways,
    crowding,
)
from scheduler.waiting import Wait, bandwidth_wait, soonest_wait

__all__ = [
    "DEFAULT_EFFICIENCY",
    "GPU_PEAK_TFLOPS",
    "OBJECTIVES",
    "POOLED",
    "Assignment",
    "Cluster",
    "CompressorModel",
    "CostModel",
    "Estimate",
    "Infeasible",
    "JobRequest",
    "Link",
    "Objective",
    "Observation",
    "Placement",
    "Plan",
    "PlanResult",
    "Port",
    "QoS",
    "QueueOrder",
    "QueuedJob",
    "Release",
    "RunningJob",
    "Snapshot",
    "SyncModel",
    "Wait",
    "bandwidth_wait",
    "both_ways",
    "calibrate",
    "check_placement",
    "compressor_model",
    "crowding",
    "estimate",
    "evaluate",
    "exclusions",
    "fit_step_overhead",
    "fit_steps_factor",
    "order_queue",
    "peak_tflops",
    "plan",
    "preemption_candidates",
    "quota_left",
    "reference_run_s",
    "release",
    "ring_allreduce_time",
    "setup_of",
    "soonest_wait",
    "step_time",
    "sync_model",
    "tenant_usage",
]
