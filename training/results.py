"""Typed values the workers hand the driver: WAN byte counters and per-segment results.

Plain dataclasses and a small mapping, no torch: the driver, the controller and the CLI read
them without loading the runtime. Counters are immutable and addable, so the driver sums the
counters of a run's attempts (`before + last`) instead of merging dicts by hand.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from training.logs import LogLine

Edge = tuple[str, str]
"""A directed WAN link: (source cluster, destination cluster)."""


class WanBytes(Mapping[Edge, int]):
    """Bytes put on each directed WAN link, keyed by `(src, dst)`; immutable and addable.

    Its JSON form (`to_json`, `from_json`) keys each link `"src->dst"`: that is what job
    events, metrics and `cpn train --json` store.
    """

    def __init__(self, by_edge: Mapping[Edge, int] | None = None) -> None:
        self._by_edge: dict[Edge, int] = {
            (str(src), str(dst)): int(n) for (src, dst), n in (by_edge or {}).items()
        }

    def __getitem__(self, edge: Edge) -> int:
        return self._by_edge[edge]

    def __iter__(self) -> Iterator[Edge]:
        return iter(self._by_edge)

    def __len__(self) -> int:
        return len(self._by_edge)

    def __repr__(self) -> str:
        return f"WanBytes({self._by_edge!r})"

    def __add__(self, other: WanBytes) -> WanBytes:
        if not isinstance(other, WanBytes):
            return NotImplemented
        out = dict(self._by_edge)
        for edge, n in other._by_edge.items():
            out[edge] = out.get(edge, 0) + n
        return WanBytes(out)

    @property
    def total(self) -> int:
        """Bytes over all links."""
        return sum(self._by_edge.values())

    def to_json(self) -> dict[str, int]:
        """`{"src->dst": bytes}`, links in the order they were first used."""
        return {f"{src}->{dst}": n for (src, dst), n in self._by_edge.items()}

    @classmethod
    def from_json(cls, data: Mapping[str, int]) -> WanBytes:
        """Read `to_json`'s form; ValueError names a key that is not `src->dst`."""
        out: dict[Edge, int] = {}
        for key, n in data.items():
            src, arrow, dst = key.partition("->")
            if not arrow or not src or not dst:
                raise ValueError(f"wan_bytes: key {key!r} is not 'src->dst'")
            out[(src, dst)] = int(n)
        return cls(out)


@dataclass(frozen=True)
class ExchangeCounters:
    """Totals of the cross-cluster exchanges (every directed link; leaders all see the same)."""

    wan_bytes: WanBytes = field(default_factory=WanBytes)
    raw_bytes: int = 0
    """What uncompressed float32 exchanges would have put on the links."""
    sent_bytes: int = 0
    rounds: int = 0
    wall_s: float = 0.0
    link_s: float = 0.0
    """What the links alone needed (emulated or not)."""
    paced_s: float = 0.0
    """Seconds this leader held its exchanges back to keep to its job's WAN reservation
    (`training.wan.Pacer`); not in `wall_s`."""
    setup_bytes: int = 0
    """Of `sent_bytes`, what the start-up put on the links: the digests that check every
    worker built the same model, plus the model itself where they did not."""

    def __add__(self, other: ExchangeCounters) -> ExchangeCounters:
        if not isinstance(other, ExchangeCounters):
            return NotImplemented
        return ExchangeCounters(
            wan_bytes=self.wan_bytes + other.wan_bytes,
            raw_bytes=self.raw_bytes + other.raw_bytes,
            sent_bytes=self.sent_bytes + other.sent_bytes,
            rounds=self.rounds + other.rounds,
            wall_s=self.wall_s + other.wall_s,
            link_s=self.link_s + other.link_s,
            paced_s=self.paced_s + other.paced_s,
            setup_bytes=self.setup_bytes + other.setup_bytes,
        )

    @property
    def compression_ratio(self) -> float:
        """Uncompressed bytes over sent bytes (1.0 before anything was sent)."""
        return float(self.raw_bytes) / self.sent_bytes if self.sent_bytes else 1.0


@dataclass(frozen=True)
class AutoChoice:
    """One decision of `--sync auto` / `--compression auto` (`training.auto`): from `step` on
    the run used `sync` and `compression`, for the reason `why`."""

    step: int
    sync: str
    compression: str
    why: str


@dataclass(frozen=True)
class SegmentResult:
    """What one worker reports after a segment of steps (`Worker.run`)."""

    step: int
    loss: float
    """Mean training loss over the segment's steps on this rank."""
    accuracy: float | None
    """Evaluation accuracy, when the driver asked for it."""
    compute_s: float
    comm_s: float
    compression: str
    """The compression level in use (adaptive sync changes it during the run)."""
    intra_s: float = 0.0
    """Of `comm_s`, the intra-cluster gradient reduces (`Collective.intra_s`)."""
    wan: ExchangeCounters = field(default_factory=ExchangeCounters)
    """This run's exchange totals so far; zero on ranks that are not cluster leaders."""
    local_steps: int = 0
    """Local optimizer steps this rank took so far (more than `step` where a fast cluster
    runs several per step of the slowest: partial, async-ps)."""
    sync_stats: dict[str, float] = field(default_factory=dict)
    """What the sync mode reports about itself (`SyncStrategy.stats`)."""
    batch_shares: dict[str, float] = field(default_factory=dict)
    """Each cluster's share of the global batch, as the run splits it."""
    labels_read: tuple[int, ...] = ()
    """Under local data: the distinct labels of the samples this rank read (what proves a
    label-split cluster read only its own samples)."""
    auto_decisions: tuple[AutoChoice, ...] = ()
    """Under sync or compression auto: what the runtime's policy decided, in order."""
    eval_loss: float | None = None
    """Mean loss over the evaluation set, beside `accuracy` (a language model's quality is
    its loss more than its next-token accuracy)."""
    logs: tuple[LogLine, ...] = ()
    """What this worker printed since its last report (`training.logs`)."""
    best: BestModel | None = None
    """Rank 0: the best evaluation whose model the checkpoint store keeps (`artefact` best)."""
    seated: tuple[tuple[str, int], ...] = ()
    """Clusters that joined late and began training in this segment, each with the step it
    trained from (it sat out the round its state crossed the WAN in)."""


@dataclass(frozen=True)
class BestModel:
    """The evaluation whose model is kept as the run's best (`CheckpointStore.save_best`)."""

    step: int
    accuracy: float
    eval_loss: float | None

    def header(self) -> dict[str, Any]:
        return {"step": self.step, "accuracy": self.accuracy, "eval_loss": self.eval_loss}


DIVERGED_LOSS = 0.20
"""A final eval loss this much (relative) above the best one means the run diverged."""
DIVERGED_GAIN = 0.5
"""So does a final accuracy that lost this share of the accuracy the run had gained."""


@dataclass(frozen=True)
class Quality:
    """The best evaluation of a run beside its last, and a warning when the last fell well
    below the best (the run diverged: its last model is not its best)."""

    best_step: int | None
    best_accuracy: float
    best_eval_loss: float
    warning: str = ""


def at_least_as_good(
    accuracy: float, eval_loss: float | None, than: Mapping[str, Any] | None
) -> bool:
    """Whether an evaluation is at least as good as `than` (a history entry, or the header of
    the best model kept; None: there is none yet): by eval loss where both measured one, else
    by accuracy. Of equals the later wins, so the best model kept is the newest of them."""
    if than is None:
        return True
    other = than.get("eval_loss")
    if eval_loss is not None and other is not None:
        return eval_loss <= float(other)
    return accuracy >= float(than["accuracy"])


def quality_of(history: list[dict[str, float]]) -> Quality:
    """The best evaluation in `history` (by eval loss where measured, else accuracy) and
    whether the final one fell from it by more than DIVERGED_LOSS in loss or DIVERGED_GAIN of
    the accuracy gained since the first evaluation."""
    evals = [h for h in history if h.get("accuracy") is not None]
    if not evals:
        return Quality(None, float("nan"), float("nan"))
    best = evals[0]
    for h in evals[1:]:
        if at_least_as_good(float(h["accuracy"]), h.get("eval_loss"), best):
            best = h
    last, first = evals[-1], evals[0]
    b_acc, l_acc = float(best["accuracy"]), float(last["accuracy"])
    b_loss = float(best.get("eval_loss", float("nan")))
    l_loss = float(last.get("eval_loss", float("nan")))
    why = []
    if b_loss == b_loss and l_loss == l_loss and l_loss > (1 + DIVERGED_LOSS) * b_loss:
        why.append(f"eval loss {l_loss:.4g} against its best {b_loss:.4g}")
    top = max(float(h["accuracy"]) for h in evals)
    gain = top - float(first["accuracy"])
    if gain > 0 and top - l_acc > DIVERGED_GAIN * gain:
        why.append(f"accuracy {l_acc:.4f} against its best {top:.4f}")
    warning = ""
    if why:
        kind = "diverged" if any(w.startswith("accuracy") for w in why) else "got worse"
        warning = (
            f"the run's evaluation {kind}: final {' and '.join(why)} (at step "
            f"{int(best['step'])}); its last model is not its best"
        )
    return Quality(int(best["step"]), b_acc, b_loss, warning)
