"""A job as the API answers it: its quote, the job itself, its events and its metrics."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from grammar.states import JobState
from wire.plan import HeldPlan, JobPlan
from wire.spec import JobSpec, stored_spec


class QuoteOut(BaseModel):
    id: str
    created_at: datetime
    expires_at: datetime
    options: list[JobPlan] = Field(description="One plan per objective, priced.")


class JobOut(BaseModel):
    id: str
    tenant_id: str
    name: str
    state: JobState
    reason: str
    priority: int
    qos_class: str
    preemptible: bool
    gpus_min: int
    gpus_max: int
    spec: JobSpec = Field(description="The job's spec, as submitted (defaults filled in).")
    quote_id: str | None
    held_price: HeldPlan | None = Field(description="The quote option the job was submitted with.")
    placement: JobPlan | None = Field(description="The plan its GPUs are reserved for.")
    attempts: int
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    ends_at: datetime | None = Field(
        description="When its current placement is expected to end: placed at, plus its plan's "
        "estimated run time for the steps left (jobs waiting for its GPUs count on it)."
    )
    version: int

    model_config = ConfigDict(from_attributes=True)

    @field_validator("spec", mode="before")
    @classmethod
    def _stored(cls, value: Any) -> Any:
        """A stored row's spec loads as stored specs do (`wire.spec.stored_spec`)."""
        return stored_spec(value) if isinstance(value, dict) else value


class JobEventOut(BaseModel):
    id: int
    at: datetime
    kind: str
    from_state: JobState | None
    to_state: JobState | None
    message: str
    data: dict[str, object]

    model_config = ConfigDict(from_attributes=True)


class JobLogOut(BaseModel):
    """One line of a job's log: what a worker (`source`: `cluster/rank`) printed on `stream`
    (stdout or stderr), or what the run's driver said (`source`: `driver`)."""

    id: int
    at: datetime
    source: str
    stream: str
    text: str

    model_config = ConfigDict(from_attributes=True)


class JobMetricOut(BaseModel):
    step: int
    at: datetime
    loss: float | None
    accuracy: float | None
    step_time_s: float | None
    compute_time_s: float | None
    comm_time_s: float | None
    wan_bytes: int

    model_config = ConfigDict(from_attributes=True)
