"""The job spec: one schema for the REST API, the CLI's YAML/JSON files and the Python client."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

QosClass = Literal["guaranteed", "standard", "spot"]
ObjectiveName = Literal["time", "cost", "cost-within-deadline"]

_TASK = re.compile(r"^(builtin:[a-z0-9][a-z0-9-]*|[A-Za-z_][\w.]*:[A-Za-z_]\w*)$")
_COMPRESSION = re.compile(
    r"^(auto|none|fp16|bf16|int8|int8:minmax|sign|topk:(0?\.\d+|1(\.0+)?)|powersgd:\d+)$"
)
_SYNC = re.compile(r"^(auto|every-step|adaptive|local-sgd:[1-9]\d*|stale:\d+)$")


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Work(_In):
    """What one training step costs, for the planner; built-in tasks know their own."""

    params: int = Field(ge=1, le=10**13, description="Model parameters.")
    flops_per_step: float | None = Field(default=None, gt=0, le=1e24)
    step_time_s_ref: float | None = Field(default=None, gt=0, le=86400)
    ref_gpu: str | None = Field(default=None, max_length=64)

    @model_validator(mode="after")
    def _one_measure(self) -> Self:
        if (self.flops_per_step is None) == (self.step_time_s_ref is None):
            raise ValueError("give exactly one of flops_per_step or step_time_s_ref (with ref_gpu)")
        if self.step_time_s_ref is not None and not self.ref_gpu:
            raise ValueError("step_time_s_ref needs ref_gpu: the GPU model it was measured on")
        return self


class QoSSpec(_In):
    """Service terms: class (price and preemption), priority, deadline, budget, residency."""

    qos_class: QosClass = Field(
        default="standard",
        description="guaranteed: never preempted; standard; spot: preemptible and cheaper.",
    )
    priority: int = Field(default=0, ge=-1000, le=1000)
    deadline: datetime | None = Field(default=None, description="Finish by this UTC time.")
    budget: float | None = Field(default=None, ge=0, le=1e12, description="Most it may cost.")
    regions: list[str] | None = Field(default=None, max_length=64, description="Allowed regions.")
    max_clusters: int | None = Field(default=None, ge=1, le=1000)
    preemptible: bool | None = Field(
        default=None, description="Default: true for spot, false otherwise."
    )

    @field_validator("deadline")
    @classmethod
    def _aware(cls, value: datetime | None) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("give the deadline with a timezone, e.g. 2026-12-01T12:00:00Z")
        return value

    @model_validator(mode="after")
    def _class_rules(self) -> Self:
        if self.qos_class == "guaranteed" and self.preemptible:
            raise ValueError("guaranteed jobs are never preempted: drop preemptible or use spot")
        if self.qos_class == "spot" and self.preemptible is False:
            raise ValueError("spot jobs are preemptible: use standard to avoid preemption")
        return self

    @property
    def is_preemptible(self) -> bool:
        return self.preemptible if self.preemptible is not None else self.qos_class == "spot"


class JobSpec(_In):
    """A data-parallel training job across clusters."""

    name: str = Field(min_length=1, max_length=128)
    task: str = Field(
        max_length=256,
        description="builtin:NAME (e.g. builtin:mnist1d-mlp) or an importable module:function.",
    )
    args: dict[str, Any] = Field(default_factory=dict, description="Passed to the task.")
    gpus: int | None = Field(default=None, ge=1, le=100_000, description="Exact GPU count.")
    min_gpus: int | None = Field(default=None, ge=1, le=100_000)
    max_gpus: int | None = Field(default=None, ge=1, le=100_000)
    steps: int = Field(ge=1, le=10**9)
    qos: QoSSpec = Field(default_factory=QoSSpec)
    compression: str = Field(
        default="auto", description="auto, none, fp16, bf16, int8, topk:D, powersgd:R, sign."
    )
    sync: str = Field(default="auto", description="auto, every-step, local-sgd:H, stale:S.")
    preference: list[str] = Field(
        default_factory=list, max_length=64, description="Clusters first."
    )
    work: Work | None = Field(default=None, description="Required for module:function tasks.")
    quote_id: str | None = Field(default=None, max_length=36, description="Hold a quote's price.")
    quote_option: ObjectiveName | None = Field(
        default=None, description="Which option of the quote to take (default: its first)."
    )

    @field_validator("task")
    @classmethod
    def _task(cls, value: str) -> str:
        if not _TASK.match(value):
            raise ValueError("write builtin:NAME or module.path:function")
        return value

    @field_validator("compression")
    @classmethod
    def _compression(cls, value: str) -> str:
        if not _COMPRESSION.match(value):
            raise ValueError(
                "use auto, none, fp16, bf16, int8, int8:minmax, sign, topk:0.01, powersgd:4"
            )
        return value

    @field_validator("sync")
    @classmethod
    def _sync(cls, value: str) -> str:
        if not _SYNC.match(value):
            raise ValueError("use auto, every-step, adaptive, local-sgd:H or stale:S")
        return value

    @model_validator(mode="after")
    def _gpus(self) -> Self:
        if self.gpus is not None and (self.min_gpus is not None or self.max_gpus is not None):
            raise ValueError("give gpus, or min_gpus and max_gpus, not both")
        if self.gpus is None and (self.min_gpus is None or self.max_gpus is None):
            raise ValueError("give gpus (exact) or both min_gpus and max_gpus (elastic)")
        if (
            self.min_gpus is not None
            and self.max_gpus is not None
            and self.max_gpus < self.min_gpus
        ):
            raise ValueError("max_gpus must be >= min_gpus")
        if not self.task.startswith("builtin:") and self.work is None:
            raise ValueError(
                "a module:function task needs `work` (params and flops_per_step or step_time_s_ref)"
            )
        return self

    @property
    def gpu_range(self) -> tuple[int, int]:
        if self.gpus is not None:
            return self.gpus, self.gpus
        assert self.min_gpus is not None and self.max_gpus is not None
        return self.min_gpus, self.max_gpus

    def deadline_in(self, now: datetime | None = None) -> float | None:
        if self.qos.deadline is None:
            return None
        return (self.qos.deadline - (now or datetime.now(UTC))).total_seconds()
