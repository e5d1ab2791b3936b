"""Edge models for the files `cpn plan` reads (SNAPSHOT, JOB, PLACEMENT): pydantic parses and
checks them, then hands the scheduler its frozen dataclasses. Extra fields are allowed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from grammar import canonical_compression, canonical_sync
from grammar.states import ClusterState
from scheduler import (
    Assignment,
    Cluster,
    JobRequest,
    Link,
    QoS,
    RunningJob,
    Snapshot,
)
from scheduler.gpus import GPU_PEAK_TFLOPS, peak_tflops


class PlanFileError(ValueError):
    """A bad input file: `field` is a dotted path such as `snapshot.clusters[0].gpus_free`."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class _Edge(BaseModel):
    model_config = ConfigDict(extra="allow")


class AssignmentIn(_Edge):
    cluster: str = Field(min_length=1)
    gpus: int = Field(ge=1)

    def to_domain(self) -> Assignment:
        return Assignment(self.cluster, self.gpus)


class ClusterIn(_Edge):
    name: str = Field(min_length=1)
    region: str
    gpu_model: str
    gpus_free: int = Field(ge=0)
    gpu_tflops: float | None = Field(default=None, gt=0)
    intra_bandwidth_gbps: float = Field(gt=0)
    price_per_gpu_hour: float = Field(ge=0)
    state: Literal["READY", "SUSPECT", "DOWN"]
    cordoned: bool = False
    efficiency: float | None = Field(default=None, gt=0, le=1)
    class_prices: dict[str, float] = Field(default_factory=dict)

    def to_domain(self) -> Cluster:
        return Cluster(
            name=self.name,
            region=self.region,
            gpu_model=self.gpu_model,
            gpus_free=self.gpus_free,
            intra_bandwidth_gbps=self.intra_bandwidth_gbps,
            price_per_gpu_hour=self.price_per_gpu_hour,
            state=ClusterState(self.state),
            cordoned=self.cordoned,
            gpu_tflops=self.gpu_tflops,
            efficiency=self.efficiency,
            class_prices=tuple(sorted(self.class_prices.items())),
        )


class LinkIn(_Edge):
    a: str
    b: str
    bandwidth_gbps: float = Field(gt=0)
    rtt_ms: float = Field(ge=0)
    egress_price_per_gb: float = Field(ge=0)

    def to_domain(self) -> Link:
        return Link(self.a, self.b, self.bandwidth_gbps, self.rtt_ms, self.egress_price_per_gb)


class RunningJobIn(_Edge):
    id: str = Field(min_length=1)
    placement: list[AssignmentIn] = Field(min_length=1)
    tenant: str = "default"
    priority: int = 0
    preemptible: bool = False
    preemption_cost: float | None = Field(default=None, ge=0)


class SnapshotIn(_Edge):
    clusters: list[ClusterIn] = Field(min_length=1)
    links: list[LinkIn] = Field(default_factory=list)
    running: list[RunningJobIn] = Field(default_factory=list)
    quotas: dict[str, int] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> SnapshotIn:
        seen: set[str] = set()
        for i, c in enumerate(self.clusters):
            if c.name in seen:
                raise ValueError(f"clusters[{i}].name: {c.name!r} is used twice; names are unique")
            seen.add(c.name)
            if c.gpu_tflops is None and peak_tflops(c.gpu_model) is None:
                raise ValueError(
                    f"clusters[{i}].gpu_model: {c.gpu_model!r} is not in the GPU table "
                    f"({', '.join(GPU_PEAK_TFLOPS)}); give gpu_tflops for it"
                )
        for i, lk in enumerate(self.links):
            for end in ("a", "b"):
                if getattr(lk, end) not in seen:
                    raise ValueError(
                        f"links[{i}].{end}: {getattr(lk, end)!r} is not a cluster in this snapshot"
                    )
            if lk.a == lk.b:
                raise ValueError(f"links[{i}].b: a link joins two different clusters")
        return self

    def to_domain(self) -> Snapshot:
        return Snapshot(
            clusters=tuple(c.to_domain() for c in self.clusters),
            links=tuple(lk.to_domain() for lk in self.links),
            running=tuple(
                RunningJob(
                    id=r.id,
                    placement=tuple(a.to_domain() for a in r.placement),
                    tenant=r.tenant,
                    priority=r.priority,
                    preemptible=r.preemptible,
                    preemption_cost=r.preemption_cost,
                )
                for r in self.running
            ),
            quotas=tuple(sorted(self.quotas.items())),
        )


class QoSIn(_Edge):
    priority: int = 0
    deadline_s: float | None = Field(default=None, gt=0)
    max_cost: float | None = Field(default=None, ge=0)
    regions: list[str] | None = None
    max_clusters: int | None = Field(default=None, ge=1)
    preemptible: bool = False
    qos_class: str | None = Field(default=None, alias="class")

    model_config = ConfigDict(extra="allow", populate_by_name=True)


class JobIn(_Edge):
    gpus: int | None = Field(default=None, ge=1)
    min_gpus: int | None = Field(default=None, ge=1)
    max_gpus: int | None = Field(default=None, ge=1)
    params: int = Field(ge=1)
    flops_per_step: float | None = Field(default=None, gt=0)
    step_time_s_ref: float | None = Field(default=None, gt=0)
    ref_gpu: str | None = None
    steps: int = Field(ge=1)
    qos: QoSIn = Field(default_factory=QoSIn)
    compression: str = "auto"
    sync: str = "auto"
    tenant: str = "default"
    preference: list[str] = Field(default_factory=list)
    layer_shapes: list[tuple[int, int]] = Field(default_factory=list)
    id: str = ""

    @model_validator(mode="after")
    def _check(self) -> JobIn:
        if self.gpus is not None and (self.min_gpus is not None or self.max_gpus is not None):
            raise ValueError('gpus: give "gpus" or "min_gpus"+"max_gpus", not both')
        if self.gpus is None and (self.min_gpus is None or self.max_gpus is None):
            raise ValueError('gpus: give "gpus": N or both "min_gpus" and "max_gpus"')
        if (
            self.gpus is None
            and self.min_gpus is not None
            and self.max_gpus is not None
            and self.max_gpus < self.min_gpus
        ):
            raise ValueError("max_gpus: must be >= min_gpus")
        if (self.flops_per_step is None) == (self.step_time_s_ref is None):
            raise ValueError(
                'flops_per_step: give exactly one of "flops_per_step" or '
                '"step_time_s_ref" with "ref_gpu"'
            )
        if self.step_time_s_ref is not None and (
            not self.ref_gpu or peak_tflops(self.ref_gpu) is None
        ):
            raise ValueError(
                'ref_gpu: "step_time_s_ref" needs "ref_gpu", a GPU model from the table '
                f"({', '.join(GPU_PEAK_TFLOPS)})"
            )
        try:
            canonical_compression(self.compression)
        except ValueError as exc:
            raise ValueError(f"compression: {exc}") from None
        try:
            canonical_sync(self.sync)
        except ValueError as exc:
            raise ValueError(f"sync: {exc}") from None
        return self

    def to_domain(self) -> JobRequest:
        lo = self.gpus if self.gpus is not None else self.min_gpus
        hi = self.gpus if self.gpus is not None else self.max_gpus
        assert lo is not None and hi is not None
        q = self.qos
        return JobRequest(
            params=self.params,
            steps=self.steps,
            min_gpus=lo,
            max_gpus=hi,
            flops_per_step=self.flops_per_step,
            step_time_s_ref=self.step_time_s_ref,
            ref_gpu=self.ref_gpu,
            qos=QoS(
                priority=q.priority,
                deadline_s=q.deadline_s,
                max_cost=q.max_cost,
                regions=tuple(q.regions) if q.regions is not None else None,
                max_clusters=q.max_clusters,
                preemptible=q.preemptible,
                qos_class=q.qos_class,
            ),
            compression=self.compression,
            sync=self.sync,
            tenant=self.tenant,
            preference=tuple(self.preference),
            layer_shapes=tuple(self.layer_shapes),
            id=self.id,
        )


def _field_path(prefix: str, loc: tuple[int | str, ...]) -> str:
    out = prefix
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def _validation_message(prefix: str, exc: ValidationError) -> PlanFileError:
    err = exc.errors()[0]
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and "[" in p))
    msg = str(err["msg"])
    if err["type"] == "value_error":
        # our own validators start with the field name: "gpus: ..."
        msg = msg.removeprefix("Value error, ")
        head, sep, rest = msg.partition(": ")
        if sep and " " not in head:
            return PlanFileError(_field_path(prefix, (*loc, head)), rest)
    if err["type"] == "missing":
        msg = "required field is missing"
    elif err["type"] in ("model_type", "dict_type"):
        msg = "expected a JSON object {...}"
    return PlanFileError(_field_path(prefix, loc), msg)


def _load_json(path: Path, prefix: str) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PlanFileError(prefix, f"cannot read {path}: {exc.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanFileError(
            prefix, f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
        ) from None


def _domain(prefix: str, build: Any) -> Any:
    try:
        return build()
    except ValueError as exc:
        msg = str(exc)
        head, sep, rest = msg.partition(": ")
        if sep and " " not in head:
            return_field = f"{prefix}.{head}"
            raise PlanFileError(return_field, rest) from None
        raise PlanFileError(prefix, msg) from None


def load_snapshot(path: Path) -> Snapshot:
    """Parse a SNAPSHOT file; PlanFileError names the field."""
    data = _load_json(path, "snapshot")
    try:
        model = SnapshotIn.model_validate(data)
    except ValidationError as exc:
        raise _validation_message("snapshot", exc) from None
    snap: Snapshot = _domain("snapshot", model.to_domain)
    return snap


def load_job(path: Path) -> JobRequest:
    """Parse a JOB file; PlanFileError names the field."""
    data = _load_json(path, "job")
    try:
        model = JobIn.model_validate(data)
    except ValidationError as exc:
        raise _validation_message("job", exc) from None
    job: JobRequest = _domain("job", model.to_domain)
    return job


def load_placement(path: Path) -> tuple[Assignment, ...]:
    """Parse a PLACEMENT file: [{"cluster", "gpus"}] or {"placement": [...]}."""
    data = _load_json(path, "placement")
    if isinstance(data, dict) and "placement" in data:
        data = data["placement"]
    if not isinstance(data, list):
        raise PlanFileError("placement", 'expected a JSON list [{"cluster": NAME, "gpus": N}, ...]')
    out: list[Assignment] = []
    for i, item in enumerate(data):
        try:
            out.append(AssignmentIn.model_validate(item).to_domain())
        except ValidationError as exc:
            raise _validation_message(f"placement[{i}]", exc) from None
    return tuple(out)
