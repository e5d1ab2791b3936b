"""The job spec: one schema for the REST API, the CLI's YAML/JSON files and the Python client."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Annotated, Any, Literal, Self

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from agents.protocol import StrictScalars, refuse_control_characters
from grammar import (
    COMPRESSION_HELP,
    SYNC_HELP,
    canonical_compression,
    canonical_sync,
    parse_sync,
)
from grammar.parallel import PARALLEL_HELP, STAGES_HELP, parse_stages

QosClass = Literal["guaranteed", "standard", "spot"]
ObjectiveName = Literal["time", "cost", "cost-within-deadline"]
ParallelismName = Literal["auto", "data", "pipeline", "hybrid", "tensor"]
ACTIVATION_COMPRESSIONS = ("auto", "none", "fp16", "bf16", "int8")
"""What `compression` may be under pipeline or hybrid parallelism: it then compresses the
activations (and their gradients) crossing links between stages."""

_TASK = re.compile(r"^(builtin:[a-z0-9][a-z0-9-]*|[A-Za-z_][\w.]*:[A-Za-z_]\w*)$")
CompressionValue = Annotated[
    str,
    Field(max_length=64, description=f"Gradient compression between clusters; {COMPRESSION_HELP}."),
    AfterValidator(canonical_compression),
]
SyncValue = Annotated[
    str,
    Field(max_length=64, description=f"How clusters synchronise; {SYNC_HELP}."),
    AfterValidator(canonical_sync),
]


def _plain(value: str, info: ValidationInfo) -> str:
    """No control characters in new specs; stored ones load as they were written."""
    return value if _stored(info) else refuse_control_characters(value)


SpecText = Annotated[str, AfterValidator(_plain)]
ClusterRef = Annotated[str, Field(max_length=63), AfterValidator(_plain)]
"""A cluster or region name, as the admin API bounds them."""

TASK_ARGS_MAX_DEPTH = 200
"""Most nested objects/arrays in `args.task`: pydantic serialises about 255 levels, so a
response that wraps the spec in a few more (a page, a job, its spec, args) still fits, and a
stored job never breaks a job list."""
TASK_ARGS_MAX_BYTES = 16 * 1024
"""Largest `args.task` as compact JSON: task arguments are knobs, not data."""


def _task_args_fit(value: Any, info: ValidationInfo) -> Any:
    """Refuse `args.task` nested deeper than TASK_ARGS_MAX_DEPTH or larger than
    TASK_ARGS_MAX_BYTES, before anything recurses into it (an explicit stack, no recursion)."""
    if value is None or _stored(info):
        return value
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, dict | list):
            continue
        if depth > TASK_ARGS_MAX_DEPTH:
            raise PydanticCustomError(
                "too_deep",
                "nests objects and arrays more than {limit} levels deep; flatten the task's "
                "arguments",
                {"limit": TASK_ARGS_MAX_DEPTH},
            )
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children)
    try:
        size = len(json.dumps(value, separators=(",", ":"), default=str).encode())
    except (TypeError, ValueError):  # not JSON at all: JsonValue's validation says so
        return value
    if size > TASK_ARGS_MAX_BYTES:
        raise PydanticCustomError(
            "too_large",
            "is {size} bytes as JSON, over the {limit} allowed; pass large inputs as a file or "
            "URL the task reads",
            {"size": size, "limit": TASK_ARGS_MAX_BYTES},
        )
    return value


class _In(StrictScalars):
    # One JSON schema a model, the one a submission is checked against: a job shows its spec
    # in the same shape, so clients see one `JobSpec`, not an input and an output variant.
    model_config = ConfigDict(extra="forbid", json_schema_mode_override="validation")


class Work(_In):
    """What one training step costs, for the planner; built-in tasks know their own."""

    params: int = Field(ge=1, le=10**13, description="Model parameters.")
    flops_per_step: float | None = Field(default=None, gt=0, le=1e24)
    step_time_s_ref: float | None = Field(default=None, gt=0, le=86400)
    ref_gpu: SpecText | None = Field(default=None, max_length=64)
    blocks: int | None = Field(
        default=None,
        ge=1,
        le=100_000,
        description="Layers that split over a cluster's GPUs under tensor parallelism "
        "(transformer blocks written as `training.tensor_parallel.Block`). With `heads`, "
        "`parallelism: auto` weighs tensor and 3D splits for a model no GPU holds.",
    )
    heads: int | None = Field(
        default=None,
        ge=1,
        le=100_000,
        description="Attention heads of each of those blocks: a split's GPUs must divide them.",
    )
    activation_bytes: int | None = Field(
        default=None,
        ge=1,
        le=10**12,
        description="Bytes of one sample's activations leaving a layer (the largest): what a "
        "pipeline stage sends to the next and a tensor split all-reduces. Without it a "
        "pipeline's estimate leaves those transfers out.",
    )

    @model_validator(mode="after")
    def _one_measure(self) -> Self:
        if (self.flops_per_step is None) == (self.step_time_s_ref is None):
            raise ValueError("give exactly one of flops_per_step or step_time_s_ref (with ref_gpu)")
        if self.step_time_s_ref is not None and not self.ref_gpu:
            raise ValueError("step_time_s_ref needs ref_gpu: the GPU model it was measured on")
        if (self.blocks is None) != (self.heads is None):
            raise ValueError(
                "give blocks and heads together (the layers a tensor split divides and their "
                "attention heads), or neither"
            )
        return self

    def cost(self) -> dict[str, Any]:
        """What a step costs as the scheduler's request takes it (the layer facts aside)."""
        return self.model_dump(
            exclude_none=True, include={"params", "flops_per_step", "step_time_s_ref", "ref_gpu"}
        )


class QoSSpec(_In):
    """Service terms: class (price and preemption), priority, deadline, budget, residency."""

    qos_class: QosClass = Field(
        default="standard",
        description="guaranteed: never preempted; standard; spot: preemptible and cheaper.",
    )
    priority: int = Field(default=0, ge=-1000, le=1000)
    deadline: datetime | None = Field(default=None, description="Finish by this UTC time.")
    budget: float | None = Field(default=None, ge=0, le=1e12, description="Most it may cost.")
    regions: list[ClusterRef] | None = Field(
        default=None, max_length=64, description="Allowed regions."
    )
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


class DataSpec(_In):
    """Where the job's training data lives. `local`: every sample stays in its cluster (only
    model updates cross the WAN); the job runs only on `clusters`, the ones holding data."""

    residency: Literal["shared", "local"] = Field(
        default="shared",
        description="shared: any cluster may read any sample; local: each cluster reads only "
        "its own samples.",
    )
    clusters: list[ClusterRef] | None = Field(
        default=None,
        max_length=64,
        description="Clusters that hold the data; a local-data job is placed only on them.",
    )

    @model_validator(mode="after")
    def _where(self) -> Self:
        if self.residency == "local" and not self.clusters:
            raise ValueError(
                "data.clusters: a local-data job must name the clusters that hold its data, "
                'e.g. {"residency": "local", "clusters": ["a", "b"]}'
            )
        return self


STORED = {"stored": True}
"""Validation context of specs read back from the database (see `stored_spec`)."""


def _stored(info: ValidationInfo) -> bool:
    return bool(info.context and info.context.get("stored"))


class TrainArgs(_In):
    """The runtime's knobs (what the launcher hands `training.TrainSpec`), typed and bounded;
    each left out takes the runtime's or the task's default. Unknown keys are refused: a
    `module:function` task's own arguments go under `task`, which cpn stores with the job
    without reading them."""

    batch_size: int | None = Field(
        default=None,
        strict=True,
        ge=1,
        le=2**24,
        description="Global batch over all workers (at least one sample per GPU); default: "
        "the task's.",
    )
    lr: float | None = Field(
        default=None,
        strict=True,
        allow_inf_nan=False,
        gt=0,
        le=1e3,
        description="Learning rate of the local optimiser.",
    )
    seed: int | None = Field(
        default=None, strict=True, ge=0, le=2**32 - 1, description="Random seed."
    )
    eval_every: int | None = Field(
        default=None,
        strict=True,
        ge=1,
        le=10**9,
        description="Steps between evaluations (and progress reports); default: about 20 a run.",
    )
    checkpoint_every: int | None = Field(
        default=None,
        strict=True,
        ge=0,
        le=10**9,
        description="Steps between checkpoints; 0: only at the end; default: a tenth of the steps.",
    )
    artefact: Literal["best", "last"] | None = Field(
        default=None,
        description="The model the job leaves: best, its best evaluation's (default: a run "
        "that over-fits or diverges keeps what it reached), or last, its final step's.",
    )
    outer_lr: float | None = Field(
        default=None,
        strict=True,
        allow_inf_nan=False,
        gt=0,
        le=100,
        description="DiLoCo outer learning rate (local-sgd sync).",
    )
    outer_momentum: float | None = Field(
        default=None,
        strict=True,
        allow_inf_nan=False,
        ge=0,
        lt=1,
        description="DiLoCo outer Nesterov momentum, in [0, 1).",
    )
    task: Annotated[dict[str, JsonValue] | None, BeforeValidator(_task_args_fit)] = Field(
        default=None,
        max_length=64,
        description="Arguments of a module:function task, stored with the job as given; at "
        f"most {TASK_ARGS_MAX_DEPTH} levels deep and {TASK_ARGS_MAX_BYTES} bytes as JSON.",
    )

    def given(self) -> dict[str, Any]:
        """Only the knobs given, as JSON: `{}` when none, as free-form args were stored."""
        return {k: v for k, v in self.model_dump(mode="json").items() if v is not None}

    def runtime(self) -> dict[str, Any]:
        """The knobs given, as `training.TrainSpec` keyword arguments."""
        return {
            name: value
            for name in (
                "batch_size",
                "lr",
                "seed",
                "eval_every",
                "artefact",
                "outer_lr",
                "outer_momentum",
            )
            if (value := getattr(self, name)) is not None
        }


def _stages(value: str | None) -> str | None:
    return None if value is None else str(parse_stages(value))


class PipelineOptions(_In):
    """How a pipeline (or hybrid) job splits and schedules; read only when `parallelism` is
    pipeline or hybrid."""

    stages: Annotated[str | None, AfterValidator(_stages)] = Field(
        default=None,
        max_length=256,
        description=f"Stage split; {STAGES_HELP}. Default: pipeline, one stage per GPU; "
        "hybrid, one stage per cluster.",
    )
    micro_batches: int | None = Field(
        default=None,
        strict=True,
        ge=1,
        le=1024,
        description="Micro-batches per step. Default: the planner's, the shortest step it "
        "estimates, weighing the bubble against each micro-batch's fixed cost as finished "
        "pipeline runs measured it.",
    )
    schedule: Literal["gpipe", "1f1b"] = Field(
        default="gpipe", description="Order of forward and backward passes over micro-batches."
    )


class JobSpec(_In):
    """A training job across clusters: data parallel, or its model split into pipeline stages."""

    name: SpecText = Field(min_length=1, max_length=128)
    task: str = Field(
        max_length=256,
        description="builtin:NAME (e.g. builtin:mnist1d-mlp) or an importable module:function.",
    )
    args: TrainArgs = Field(
        default_factory=TrainArgs,
        description="Runtime knobs (batch_size, lr, seed, eval_every, checkpoint_every, "
        "artefact, outer_lr, outer_momentum) and, for module:function tasks, `task`: the "
        "task's own.",
    )
    gpus: int | None = Field(default=None, ge=1, le=100_000, description="Exact GPU count.")
    min_gpus: int | None = Field(default=None, ge=1, le=100_000)
    max_gpus: int | None = Field(default=None, ge=1, le=100_000)
    steps: int = Field(ge=1, le=10**9)
    qos: QoSSpec = Field(default_factory=QoSSpec)
    compression: CompressionValue = "auto"
    sync: SyncValue = "auto"
    parallelism: ParallelismName = Field(
        default="auto",
        description=f"How the model is spread over GPUs; {PARALLEL_HELP}. data: the whole "
        "model in every worker; pipeline: stages on clusters, one GPU a stage, activations "
        "cross the WAN (`compression` then applies to them); hybrid: pipeline across "
        "clusters, data parallel inside each stage's cluster; tensor: one cluster whose GPUs "
        "split each layer (`tensor` of them a group), data parallel over the groups; auto: "
        "the planner's choice.",
    )
    tensor: int | None = Field(
        default=None,
        strict=True,
        ge=1,
        le=64,
        description="GPUs each layer is split over, inside one cluster (tensor parallelism; "
        "never across the WAN): with parallelism tensor, default all of the job's GPUs; "
        "with pipeline or hybrid, each stage replica's GPUs (3D parallelism). The task's "
        "model must say how its layers split (builtin:char-gpt does), and the number must "
        "divide its attention heads.",
    )
    pipeline: PipelineOptions = Field(
        default_factory=PipelineOptions,
        description="Stage split, micro-batches and schedule of a pipeline or hybrid job.",
    )
    preference: list[ClusterRef] = Field(
        default_factory=list, max_length=64, description="Clusters first."
    )
    data: DataSpec = Field(
        default_factory=DataSpec,
        description="Data residency: shared (default) or local to the clusters named.",
    )
    work: Work | None = Field(default=None, description="Required for module:function tasks.")
    quote_id: SpecText | None = Field(
        default=None, max_length=36, description="Hold a quote's price."
    )
    quote_option: ObjectiveName | None = Field(
        default=None, description="Which option of the quote to take (default: its first)."
    )

    @field_validator("task")
    @classmethod
    def _task(cls, value: str) -> str:
        if not _TASK.match(value):
            raise ValueError("write builtin:NAME or module.path:function")
        return value

    @model_validator(mode="before")
    @classmethod
    def _sync_on_local_data(cls, values: Any) -> Any:
        """On local data a sync value's defaults are local data's (`grammar.parse_sync`:
        streaming's fragments default to one), filled in before the field keeps its canonical
        form, which names them."""
        if not isinstance(values, dict):
            return values
        data, sync = values.get("data"), values.get("sync")
        residency = (
            data.get("residency") if isinstance(data, dict) else getattr(data, "residency", None)
        )
        if residency != "local" or not isinstance(sync, str) or len(sync) > 64:
            return values
        try:
            return {**values, "sync": str(parse_sync(sync, local_data=True))}
        except ValueError:
            return values  # the field's own validator names what is wrong

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

    @model_validator(mode="after")
    def _args_fit(self, info: ValidationInfo) -> Self:
        """Arguments that only the whole spec can check (skipped for stored specs, which the
        runtime checks again)."""
        if _stored(info):
            return self
        if self.args.task is not None and self.task.startswith("builtin:"):
            raise ValueError(
                "args.task: task arguments are for module:function tasks; built-in tasks take "
                "only the runtime's knobs (batch_size, lr, seed, eval_every, checkpoint_every, "
                "outer_lr, outer_momentum): drop args.task"
            )
        if self.parallelism in ("pipeline", "hybrid", "tensor"):
            self._pipeline_fits()
        elif self.tensor is not None and self.tensor > 1:
            raise ValueError(
                f"tensor: splitting layers needs parallelism tensor, pipeline or hybrid, not "
                f"{self.parallelism}; set parallelism, or drop tensor"
            )
        workers = self.gpu_range[1]
        if self.args.batch_size is not None and self.args.batch_size < workers:
            raise ValueError(
                f"args.batch_size: {self.args.batch_size} is smaller than the up to {workers} "
                f"workers (one per GPU); give at least {workers}, or leave it out"
            )
        return self

    def _pipeline_fits(self) -> None:
        """What a pipeline or hybrid run does not do (yet), refused at submission."""
        if self.compression not in ACTIVATION_COMPRESSIONS:
            raise ValueError(
                f"compression: {self.compression} does not apply to activations; with "
                f"parallelism {self.parallelism} use one of {', '.join(ACTIVATION_COMPRESSIONS)}"
            )
        if self.sync not in ("auto", "every-step"):
            raise ValueError(
                f"sync: {self.sync} is not supported with parallelism {self.parallelism}; "
                "use auto or every-step"
            )
        if self.data.residency != "shared":
            raise ValueError(
                f"data.residency: local data is not supported with parallelism "
                f"{self.parallelism}; use shared"
            )
        if self.gpus is None:
            raise ValueError(
                f"gpus: a {self.parallelism} job runs a fixed set of stages; give gpus "
                "(exact), not min_gpus and max_gpus"
            )
        split = self.pipeline.stages
        tensor = self.tensor or (self.gpus if self.parallelism == "tensor" else 1)
        if self.gpus % tensor:
            raise ValueError(
                f"tensor: {self.gpus} GPUs do not make groups of {tensor}; give gpus a "
                f"multiple of {tensor}"
            )
        if self.parallelism == "tensor" and split is not None and parse_stages(split).count > 1:
            raise ValueError(
                "pipeline.stages: a tensor job runs the whole model in one cluster; for "
                "stages of split layers use parallelism pipeline or hybrid with tensor"
            )
        if split is not None and self.parallelism == "pipeline":
            count = parse_stages(split).count
            if count * tensor != self.gpus:
                per = f" of {tensor} GPUs" if tensor > 1 else ""
                raise ValueError(
                    f"pipeline.stages: a pipeline runs one replica{per} per stage; {count} "
                    f"stage(s) need gpus: {count * tensor}, not {self.gpus}"
                )

    @field_serializer("args")
    def _given_args(self, args: TrainArgs) -> dict[str, Any]:
        """The args as stored: only the knobs given (`TrainArgs.given`)."""
        return args.given()

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


def stored_spec(data: Any) -> JobSpec:
    """A spec as stored on a job row: typed, without the checks a submission passed already
    (a rule tightened later never makes a stored job unreadable)."""
    return JobSpec.model_validate(data, context=STORED)
