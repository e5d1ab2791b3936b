"""What a training run is asked to do (`TrainSpec`), what it reports while running (`Progress`)
and at the end (`TrainReport`). Plain dataclasses so the controller, the CLI and the benchmark
share them without importing torch or Ray. Compression and sync are kept as the shared
grammar's values (`grammar.Compression`, `grammar.Sync`): a string given for one (a CLI flag, a
dict read back from JSON) is parsed once, when it is set, and nothing below parses it again.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Generic, TypeVar, overload

from grammar import Compression, Sync, SyncKind, parse_compression, parse_sync
from grammar.auto import adaptable
from grammar.quality import SPEED_BOUND
from training.logs import LogLine
from training.placement import cluster_resource
from training.results import AutoChoice, WanBytes


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


T = TypeVar("T")
V = TypeVar("V")


class Parsed(Generic[V, T]):
    """A dataclass field that holds the grammar's value `T` and takes a `V` (a string) too,
    parsed on assignment (a descriptor-typed field: the dataclass calls `__get__(None, ...)`
    once for its default). Set through `object.__setattr__`, so frozen dataclasses keep it."""

    def __init__(self, parse: Callable[[V | T], T], default: V | T) -> None:
        self._parse = parse
        self._default = parse(default)

    def __set_name__(self, owner: type, name: str) -> None:
        self._attr = "_" + name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> T: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...
    def __get__(self, obj: object | None, owner: type | None = None) -> T:
        if obj is None:
            return self._default
        value: T = getattr(obj, self._attr)
        return value

    def __set__(self, obj: object, value: V | T) -> None:
        object.__setattr__(obj, self._attr, self._parse(value))
        object.__setattr__(obj, self._attr + "_text", value if isinstance(value, str) else None)

    def text(self, obj: object) -> str | None:
        """The text last assigned, where it was one (None: a parsed value)."""
        return getattr(obj, self._attr + "_text", None)


def _concrete_compression(text: str | Compression) -> Compression:
    compression = parse_compression(text)
    if compression.is_auto:
        raise ValueError(
            f"compression {str(text)!r}: auto is the planner's to replace; a run needs a "
            "concrete value such as none, int8 or topk:0.01"
        )
    return compression


def _levels(values: Sequence[str | Compression]) -> tuple[Compression, ...]:
    """Adaptive's compression levels, each concrete (ValueError names the one at fault)."""
    if isinstance(values, str):
        raise ValueError("adaptive_levels: give a list of compression values, e.g. [none, int8]")
    out = []
    for i, level in enumerate(values):
        try:
            out.append(_concrete_compression(level))
        except ValueError as exc:
            raise ValueError(f"adaptive_levels[{i}]: {exc}") from None
    return tuple(out)


AUTO_SYNCS = (SyncKind.AUTO, SyncKind.EVERY_STEP, SyncKind.LOCAL_SGD)
"""Sync kinds the runtime's auto policy (`training.auto`) runs: auto itself, and the ones
under which it picks `compression: auto`."""

DATA_MODES = ("shared", "local")
"""Where a run's samples come from: the whole set on every cluster, or each cluster's own."""

OUTER_BY_DATA: dict[str, tuple[float, float]] = {"shared": (0.7, 0.5), "local": (1.0, 0.0)}
"""The outer step's (lr, momentum) by where the data is: a Nesterov step on shared data, with
momentum 0.5 rather than DiLoCo's 0.9 (tuned for H = 500), under which runs of periods 4-10
diverged to chance within 600 steps and none ended better (bench/results/
outer-momentum.md); on local data (label-skewed) the plain average, since the outer momentum
compounds the skew of each round's averaged pseudo-gradient (bench/results/local-data.md).
`partial:H` keeps 0.9 on shared data (`PARTIAL_OUTER`)."""

PARTIAL_OUTER = (0.7, 0.9)
"""`partial:H` on shared data: its pseudo-gradients are normalised by each cluster's steps a
tick (FedNova), so a round moves less than local SGD's and 0.9 did not diverge; at 400 steps
0.5 ended at the same accuracy (0.661 against 0.660) with a training loss 0.77 against 0.44."""

ARTEFACTS = ("best", "last")
"""The model a run leaves: its best evaluation's, or its last step's."""


def parse_slowdown(text: str) -> dict[str, float]:
    """Parse `a:4,b:2` into {cluster: factor}; ValueError says the fix."""
    out: dict[str, float] = {}
    for part in text.split(","):
        name, sep, raw = part.strip().rpartition(":")
        try:
            factor = float(raw) if sep and name else math.nan
        except ValueError:
            factor = math.nan
        if not (math.isfinite(factor) and factor >= 1.0) or name in out:
            raise ValueError(
                f"slowdown entry {part.strip()!r}: write CLUSTER:FACTOR with a factor >= 1 "
                "and each cluster once, e.g. c:4"
            )
        out[name] = factor
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
    entry the same link. `checkpoint` is a directory path or a URI (file://, s3://bucket/prefix).
    """

    task: str = "builtin:mnist1d-mlp"
    clusters: dict[str, int] = field(default_factory=lambda: {"a": 1, "b": 1})
    compression: Parsed[str, Compression] = Parsed(parse_compression, "none")
    sync: Parsed[str, Sync] = Parsed(parse_sync, "every-step")
    steps: int = 100
    seed: int = 0
    batch_size: int | None = None  # global batch; None: the task's default
    lr: float | None = None  # None: the task's default
    links: list[LinkSpec] = field(default_factory=list)
    link_mbps: float | None = None
    rtt_ms: float | None = None
    checkpoint: str | None = None
    checkpoint_every: int = 0  # 0: only at the end (when `checkpoint` is set)
    artefact: str = "best"
    """The model the run leaves (with `checkpoint`): "best", its best evaluation's (kept as
    `best.pt` beside the step checkpoints), or "last", the final step's checkpoint."""
    resume: bool = False
    run_id: str | None = None
    """Whose checkpoints these are (the controller: the job's id); a resume refuses another
    run's. None: the checkpoint directory's own id (`run-id` file, made on first use)."""
    epoch: int = 0
    """This attempt of the run, written into its checkpoints; a resume refuses a checkpoint of
    a later attempt."""
    eval_every: int = 0  # 0: about 20 evaluations per run
    ray_address: str | None = None
    ray_num_cpus: int | None = None  # local Ray only
    gloo_ifname: str | None = None  # None: "lo" on a local Ray, CPN_GLOO_IFNAME or unset otherwise
    gpus_per_worker: float = 0.0
    max_restarts: int = 3
    outer_lr: float | None = None
    outer_momentum: float | None = None
    outer_nesterov: bool = True
    """The outer step (local SGD, streaming, partial) is SGD with this lr and momentum,
    Nesterov's when `outer_nesterov` and the momentum is > 0; None: by the data
    (`outer_settings`)."""
    adaptive_levels: Parsed[Sequence[str | Compression], tuple[Compression, ...]] = Parsed(
        _levels, ("none", "bf16", "int8", "topk:0.1:m0", "topk:0.01:m0", "topk:0.001:m0")
    )
    """Least to most compressed. Levels share one local optimizer, so top-k here runs without
    its own momentum correction (m0): the optimizer keeps the momentum."""
    wan_kbps: dict[str, int] = field(default_factory=dict)
    """{cluster: kbit/s}: the WAN rate the job reserved of that cluster's uplink; its leader's
    sends average no more (`training.wan.Pacer`, one exchange of burst). Empty: unpaced."""
    link_schedule: list[tuple[int, float, float]] = field(default_factory=list)
    """(from_step, mbps, rtt_ms): from that step on every link is reshaped (tests, benchmarks)."""
    batch_shares: dict[str, float] = field(default_factory=dict)
    """{cluster: share of the global batch} (the plan's, by GPU throughput), split equally
    over the cluster's workers; empty: an equal share a worker. The gradient stays the whole
    batch's mean (each worker's loss is weighted by its samples)."""
    slowdown: dict[str, float] = field(default_factory=dict)
    """{cluster: factor >= 1}: that cluster's compute takes `factor` times as long (the worker
    waits out the difference), so heterogeneous clusters can be emulated on one machine."""
    speed_bound: int = SPEED_BOUND
    """partial / async-ps: a cluster takes at most this many local steps per step of the
    slowest cluster."""
    data: str = "shared"
    """"shared": every cluster draws from the whole training set; "local": each cluster reads
    only its own part (`Task.cluster_data`), so no sample leaves its cluster."""
    drift_correction: bool = False
    """Local SGD, partial and streaming correct each local step by the clusters' drift apart
    (`training.sync.drift`, SCAFFOLD's control variates: nothing more crosses the WAN). Off
    unless asked: on label-skewed local data it ended runs lower, not higher
    (bench/results/local-data.md)."""
    regions: dict[str, str] = field(default_factory=dict)
    """{cluster: region} for every cluster, or empty (one region). `async-ps` runs one
    parameter server per region under a global one when the clusters span two or more."""
    relay_ticks: dict[str, int] = field(default_factory=dict)
    """{region: ticks}: under `async-ps` across regions, each region's server sends its
    progress to the global one every this many steps of the slowest cluster (the plan's,
    `scheduler.cost.relay_ticks`), or later where the last has not landed; 1 where absent."""
    fault_domains: bool = True
    """A lost cluster leaves the run and the others go on from where they are, and a cluster
    can join mid-run (`training.faults`), where the sync mode can (`training.sync.regroups`);
    False: every loss restarts every cluster from the newest checkpoint."""
    fault_grace_s: float = 60.0
    """Under fault domains, how long a collective waits for a peer that is late (longer than
    the slowest cluster's lag at an outer round). A peer that answers not even the driver's
    probe (`training.ray_actors.PROBE_S`) is counted lost sooner: its peers' waits are ended
    (`training.connections`)."""
    tree: dict[str, str] = field(default_factory=dict)
    """{cluster: parent}: all-reduce between leaders over this tree (`training.exchange.
    LeaderExchange.tree`; the plan's `grammar.graph.reduction_tree`) instead of the ring,
    where the compressor can (else all-gather as always); empty: the ring. Used only while
    it spans exactly the run's clusters: after a cluster left or joined, the ring."""
    adapt: tuple[str, ...] = ()
    """What of `sync` ("sync") and `compression` ("compression") the runtime's auto policy may
    re-decide when the measured link moves away from the one the run started on: the run
    starts on the concrete `sync` and `compression` given (a plan's) and reports each change
    in `auto_decisions` (`grammar.auto.adaptable` says which parts a plan leaves open)."""

    def __post_init__(self) -> None:
        """A sync given as text on local data takes local data's defaults (`parse_sync`:
        streaming's fragments default to one), as a job's spec does."""
        parsed: Parsed[str, Sync] = vars(TrainSpec)["sync"]
        text = parsed.text(self)
        if self.data == "local" and text is not None:
            self.sync = parse_sync(text, local_data=True)

    def with_clusters(
        self,
        clusters: dict[str, int],
        *,
        links: Sequence[LinkSpec] | None = None,
        wan_kbps: dict[str, int] | None = None,
        batch_shares: dict[str, float] | None = None,
    ) -> TrainSpec:
        """This run on `clusters` (a cluster left or joined): what names a cluster that is
        gone is dropped. `links`, `wan_kbps`, `batch_shares`: the caller's plan on them
        (`training.faults.Membership`); without one a newcomer gets the default link, no
        reservation and an average share, and no slowdown either way."""
        keep = set(clusters)
        links = self.links if links is None else links
        wan_kbps = self.wan_kbps if wan_kbps is None else wan_kbps
        batch_shares = self.batch_shares if batch_shares is None else batch_shares
        return replace(
            self,
            clusters=dict(clusters),
            links=[k for k in links if k.a in keep and k.b in keep],
            wan_kbps={c: r for c, r in wan_kbps.items() if c in keep},
            slowdown={c: f for c, f in self.slowdown.items() if c in keep},
            batch_shares={c: v for c, v in batch_shares.items() if c in keep},
            regions={c: self.regions[c] for c in clusters} if keep <= set(self.regions) else {},
            tree=self.tree if keep == set(self.clusters) else {},  # another shape: the ring
        )

    def validate(self) -> None:
        """Raise ValueError naming the field and the fix."""
        if not self.clusters:
            raise ValueError("clusters: name at least one cluster, e.g. {'a': 2, 'b': 2}")
        for name, n in self.clusters.items():
            cluster_resource(name)
            if n < 1:
                raise ValueError(f"clusters: cluster {name!r} needs at least 1 worker")
        self._check_grammar()
        if self.steps < 1:
            raise ValueError("steps: must be >= 1")
        if self.batch_size is not None and self.batch_size < self.world_size:
            raise ValueError(
                f"batch_size: {self.batch_size} is smaller than the {self.world_size} workers; "
                "raise it or use fewer workers"
            )
        if self.checkpoint_every < 0:
            raise ValueError("checkpoint_every: must be >= 0")
        for region, ticks in self.relay_ticks.items():
            if not 1 <= ticks <= 1_000_000:
                raise ValueError(f"relay_ticks: {region!r} needs 1 to 1000000 ticks, not {ticks}")
        for name, share in self.batch_shares.items():
            if name not in self.clusters:
                raise ValueError(f"batch_shares: {name!r} is not one of the run's clusters")
            if not (math.isfinite(share) and share > 0):
                raise ValueError(f"batch_shares: {name!r} needs a share > 0, not {share!r}")
        if self.artefact not in ARTEFACTS:
            raise ValueError(f"artefact: {self.artefact!r}; use one of {', '.join(ARTEFACTS)}")
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
        if self.tree:
            nodes = set(self.tree) | set(self.tree.values())
            roots = set(self.tree.values()) - set(self.tree)
            if nodes != set(self.clusters) or len(roots) != 1:
                raise ValueError(
                    "tree: give every cluster but one root its parent, among the job's "
                    "clusters (or leave it empty for the ring)"
                )
        for name, kbps in self.wan_kbps.items():
            if name not in self.clusters:
                raise ValueError(f"wan_kbps: cluster {name!r} is not one of the job's clusters")
            if not (isinstance(kbps, int) and kbps > 0):
                raise ValueError(f"wan_kbps: {name} needs a rate > 0 kbit/s, e.g. {name}: 100000")
        if self.max_restarts < 0:
            raise ValueError("max_restarts: must be >= 0")
        if not (math.isfinite(self.fault_grace_s) and 1.0 <= self.fault_grace_s <= 3600.0):
            raise ValueError("fault_grace_s: must be 1-3600 seconds, e.g. 60")
        for name, factor in self.slowdown.items():
            if name not in self.clusters:
                raise ValueError(f"slowdown: cluster {name!r} is not one of the job's clusters")
            if not (math.isfinite(factor) and factor >= 1.0):
                raise ValueError(f"slowdown: {name}:{factor} needs a factor >= 1, e.g. {name}:4")
        if self.regions and set(self.regions) != set(self.clusters):
            missing = sorted(set(self.clusters) - set(self.regions))
            extra = sorted(set(self.regions) - set(self.clusters))
            raise ValueError(
                f"regions: name the region of every cluster and no other (missing {missing}, "
                f"not the job's {extra}), e.g. {{'a': 'eu', 'b': 'us'}}"
            )
        if self.speed_bound < 1:
            raise ValueError("speed_bound: must be >= 1, e.g. 4")
        if self.data not in DATA_MODES:
            raise ValueError(f"data: {self.data!r} is not one of {', '.join(DATA_MODES)}")
        lr, momentum = self.outer_settings
        if not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"outer_lr: {lr} must be a number > 0, e.g. 0.7")
        if not (math.isfinite(momentum) and 0.0 <= momentum < 1.0):
            raise ValueError(f"outer_momentum: {momentum} must be in [0, 1), e.g. 0.9 (0: none)")

    def _check_grammar(self) -> None:
        """What the grammar's parse (on assignment) cannot see: `auto` is the runtime policy's
        only where it picks compression; adaptive needs levels to pick from."""
        if self.compression.is_auto and self.sync.kind not in (*AUTO_SYNCS, SyncKind.ADAPTIVE):
            raise ValueError(
                f"compression 'auto' with sync '{self.sync}': the runtime picks compression "
                "under sync auto, every-step or local-sgd:H; use one of them, or a concrete "
                "compression such as int8"
            )
        if self.sync.kind is SyncKind.ADAPTIVE and not self.adaptive_levels:
            raise ValueError("adaptive_levels: name at least one compression level")
        if self.adapt:
            unknown = [p for p in self.adapt if p not in ("sync", "compression")]
            if unknown:
                raise ValueError(f"adapt: {unknown}; name only 'sync' and 'compression'")
            open_ = dict.fromkeys(self.adapt, "auto")
            left = adaptable(
                open_.get("compression", self.compression),
                open_.get("sync", self.sync),
                self.compression,
                self.sync,
                local_data=self.data == "local",
            )
            if not left:
                raise ValueError(
                    f"adapt: the runtime cannot re-decide from sync '{self.sync}' with "
                    f"compression '{self.compression}'; start from every-step, local-sgd:H or "
                    "streaming with a compression of the auto menu, or leave adapt empty"
                )

    @property
    def outer_settings(self) -> tuple[float, float]:
        """(lr, momentum) of the outer step: as given, else by where the data is
        (`OUTER_BY_DATA`: a Nesterov step on shared data, the plain average on local data)
        and, for `partial` on shared data, `PARTIAL_OUTER`."""
        data = self.data if self.data in OUTER_BY_DATA else "shared"
        lr, momentum = OUTER_BY_DATA[data]
        if data == "shared" and self.sync.kind is SyncKind.PARTIAL:
            lr, momentum = PARTIAL_OUTER
        return (
            lr if self.outer_lr is None else self.outer_lr,
            momentum if self.outer_momentum is None else self.outer_momentum,
        )

    @property
    def world_size(self) -> int:
        return sum(self.clusters.values())

    @property
    def emulated(self) -> bool:
        return bool(self.links) or self.link_mbps is not None

    def to_dict(self) -> dict[str, Any]:
        """As plain data (JSON's types): the grammar's values in their canonical form, which
        `TrainSpec(**d)` parses back."""
        out = asdict(self)
        out["compression"] = str(self.compression)
        out["sync"] = str(self.sync)
        out["adaptive_levels"] = [str(level) for level in self.adaptive_levels]
        return out


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
    wan_bytes: WanBytes
    """Bytes so far per directed link `(src, dst)`; `to_dict` writes them `{"src->dst": n}`."""
    wan_bytes_total: int
    compression_ratio: float
    compression: str
    restarts: int = 0
    # compute seconds so far of each cluster's slowest rank (the cost model's calibration
    # needs each GPU model's own time, not rank 0's)
    compute_by_cluster: dict[str, float] = field(default_factory=dict)
    exchange_s: float = 0.0
    """Seconds so far the leaders spent exchanging over the WAN (waits to keep to a
    reservation excluded): the controller reads each cluster's send rate from it."""
    clusters: dict[str, int] = field(default_factory=dict)
    """The clusters training now (fewer than launched after one left: `membership`)."""
    membership: list[dict[str, Any]] = field(default_factory=list)
    """Every cluster that left or joined so far (`training.faults`), oldest first: `step`,
    `cluster`, `change` ("left"/"joined"/"refused", and "seated": a cluster joined late trains
    from `step`), `why`, `workers`, `recovery_s`."""
    logs: list[LogLine] = field(default_factory=list)
    """What the workers printed since the last report, and what the driver said (a cluster
    left, a restart and its error), in time order."""
    auto_decisions: list[AutoChoice] = field(default_factory=list)
    """Every decision of the run's auto policy so far, oldest first (a planned run's changes
    from its plan: `TrainSpec.adapt`)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: `wan_bytes` as `{"src->dst": bytes}`."""
        return {**asdict(self), "wan_bytes": self.wan_bytes.to_json()}


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
    """Rank 0's seconds in its steps' exchanges: the intra-cluster reduce (`intra_s`) and
    what of the WAN exchange the steps waited for."""
    wan_s: float
    wan_bytes: WanBytes
    """Bytes per directed link `(src, dst)`; `to_dict` writes them `{"src->dst": n}`."""
    wan_bytes_total: int
    compression_ratio: float
    wan_emulated: bool
    links: list[dict[str, Any]]
    restarts: int
    resumed_from_step: int | None
    stopped: bool
    history: list[dict[str, float]]
    hosts: int = 0
    """The Ray nodes its workers ran on (0: not known). On one, they started on its cores
    one after another, so its set-up grew with them (`controller.network.snapshot`)."""
    host_cores: int = 0
    """The cores of the one machine every worker ran on (0: they ran on several, or it is
    not known): they shared them, so each step's compute took longer the more of them ran
    (`scheduler.Snapshot.host_cores`)."""
    wan_setup_bytes: int = 0
    """Of `wan_bytes_total`, what the start-up sent: the digests that check every worker built
    the same model, and the model itself only where some did not."""
    intra_s: float = 0.0
    """Of `comm_s`, rank 0's intra-cluster reduces: the rest is the WAN the steps waited
    for, and the other clusters' compute where rank 0's is faster."""
    wan_wait_s: float | None = None
    """The least any rank's steps waited at exchanges beyond its intra-cluster reduces, in
    the run's last group: the rank that arrives last waits for the links alone, not for
    another cluster's compute; the plan's WAN share is set against it (`bench.promise`).
    None where no segment ran."""
    steps_by_cluster: dict[str, int] = field(default_factory=dict)
    """Local optimizer steps each cluster took (this attempt); equal to `steps` unless the
    sync mode lets fast clusters run ahead (partial, async-ps)."""
    data: str = "shared"
    """"local": every sample stayed in its cluster; only model updates crossed the WAN."""
    batch_shares: dict[str, float] = field(default_factory=dict)
    """Each cluster's share of the global batch, as the run split it (the plan's
    `batch_shares`, to the sample)."""
    sync_stats: dict[str, float] = field(default_factory=dict)
    """What the sync mode reports about itself, e.g. gossip's `degree` and
    `messages_per_round`, the parameter server's `stale_updates` (rank 0's view)."""
    labels_by_cluster: dict[str, list[int]] = field(default_factory=dict)
    """Under local data: the distinct labels each cluster's ranks read (this attempt)."""
    auto_decisions: list[AutoChoice] = field(default_factory=list)
    """Under sync or compression auto: each decision of the runtime's policy (step, sync,
    compression, why), rank 0's (every rank decides the same)."""
    final_eval_loss: float = float("nan")
    """Mean loss over the evaluation set at the end (`final_loss` is the training loss of the
    last segment); NaN where the run ended before an evaluation."""
    best_step: int | None = None
    """The step of the run's best evaluation (`training.results.quality_of`)."""
    best_accuracy: float = float("nan")
    best_eval_loss: float = float("nan")
    warning: str = ""
    """Set when the run's final evaluation fell well below its best (it diverged, or its
    eval loss rose: `training.results.quality_of`)."""
    membership: list[dict[str, Any]] = field(default_factory=list)
    """Clusters that left or joined the run, as in `Progress.membership`."""
    artefact: dict[str, Any] = field(default_factory=dict)
    """The model the run left: `which` (best or last), `step`, `where` (the file), and the
    best's `accuracy` and `eval_loss`; empty without a checkpoint location."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (what `cpn train --json` prints): `wan_bytes` as `{"src->dst": bytes}`."""
        return {**asdict(self), "wan_bytes": self.wan_bytes.to_json()}
