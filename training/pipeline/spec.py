"""What a pipeline (or hybrid) run is given and what it reports; no torch, so the CLI and the
driver read them without loading the runtime."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from grammar import Compression, parse_compression
from training.pipeline.schedule import Schedule
from training.pipeline.split import Placement
from training.results import WanBytes
from training.spec import Parsed, TrainSpec


@dataclass(frozen=True)
class PipelineSpec:
    """A pipeline run: the data-parallel spec's task, data, links and Ray settings, plus where
    the stages go. `cuts` fixes the split (else balanced by compute); `activations` is the
    compression of what crosses links between stages: none, fp16, bf16 or int8."""

    train: TrainSpec
    placement: Placement
    micro_batches: int = 4
    schedule: Schedule = Schedule.GPIPE
    cuts: tuple[int, ...] | None = None
    activations: Parsed[str, Compression] = Parsed(parse_compression, "none")

    def validate(self) -> None:
        """ValueError `field: message` for what the driver can check before starting actors."""
        from training.pipeline.codec import codec_for

        if self.micro_batches < 1:
            raise ValueError("micro_batches: give at least 1")
        if self.cuts is not None and len(self.cuts) + 1 != self.placement.stages:
            raise ValueError(
                f"stages: {len(self.cuts)} cut point(s) make {len(self.cuts) + 1} stages, "
                f"the placement has {self.placement.stages}"
            )
        codec_for(self.activations)


@dataclass
class StageResult:
    """One stage replica's totals after a segment of steps."""

    rank: int
    stage: int
    cluster: str
    step: int
    loss: float | None
    """The global batch's mean loss of the last step (last stage, replica 0), else None."""
    compute_s: float
    wait_s: float
    """Blocked on receives, emulated link delay included."""
    steps_s: float
    """Wall time of the steps themselves."""
    wan: WanBytes
    raw_bytes: int
    """What the messages it sent over the WAN would have been uncompressed."""
    params: int


@dataclass
class PipelineReport:
    task: str
    parallel: str
    stage_clusters: list[str]
    replicas: int
    cuts: list[int]
    micro_batches: int
    schedule: str
    activations: str
    steps: int
    final_loss: float
    final_accuracy: float
    wall_s: float
    stage_compute_s: list[float]
    """Per stage, the slowest replica's compute time."""
    stage_wait_s: list[float]
    stage_params: list[int]
    activation_bytes: WanBytes
    """Activations and their gradients put on each WAN link (stages in different clusters),
    the final evaluation's forward pass included, and whole pipeline replicas' gradient
    all-reduce."""
    compression_ratio: float
    bubble_fraction: float
    """The schedule's idle share, (S-1)/(M+S-1)."""
    measured_bubble: float
    """1 - mean over stages of compute time / step time: idle from bubble and links together."""
    wan_emulated: bool
    history: list[dict[str, float | None]] = field(default_factory=list)
    tensor: int = 1
    """GPUs each stage replica's layers were split over (tensor parallelism)."""
    resumed_from_step: int | None = None
    """The consistent cut (newest step every stage had a shard of) this run resumed from."""
    final_eval_loss: float = float("nan")
    """Mean loss over the evaluated samples at the end (`final_loss`: the last step's)."""
    pipelines: list[list[str]] = field(default_factory=list)
    """Whole pipeline replicas' clusters, replica by replica (empty: every replica of a stage
    in its stage's cluster)."""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["activation_bytes"] = self.activation_bytes.to_json()
        data["activation_bytes_total"] = self.activation_bytes.total
        return data
