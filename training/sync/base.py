"""The interface every sync mode implements, and the registry that builds them by kind.

`Worker` owns the loop: data, forward/backward, the local optimizer step, progress and
checkpoints. A `SyncStrategy` owns what crosses clusters and when. Per step the Worker calls

    grad   = strategy.after_backward(local_grad, step, compute_s)  # exchange, timed as comm
    apply grad with the local optimizer                               # timed as compute
    strategy.after_local_step()                                       # e.g. drift correction
    strategy.after_step(step)                                         # e.g. an outer step

then, after the run's last step, `finish()`. It checkpoints only where `at_sync_point(step)`,
saving `state_dict()` (run-wide, from rank 0) and `cluster_state()` (each cluster leader's),
and hands both back to `load_state_dict` when it resumes.

A new mode is a `SyncKind` in `grammar` plus one class registered here with
`register_sync_strategy`; the Worker does not change.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch
from torch import nn

from grammar import Compression, Sync, SyncKind
from training.collective import Collective
from training.results import AutoChoice
from training.spec import TrainSpec


class Scope(StrEnum):
    """What a rank's loss is averaged over, hence what its gradient is a share of."""

    GLOBAL = "global"
    """The step's global batch: summed over all clusters, the gradients give the full-batch
    mean (modes that exchange every step's gradient)."""
    CLUSTER = "cluster"
    """Its cluster's batch: summed inside the cluster, the gradient is that cluster's mean
    (modes where a cluster steps on its own gradient first)."""


@dataclass
class SyncContext:
    """What a strategy works with on one rank."""

    spec: TrainSpec
    comm: Collective
    model: nn.Module
    params: Sequence[torch.Tensor]
    """The trainable parameters, in the order of the flat gradients."""
    apply: Callable[[torch.Tensor], None]
    """Take a local optimizer step with this flat gradient (the Worker's optimizer)."""
    cluster_share: float
    """This cluster's share of the global batch."""
    cluster_shares: dict[str, float] = field(default_factory=dict)
    """Every cluster's share of the global batch (modes that weight clusters by samples)."""
    reset_local: Callable[[], None] = lambda: None
    """Drop the local optimizer's state (its momentum): a mode that keeps the clusters in
    lockstep (every-step) must not start from momentum each cluster gathered on its own."""
    device_s: Callable[[], float] = lambda: 0.0
    """The last local step's forward/backward in device time: CPU seconds of this rank's
    thread times its cluster's emulated slowdown. Unlike wall time it does not grow when
    other processes share the machine's cores, so modes that compare cluster speeds (partial,
    async-ps) read this."""


class SyncStrategy(ABC):
    """How (and how often) the clusters of a run exchange: one instance per rank.

    Every rank calls the same methods in the same order; collectives inside them must match
    across ranks (`self.comm` knows who is a leader).
    """

    exchanges_gradients: bool = True
    """True when what crosses the WAN is each step's gradient: a compressor's momentum
    correction (DGC) then replaces the local optimizer's momentum. False when it is something
    else (local SGD's pseudo-gradients), so the local optimizer keeps its momentum."""

    regroups: bool = False
    """True when a rank can re-form with other members mid-run and go on from its own
    state (`training.faults`): what it holds between steps is all in `state_dict` and
    `cluster_state`, and an outer round broken half-way can be run again whole."""

    global_rounds: bool = True
    """Whether its sync points are rounds every cluster takes part in, so a loss inside one
    leaves it open, to finish among the survivors. False where clusters meet a server or
    their neighbours on their own clocks (async-ps, gossip): a survivor that stopped in an
    exchange has lost nothing by it, and the survivors that stopped at different steps take
    the state of the one furthest on (`training.faults.agree`)."""

    def __init__(self, sync: Sync, ctx: SyncContext) -> None:
        self.sync = sync
        self.ctx = ctx
        self.comm = ctx.comm
        self.spec = ctx.spec
        # the compression level of the next exchange (reported in progress, checkpointed)
        self.compression: Compression = ctx.spec.compression

    @property
    def scope(self) -> Scope:
        """What this rank's loss is averaged over before `after_backward`."""
        return Scope.GLOBAL

    @abstractmethod
    def after_backward(self, grad: torch.Tensor, step: int, compute_s: float) -> torch.Tensor:
        """This rank's flat gradient of `step` (weighted per `scope`; backward took
        `compute_s`): exchange what the mode exchanges and return the flat gradient the local
        optimizer applies now. May reduce `grad` in place."""

    def local_steps(self, step: int) -> int:
        """How many local steps (backward, `after_backward`, optimizer step) this rank takes
        in `step` before `after_step`; more than 1 lets a fast cluster run ahead of the
        slowest (partial, async-ps). Must agree across the ranks of a cluster."""
        return 1

    def stats(self) -> dict[str, float]:
        """What the mode reports about itself in the run's `sync_stats`."""
        return {}

    def decisions(self) -> tuple[AutoChoice, ...]:
        """What the mode decided at run time (auto), reported as the run's `auto_decisions`."""
        return ()

    def seats_at(self, step: int) -> int | None:
        """The end of the global round `step` is in: where a member that joined at `step`,
        its state still crossing the WAN, may take part. Until then it trains nothing and
        weighs nothing in the rounds' exchanges, which it takes part in all the same
        (`defer`, `replay`), while the others train on. None: the members wait for the
        state before training (the mode cannot seat one late)."""
        return None

    def defer(self) -> None:
        """A member joining late, before its state is here: keep each round's outcome (the
        others' sum) instead of applying it to a state it does not hold yet."""
        raise NotImplementedError(f"{type(self).__name__} seats no member late")

    def replay(self) -> None:
        """After `load_state_dict` took the peer's state: apply the rounds kept since."""
        raise NotImplementedError(f"{type(self).__name__} seats no member late")

    def sitting_out(self, seating: bool) -> None:  # noqa: B027 - optional hook
        """On every rank alike: True once members joined late sit out (`seats_at`), False
        once they are seated. A mode that re-decides itself at run time (auto) decides
        nothing meanwhile: what the members sitting out keep (`defer`) is that mode's."""

    def after_local_step(self) -> None:  # noqa: B027 - optional hook
        """After each local optimizer step (several per step where `local_steps` > 1): a
        correction of the parameters themselves goes here (`training.sync.drift`)."""

    def after_step(self, step: int) -> None:  # noqa: B027 - optional hook
        """After the local optimizer step of `step` (local SGD's outer step goes here)."""

    def finish(self) -> None:  # noqa: B027 - optional hook
        """After the run's last step: apply what is still in flight."""

    def at_sync_point(self, step: int) -> bool:
        """Whether every cluster holds the state a checkpoint after `step` must capture."""
        return True

    def cluster_state(self) -> dict[str, Any]:
        """On each cluster leader at a checkpoint (before the leaders gather): this cluster's
        part of the sync state. A `"model"` entry (not None) is this cluster's own view of the
        parameters, which the Worker restores for that cluster. Must leave no exchange in
        flight."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """On rank 0 at a checkpoint, after `cluster_state`: the run-wide sync state."""
        return {}

    def load_state_dict(  # noqa: B027 - optional hook
        self, state: Mapping[str, Any] | None, cluster_state: Mapping[str, Any] | None
    ) -> None:
        """Called once at setup, after the model and optimizer are restored. `state` and
        `cluster_state` are what `state_dict` and this cluster's `cluster_state` saved (a new
        cluster gets the first cluster's), or None on a fresh start or when the checkpoint was
        written by another sync mode."""

    def abandon(self) -> None:  # noqa: B027 - optional hook
        """The run's group broke (a cluster was lost; `regroups` modes only): forget the
        exchanges in flight without waiting for them, before this rank's state is held for
        the re-formed run. What is left must be the same on every survivor that stopped at
        the same step, whatever of the broken exchange reached it."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release threads or other resources (the process may train another run)."""


SyncFactory = Callable[[Sync, SyncContext], SyncStrategy]

_REGISTRY: dict[SyncKind, SyncFactory] = {}


def count_leaders_sends(comm: Collective, sent: Mapping[tuple[str, str], int]) -> None:
    """Add every other leader's point-to-point WAN bytes (`sent`: this leader's, by link) to
    this leader's exchange counters, so each leader reports the whole exchange as the ring
    modes do. Leaders only; a collective over the leaders' group."""
    import torch.distributed as dist

    from training.results import ExchangeCounters, WanBytes

    exchanger = comm.exchanger
    assert exchanger is not None
    gathered: list[Any] = [None] * len(comm.clusters)
    dist.all_gather_object(gathered, dict(sent), group=exchanger.group)
    others: dict[tuple[str, str], int] = {}
    for cluster, theirs in zip(comm.clusters, gathered, strict=True):
        if cluster != comm.cluster:
            for edge, n in theirs.items():
                others[edge] = others.get(edge, 0) + n
    exchanger.counters = exchanger.counters + ExchangeCounters(
        wan_bytes=WanBytes(others), sent_bytes=sum(others.values())
    )


def register_sync_strategy(
    kind: SyncKind, factory: SyncFactory, *, replace: bool = False
) -> SyncFactory | None:
    """Make `factory` build the strategy of sync values of `kind`; returns the one it
    replaces. Registering a kind twice is an error unless `replace` is set."""
    previous = _REGISTRY.get(kind)
    if previous is not None and not replace:
        raise ValueError(f"sync kind {kind.value!r} already has a strategy ({previous!r})")
    _REGISTRY[kind] = factory
    return previous


def regroups(sync: Sync) -> bool:
    """Whether runs of `sync` shrink and grow in place when a cluster leaves or joins
    (`SyncStrategy.regroups` of the kind's strategy); else they restart from a checkpoint."""
    factory = _REGISTRY.get(sync.kind)
    return bool(getattr(factory, "regroups", False))


def make_sync_strategy(sync: Sync, ctx: SyncContext) -> SyncStrategy:
    """The strategy registered for `sync.kind`; ValueError for kinds no run can use (auto)."""
    factory = _REGISTRY.get(sync.kind)
    if factory is None:
        runnable = ", ".join(k.value for k in _REGISTRY)
        raise ValueError(f"sync {str(sync)!r}: no strategy runs it; use one of {runnable}")
    return factory(sync, ctx)
