"""Per-stage checkpoints of a pipeline (or hybrid) run, and the step it resumes from.

Each stage keeps its own shard (its pieces' parameters, its optimizer state, its RNG) in its
own checkpoint store, `stage-S` under the run's checkpoint root (`stage_uri`), written by the
stage's replica 0 (after the in-cluster all-reduce the replicas hold the same parameters).
The stores are the data-parallel ones (`training.checkpoint`): atomic writes, the newest
`keep` kept, read as data only, and fenced, so a stale attempt's stage cannot overwrite its
successor's shard. The root records the run (`claim`).

A run resumes from a consistent cut (`consistent_cut`): the newest step every stage has.
Stages save at the same steps, so a run stopped between two stages' saves of one step
resumes from the step before (the stores keep more than one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from training.location import child

SHARD = "pipeline-stage"
"""`kind` of a stage shard: a data-parallel checkpoint is refused as one, and vice versa."""


def stage_uri(root: str, stage: int) -> str:
    """Where stage `stage` of a run checkpointing under `root` keeps its shards."""
    return child(root, f"stage-{stage}")


def consistent_cut(steps: Sequence[Sequence[int]]) -> int | None:
    """The newest step that every stage has a checkpoint of; None when there is none (no
    stages, a stage without checkpoints, or no step in common)."""
    if not steps:
        return None
    common = set(steps[0]).intersection(*map(set, steps[1:]))
    return max(common) if common else None


def shard_due(step: int, steps: int, every: int) -> bool:
    """Whether a stage saves after finishing `step` steps: every `every` steps (0: never on
    the way) and at the end."""
    return step == steps or (every > 0 and step % every == 0)


def check_shard(
    state: dict[str, Any], *, task: str, stage: int, stages: int, cuts: tuple[int, ...], where: str
) -> None:
    """ValueError naming the mismatch when a stage shard is not this stage of this split."""
    if state.get("kind") != SHARD:
        raise ValueError(f"checkpoint {where}: not a pipeline stage checkpoint")
    if state.get("task") != task:
        raise ValueError(f"checkpoint {where}: is for task {state.get('task')!r}, not {task!r}")
    if int(state.get("stage", -1)) != stage or int(state.get("stages", -1)) != stages:
        raise ValueError(
            f"stages: checkpoint {where} is stage {state.get('stage')} of "
            f"{state.get('stages')}, this run wants stage {stage} of {stages}; resume with the "
            "same number of stages"
        )
    saved = tuple(int(c) for c in state.get("cuts", ()))
    if saved != tuple(cuts):
        raise ValueError(
            f"stages: checkpoint {where} was split at {list(saved)}, this run at {list(cuts)}; "
            f"resume with --stages @{','.join(map(str, saved))}"
        )


@dataclass(frozen=True)
class Resume:
    """What the driver found before starting stages: whose run it is and where it resumes."""

    run_id: str | None
    step: int | None


def prepare(root: str | None, stages: int, run_id: str | None, epoch: int, resume: bool) -> Resume:
    """Claim the root for the run, fence every stage store at `epoch` (StaleRun when a later
    attempt has started on one), and find the consistent cut to resume from, reading each
    stage's shard there as data and checking its identity first. ValueError `checkpoint:`
    when there are checkpoints and `resume` is off."""
    from training.checkpoint import check_identity, open_store

    if root is None:
        return Resume(run_id, None)
    top = open_store(root)
    top.prepare()
    owner = top.claim(run_id)
    stores = [open_store(stage_uri(root, s)) for s in range(stages)]
    for store in stores:
        store.fence(epoch)
    found = [store.steps() for store in stores]
    if any(found) and not resume:
        raise ValueError(
            f"checkpoint: {root!r} already holds stage checkpoints; pass resume (--resume) or "
            "use an empty directory"
        )
    step = consistent_cut(found) if resume else None
    if step is not None:
        for store in stores:
            check_identity(store.load(step), owner, epoch, store.where(step))
    return Resume(owner, step)


def with_run(train: Any, found: Resume) -> Any:
    """`train` (a TrainSpec) carrying the run id the root was claimed for."""
    return replace(train, run_id=found.run_id)
