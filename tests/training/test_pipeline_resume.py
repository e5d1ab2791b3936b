"""Per-stage checkpoints of a pipeline run: each stage saves its shard in its own fenced store,
and a run stopped or killed mid-way resumes from the newest step every stage has, ending where
an uninterrupted run ends (real Ray, built-in MLP, a few steps)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from training.checkpoint import FORMAT, StaleRun, open_store
from training.pipeline.checkpoint import (
    SHARD,
    check_shard,
    consistent_cut,
    prepare,
    shard_due,
    stage_uri,
)
from training.pipeline.driver import StagePool

# ---------------------------------------------------------------- pure parts


def test_consistent_cut_is_newest_step_every_stage_has() -> None:
    assert consistent_cut([[2, 4, 6], [2, 4, 6]]) == 6
    assert consistent_cut([[2, 4, 6], [2, 4]]) == 4  # killed between two stages' saves
    assert consistent_cut([[4, 6], [2]]) is None  # nothing in common
    assert consistent_cut([[2], []]) is None
    assert consistent_cut([]) is None


def test_shard_due_every_n_and_at_the_end() -> None:
    assert [s for s in range(1, 8) if shard_due(s, 7, 3)] == [3, 6, 7]
    assert [s for s in range(1, 8) if shard_due(s, 7, 0)] == [7]


def _shard(step: int, stage: int, epoch: int = 0, run_id: str = "job") -> dict[str, Any]:
    return {
        "version": FORMAT,
        "kind": SHARD,
        "run_id": run_id,
        "epoch": epoch,
        "step": step,
        "task": "builtin:mnist1d-mlp",
        "stage": stage,
        "stages": 2,
        "cuts": [2],
    }


def test_check_shard_names_the_mismatch() -> None:
    ok = _shard(2, 1)
    check_shard(ok, task="builtin:mnist1d-mlp", stage=1, stages=2, cuts=(2,), where="w")
    with pytest.raises(ValueError, match="stage 1 of 2"):
        check_shard(ok, task="builtin:mnist1d-mlp", stage=1, stages=3, cuts=(2,), where="w")
    with pytest.raises(ValueError, match="--stages @2"):
        check_shard(ok, task="builtin:mnist1d-mlp", stage=1, stages=2, cuts=(3,), where="w")
    with pytest.raises(ValueError, match="task"):
        check_shard(ok, task="builtin:char-transformer", stage=1, stages=2, cuts=(2,), where="w")
    with pytest.raises(ValueError, match="not a pipeline stage"):
        check_shard({**ok, "kind": None}, task="x", stage=1, stages=2, cuts=(2,), where="w")


def test_prepare_finds_the_cut_fences_every_stage_and_refuses_stale_attempts(
    tmp_path: Path,
) -> None:
    root = str(tmp_path / "ck")
    assert prepare(root, 2, "job", 0, resume=False).step is None  # fresh: claims, fences
    for s, steps in enumerate([(2, 4), (2,)]):
        store = open_store(stage_uri(root, s))
        for step in steps:
            store.save(step, _shard(step, s))
    with pytest.raises(ValueError, match=r"checkpoint: .*resume"):
        prepare(root, 2, "job", 0, resume=False)
    found = prepare(root, 2, None, 1, resume=True)  # the root says whose run it is
    assert (found.run_id, found.step) == ("job", 2)
    # attempt 1 has started on every stage store: attempt 0 may neither start nor save
    with pytest.raises(StaleRun):
        prepare(root, 2, "job", 0, resume=True)
    with pytest.raises(StaleRun):
        open_store(stage_uri(root, 1)).save(4, _shard(4, 1, epoch=0))
    assert open_store(stage_uri(root, 1)).steps() == [2]


# ---------------------------------------------------------------- real Ray runs

STEPS = 6
TOL = 1e-5
"""Relative tolerance on the loss: restored parameters, Adam state and RNG make the resumed run
compute the same floats as the uninterrupted one; the margin only absorbs summation order."""


@pytest.fixture(scope="module")
def pool(ray_session: None) -> Iterator[StagePool]:
    kept = StagePool()
    yield kept
    kept.close()


def _spec(ckpt: Path | None, *, resume: bool = False, epoch: int = 0, hybrid: bool = False) -> Any:
    from training.pipeline import PipelineSpec, place
    from training.spec import TrainSpec

    clusters = {"a": 2, "b": 2} if hybrid else {"a": 1, "b": 1}
    train = TrainSpec(
        task="builtin:mnist1d-mlp",
        clusters=clusters,
        steps=STEPS,
        batch_size=32,
        eval_every=2,
        checkpoint=str(ckpt) if ckpt is not None else None,
        checkpoint_every=2,
        resume=resume,
        run_id="job-1" if ckpt is not None else None,
        epoch=epoch,
    )
    return PipelineSpec(train, place(clusters, None, hybrid), micro_batches=2)


def _params(keep: list[Any], stages: int, replicas: int) -> list[torch.Tensor]:
    import ray

    out = [q for s in range(stages) for q in ray.get(keep[s * replicas].parameters.remote())]
    ray.get([a.close.remote() for a in keep])
    return out


class Killed(Exception):
    """The driver dies mid-run (a controller crash): its stage actors are killed."""


@pytest.mark.parametrize("hybrid", [False, True], ids=["pipeline", "hybrid"])
def test_killed_run_resumes_from_stage_checkpoints_and_ends_like_an_uninterrupted_one(
    pool: StagePool, tmp_path: Path, hybrid: bool
) -> None:
    from training.pipeline import run_pipeline

    replicas = 2 if hybrid else 1
    keep: list[Any] = []
    whole = run_pipeline(_spec(None, hybrid=hybrid), keep=keep, pool=pool)
    ref = _params(keep, 2, replicas)

    def die_at_4(step: int, loss: float | None) -> None:
        if step == 4:
            raise Killed

    ckpt = tmp_path / "ck"
    with pytest.raises(Killed):
        run_pipeline(_spec(ckpt, hybrid=hybrid), on_segment=die_at_4, pool=pool)
    for s in range(2):  # every stage saved its own shard at steps 2 and 4
        assert open_store(stage_uri(str(ckpt), s)).steps() == [2, 4]

    keep = []
    resumed = run_pipeline(_spec(ckpt, resume=True, epoch=1, hybrid=hybrid), keep=keep, pool=pool)
    assert resumed.resumed_from_step == 4
    assert [h["step"] for h in resumed.history] == [6]
    assert resumed.steps == STEPS
    assert resumed.final_loss == pytest.approx(whole.final_loss, rel=TOL)
    assert resumed.final_accuracy == pytest.approx(whole.final_accuracy, abs=1e-9)
    got = _params(keep, 2, replicas)
    assert all(torch.allclose(a, b, rtol=TOL, atol=1e-7) for a, b in zip(got, ref, strict=True))
    for s in range(2):  # the resumed attempt saved the end under its own epoch
        store = open_store(stage_uri(str(ckpt), s))
        assert store.steps()[-1] == STEPS and store.load(STEPS)["epoch"] == 1


def test_stopped_run_resumes_and_a_stale_attempt_cannot_start(
    pool: StagePool, tmp_path: Path
) -> None:
    from training.pipeline import run_pipeline

    whole = run_pipeline(_spec(None), pool=pool)
    ckpt = tmp_path / "ck"
    stopped = run_pipeline(_spec(ckpt), pool=pool, should_stop=lambda: True)
    assert stopped.steps == 2
    resumed = run_pipeline(_spec(ckpt, resume=True, epoch=1), pool=pool)
    assert resumed.resumed_from_step == 2
    assert resumed.final_loss == pytest.approx(whole.final_loss, rel=TOL)
    with pytest.raises(StaleRun):
        run_pipeline(_spec(ckpt, resume=True, epoch=0), pool=pool)
