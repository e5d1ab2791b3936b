"""Streaming DiLoCo on a real local Ray: with one fragment and no delay it is local SGD bit for
bit; with fragments in flight at a checkpoint, a resumed run ends exactly where an
uninterrupted one does."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import training
from tests.training.helpers import final_params
from training import TrainSpec
from training.runner import WorkerPool

pytestmark = pytest.mark.usefixtures("ray_session")

MLP = "builtin:mnist1d-mlp"


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    workers = WorkerPool()
    yield workers
    workers.close()


def test_one_fragment_without_delay_is_local_sgd(pool: WorkerPool, tmp_path: Path) -> None:
    def run(sync: str) -> dict[str, torch.Tensor]:
        ck = str(tmp_path / sync.replace(":", "-"))
        spec = TrainSpec(
            task=MLP,
            clusters={"a": 1, "b": 1},
            steps=10,  # not a multiple of H: the run's final sync is exercised too
            sync=sync,
            compression="int8",
            checkpoint=ck,
            eval_every=10,
        )
        report = training.run(spec, pool=pool)
        assert report.steps == 10 and report.sync == sync
        return final_params(ck)[1]

    local, streaming = run("local-sgd:4"), run("streaming:4:f1:d0")
    for k, v in local.items():
        assert torch.equal(streaming[k], v), k
    torch.manual_seed(0)
    start = training.tasks.load_task(MLP).model().state_dict()
    assert not torch.equal(start["0.weight"], local["0.weight"])  # it did train


@pytest.mark.slow
def test_resume_with_fragments_in_flight_is_exact(tmp_path: Path) -> None:
    def spec(name: str) -> TrainSpec:
        # fragment 0 leaves after steps 1, 5, 9 and fragment 1 after 3, 7, 11, each applied
        # one step later: the checkpoint after step 4 holds fragment 1 in flight
        return TrainSpec(
            task=MLP,
            clusters={"a": 2, "b": 1},
            steps=12,
            sync="streaming:4:f2:d1",
            compression="int4",
            checkpoint=str(tmp_path / name),
            checkpoint_every=4,
            eval_every=4,
        )

    clean = training.run(spec("clean"))
    seen: list[int] = []
    stopped = training.run(
        spec("resumed"), on_progress=lambda p: seen.append(p.step), should_stop=lambda: bool(seen)
    )
    assert stopped.stopped and stopped.steps == 4
    again = spec("resumed")
    again.resume = True
    resumed = training.run(again)
    assert resumed.resumed_from_step == 4 and resumed.steps == 12
    _, want = final_params(str(tmp_path / "clean"))
    _, got = final_params(str(tmp_path / "resumed"))
    for k in want:
        assert torch.equal(got[k], want[k]), k
    losses = [h["loss"] for h in clean.history]
    assert losses[-1] < losses[0]  # it learns
    # fragment 0 synced 4 times (the last at the end), fragment 1 3 times: each sync puts
    # half the model at 4 bits on each of the two links (a quarter in each ring phase)
    half = 23_050 // 2 * 4.125 / 8
    assert 7 * 2 * half <= clean.wan_bytes_total - clean.wan_setup_bytes <= 7 * 2 * half + 8000
