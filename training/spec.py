"""What a training run is asked to do (`TrainSpec`), what it reports while running (`Progress`)
and at the end (`TrainReport`). Plain dataclasses so the controller, the CLI and the benchmark
share them without importing torch or Ray.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from training.placement import cluster_resource

SYNC_HELP = "use every-step, local-sgd:H (H >= 1), stale:S (S >= 0) or adaptive"


@dataclass(frozen=True)
class SyncMode:
    """How often and how stale the cross-cluster exchange is.

    kind: "every-step" (exchange gradients each step), "local-sgd" (DiLoCo: `period` inner steps,
    then an outer Nesterov step on the averaged pseudo-gradient), "stale" (gradients are applied
    `staleness` steps late, so the exchange overlaps that many steps of compute) or "adaptive"
    (every step, compression level picked from link bandwidth and measured compute time).
    """

    kind: str
    period: int = 1
    staleness: int = 0

    def __str__(self) -> str:
        if self.kind == "local-sgd":
            return f"local-sgd:{self.period}"
        if self.kind == "stale":
            return f"stale:{self.staleness}"
        return self.kind


def parse_sync(text: str) -> SyncMode:
    """Parse `every-step`, `local-sgd:H`, `stale:S` or `adaptive`; ValueError says the fix."""
    t = text.strip().lower()
    if t in ("every-step", "adaptive"):
        return SyncMode(t)
    m = re.fullmatch(r"(local-sgd|diloco|stale):(\d+)", t)
    if not m:
        raise ValueError(f"sync {text!r} is not understood: {SYNC_HELP}")
    n = int(m.group(2))
    if m.group(1) == "stale":
        return SyncMode("stale", staleness=n)
    if n < 1:
        raise ValueError(f"sync {text!r}: H must be >= 1 ({SYNC_HELP})")
    return SyncMode("local-sgd", period=n)


def parse_clusters(text: str) -> dict[str, int]:
    """Parse `a:2,b:2,c:2` into {cluster: workers}; ValueError says the fix."""
    out: dict[str, int] = {}
    for part in text.split(","):
        part = part.strip()
        m = re.fullmatch(r"([^:]+):(\d+)", part)
        if not m:
            raise ValueError(f"clusters entry {part!r}: write NAME:WORKERS, e.g. a:2,b:2")
        name, n = m.group(1), int(m.group(2))
        cluster_resource(name)  # validates the name
        if n < 1:
            raise ValueError(f"clusters entry {part!r}: a cluster needs at least 1 worker")
        if name in out:
            raise ValueError(f"clusters entry {part!r}: cluster {name!r} is listed twice")
        out[name] = n
    if not out:
        raise ValueError("clusters: name at least one cluster, e.g. a:2,b:2")
    return out


@dataclass
class LinkSpec:
    """One WAN link between two clusters (symmetric, full duplex)."""

    a: str
    b: str
    mbps: float
    rtt_ms: float


@dataclass
class TrainSpec:
    """A training run: task, placement, compression, sync mode, WAN shaping, checkpoints.

    `links` is the emulated link table; empty means no shaping (real links, or one machine
    with no emulation). `link_mbps`/`rtt_ms` give every cluster pair without an explicit
    entry the same link. `checkpoint` is a directory path or file:// URI.
    """

    task: str = "builtin:mnist1d-mlp"
    clusters: dict[str, int] = field(default_factory=lambda: {"a": 1, "b": 1})
    compression: str = "none"
    sync: str = "every-step"
    steps: int = 100
    seed: int = 0
    batch_size: int | None = None  # global batch; None: the task's default
    lr: float | None = None  # None: the task's default
    links: list[LinkSpec] = field(default_factory=list)
    link_mbps: float | None = None
    rtt_ms: float | None = None
    checkpoint: str | None = None
    checkpoint_every: int = 0  # 0: only at the end (when `checkpoint` is set)
    resume: bool = False
    eval_every: int = 0  # 0: about 20 evaluations per run
    ray_address: str | None = None
    ray_num_cpus: int | None = None  # local Ray only
    gloo_ifname: str | None = None  # None: "lo" on a local Ray, CPN_GLOO_IFNAME or unset otherwise
    gpus_per_worker: float = 0.0
    max_restarts: int = 3
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    adaptive_levels: list[str] = field(
        default_factory=lambda: [
            "none",
            "bf16",
            "int8",
            "topk:0.1:m0",
            "topk:0.01:m0",
            "topk:0.001:m0",
        ]
    )
    """Least to most compressed. Levels share one local optimizer, so top-k here runs without
    its own momentum correction (m0): the optimizer keeps the momentum."""
    link_schedule: list[tuple[int, float, float]] = field(default_factory=list)
    """(from_step, mbps, rtt_ms): from that step on every link is reshaped (tests, benchmarks)."""

    def validate(self) -> None:
        """Raise ValueError naming the field and the fix."""
        if not self.clusters:
            raise ValueError("clusters: name at least one cluster, e.g. {'a': 2, 'b': 2}")
        for name, n in self.clusters.items():
            cluster_resource(name)
            if n < 1:
                raise ValueError(f"clusters: cluster {name!r} needs at least 1 worker")
        parse_sync(self.sync)
        if self.steps < 1:
            raise ValueError("steps: must be >= 1")
        if self.batch_size is not None and self.batch_size < self.world_size:
            raise ValueError(
                f"batch_size: {self.batch_size} is smaller than the {self.world_size} workers; "
                "raise it or use fewer workers"
            )
        if self.checkpoint_every < 0:
            raise ValueError("checkpoint_every: must be >= 0")
        if self.resume and not self.checkpoint:
            raise ValueError("resume: needs a checkpoint directory (checkpoint / --checkpoint-dir)")
        if (self.link_mbps is None) != (self.rtt_ms is None):
            raise ValueError("link_mbps/rtt_ms: give both (or neither)")
        if self.link_mbps is not None and self.link_mbps <= 0:
            raise ValueError("link_mbps: must be > 0")
        if self.rtt_ms is not None and self.rtt_ms < 0:
            raise ValueError("rtt_ms: must be >= 0")
        for link in self.links:
            for end in (link.a, link.b):
                if end not in self.clusters:
                    raise ValueError(f"links: cluster {end!r} is not one of the job's clusters")
            if link.mbps <= 0 or link.rtt_ms < 0:
                raise ValueError(f"links: {link.a}-{link.b} needs mbps > 0 and rtt_ms >= 0")
        if self.max_restarts < 0:
            raise ValueError("max_restarts: must be >= 0")

    @property
    def world_size(self) -> int:
        return sum(self.clusters.values())

    @property
    def emulated(self) -> bool:
        return bool(self.links) or self.link_mbps is not None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Progress:
    """One progress report (after a segment of steps); the controller stores these as events."""

    step: int
    total_steps: int
    loss: float
    accuracy: float | None
    wall_s: float
    compute_s: float
    comm_s: float
    wan_bytes: dict[str, int]
    wan_bytes_total: int
    compression_ratio: float
    compression: str
    restarts: int = 0
    # compute seconds so far of each cluster's slowest rank (the cost model's calibration
    # needs each GPU model's own time, not rank 0's)
    compute_by_cluster: dict[str, float] = field(default_factory=dict)


@dataclass
class TrainReport:
    """The end of a run: what the CLI prints and the controller stores."""

    task: str
    clusters: dict[str, int]
    compression: str
    sync: str
    steps: int
    final_loss: float
    final_accuracy: float
    wall_s: float
    compute_s: float
    comm_s: float
    wan_s: float
    wan_bytes: dict[str, int]
    wan_bytes_total: int
    compression_ratio: float
    wan_emulated: bool
    links: list[dict[str, Any]]
    restarts: int
    resumed_from_step: int | None
    stopped: bool
    history: list[dict[str, float]]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
