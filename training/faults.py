"""Datacenter fault domains: what a run does when a cluster is lost, as pure decisions.

A cluster (a datacenter) is the unit a run loses and regains: when one of its workers dies,
stops answering within the grace window, or the controller takes the cluster away, the whole
cluster leaves. `recover` decides, from the sync mode and who is left, whether the survivors
re-form among themselves and go on (SHRINK, no checkpoint read), re-form with everyone (a
slow cluster is not a dead one: REFORM), restart every cluster from the newest checkpoint
(RESTART, as before fault domains), or give up (FAIL). `agree` decides, once a group has
re-formed, which member's state the others take (a newcomer's, or a survivor's that missed
the end of an outer round) and whether an interrupted outer round is finished first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from training.spec import LinkSpec

__all__ = [
    "Agreement",
    "GroupBroken",
    "Lost",
    "Membership",
    "Position",
    "Recovery",
    "agree",
    "is_collective_error",
    "recover",
    "ring_ordered",
]


class GroupBroken(RuntimeError):
    """Raised by a worker whose collectives failed (a peer gone or silent past the grace
    window): its state is intact and it waits to re-form."""


class Lost(StrEnum):
    """Why a cluster left a run."""

    GONE = "gone"
    """One of its workers died (its process, or its node)."""
    SILENT = "silent"
    """One of its workers answered neither the driver's probe nor its peers (a cut link, a
    frozen host)."""
    REMOVED = "removed"
    """The controller took it away (it went DOWN: its agent's lease expired)."""


@dataclass(frozen=True)
class Membership:
    """The clusters the caller (the controller) wants the run on, and how many times it
    changed its mind: the run follows a change only when `version` moves on, so a cluster
    the run lost itself is not joined again before the caller has seen it leave."""

    version: int
    clusters: dict[str, int]
    """In the order of the caller's ring."""
    links: tuple[LinkSpec, ...] | None = None
    """The caller's plan on `clusters`: the links to emulate or pace among them, what each
    cluster's sends keep to (`wan_kbps`) and its share of the global batch. None: the run
    keeps its own (a newcomer then gets the default link, no reservation, an average
    share)."""
    wan_kbps: dict[str, int] | None = None
    batch_shares: dict[str, float] | None = None


class Recovery(StrEnum):
    SHRINK = "shrink"
    """The survivors re-form without the lost clusters and go on from where they are."""
    REFORM = "reform"
    """Nobody was lost (the collective broke on a slow peer): re-form with everyone."""
    RESTART = "restart"
    """Every cluster restarts from the newest checkpoint (the mode cannot shrink, or no
    cluster survived)."""
    FAIL = "fail"
    """No restart is left."""


def recover(
    *,
    live: bool,
    clusters: Sequence[str],
    lost: Set[str],
    restarts: int,
    max_restarts: int,
    stuck: bool = False,
) -> Recovery:
    """What a run does about a broken segment. `live`: its sync mode can re-form in place
    (`training.sync.regroups`); `lost`: the clusters that left; `stuck`: the segment before
    broke too, at the same step (re-forming did not help: restart)."""
    survivors = [c for c in clusters if c not in lost]
    if stuck:
        live = False
    if live and not lost:
        return Recovery.REFORM
    if live and survivors:
        return Recovery.SHRINK
    return Recovery.FAIL if restarts >= max_restarts else Recovery.RESTART


@dataclass(frozen=True)
class Position:
    """Where a member of a re-forming group stands: the step it reached and whether that
    step's outer round (`after_step`) is still to finish; `step` -1 is a newcomer."""

    step: int
    pending: bool = False


@dataclass(frozen=True)
class Agreement:
    source: int | None
    """The rank whose state the `receivers` take; None when every member agrees."""
    receivers: tuple[int, ...] = ()
    finish_round: bool = False
    """Every member stopped inside the same step's outer round: finish it among them."""


def agree(positions: Sequence[Position]) -> Agreement:
    """Who gives state to whom once a group re-formed. Members that agree keep their own; else
    the lowest rank of those furthest on (and past its round) gives its state to every other.
    ValueError when members disagree while one is inside a round (the driver adds newcomers
    only between segments, where no round is open)."""
    first = positions[0]
    if all(p == first for p in positions):
        return Agreement(None, (), first.pending and first.step >= 0)
    if any(p.pending for p in positions):
        raise ValueError(f"regroup: members stopped at different places {list(positions)}")
    best = max(p.step for p in positions)
    source = next(r for r, p in enumerate(positions) if p.step == best)
    return Agreement(source, tuple(r for r, p in enumerate(positions) if p.step != best))


def is_collective_error(exc: BaseException) -> bool:
    """Whether `exc` is a failed collective (gloo reports a closed or silent peer as a
    RuntimeError from its transport), not a bug in the step."""
    if isinstance(exc, GroupBroken):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "gloo" in text or "Connection closed by peer" in text or "Timed out" in text
    )


def ring_ordered(clusters: Mapping[str, int], ring: Sequence[str]) -> dict[str, int]:
    """`clusters` in the order of `ring` (the WAN ring the planner priced: the runtime's
    ring runs the clusters in their given order); those the ring does not name keep their
    place after it."""
    first = [c for c in ring if c in clusters]
    return {c: clusters[c] for c in [*first, *(c for c in clusters if c not in first)]}
