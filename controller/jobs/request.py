"""From a stored job to what the scheduler plans: its spec (parsed once per job) and its request.

Both the submission service and the control loop need these; they live apart from the service so
the loop does not import the submission module.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from datetime import datetime
from typing import Any

import scheduler
from controller.store.models import Job
from controller.values.errors import Invalid
from controller.values.tasks import BUILTIN_TENSOR_HEADS, builtin_work, check_task, layer_facts
from wire.spec import JobSpec, stored_spec

_SPECS_KEPT = 4096
_specs: OrderedDict[str, JobSpec] = OrderedDict()
_specs_lock = threading.Lock()


def spec_of(job: Job) -> JobSpec:
    """The job's spec, parsed once per job (a stored spec never changes): the reconcile loop
    reads every queued job's spec on every pass."""
    with _specs_lock:
        spec = _specs.get(job.id)
        if spec is not None:
            _specs.move_to_end(job.id)
            return spec
    spec = stored_spec(job.spec)
    with _specs_lock:
        _specs[job.id] = spec
        while len(_specs) > _SPECS_KEPT:
            _specs.popitem(last=False)
    return spec


def job_request(spec: JobSpec, tenant_id: str, now: datetime | None = None) -> scheduler.JobRequest:
    """The scheduler's view of a spec; raises Invalid naming the field when it cannot be."""
    try:
        check_task(spec.task)
    except ValueError as exc:
        raise Invalid(str(exc), field="task") from None
    if spec.work is not None:
        work: dict[str, Any] = spec.work.cost()
    else:
        w = builtin_work(spec.task)
        work = {"params": w.params, "flops_per_step": w.flops_per_step}
    deadline_s = spec.deadline_in(now)
    if deadline_s is not None and deadline_s <= 0:
        raise Invalid(
            f"qos.deadline {spec.qos.deadline} is in the past; give a future time",
            field="qos.deadline",
        )
    check_tensor(spec)
    lo, hi = spec.gpu_range
    try:
        return scheduler.JobRequest(
            steps=spec.steps,
            min_gpus=lo,
            max_gpus=hi,
            qos=scheduler.QoS(
                priority=spec.qos.priority,
                deadline_s=deadline_s,
                max_cost=spec.qos.budget,
                regions=tuple(spec.qos.regions) if spec.qos.regions else None,
                # a tensor job's layers split over one cluster's GPUs, never the WAN
                max_clusters=1 if spec.parallelism == "tensor" else spec.qos.max_clusters,
                preemptible=spec.qos.is_preemptible,
                qos_class=spec.qos.qos_class,
            ),
            compression=spec.compression,
            sync=spec.sync,
            tenant=tenant_id,
            preference=tuple(spec.preference),
            data_clusters=(
                tuple(spec.data.clusters or ()) if spec.data.residency == "local" else None
            ),
            **work,
        )
    except ValueError as exc:
        raise Invalid(str(exc), field="work" if spec.work else "spec") from None


def check_tensor(spec: JobSpec) -> None:
    """Invalid naming `tensor` when the task's model cannot split as asked: a built-in's
    model, or the heads a tenant's `work` declares (a task of the tenant's own that declares
    none is checked where it runs: its model is not known here)."""
    tensor = spec.tensor or (spec.gpus or 1 if spec.parallelism == "tensor" else 1)
    if tensor <= 1:
        return
    heads = layer_facts(spec).heads
    if not heads and not spec.task.startswith("builtin:"):
        return
    if not heads:
        able = ", ".join(sorted(BUILTIN_TENSOR_HEADS))
        raise Invalid(
            f"tensor: {spec.task}'s model has no layer that splits over GPUs; use data or "
            f"pipeline parallelism, or a task that splits ({able})",
            field="tensor",
        )
    if heads % tensor:
        raise Invalid(
            f"tensor: {spec.task} has {heads} attention heads, which do not split over "
            f"{tensor} GPUs; use a number of GPUs that divides {heads}",
            field="tensor",
        )
