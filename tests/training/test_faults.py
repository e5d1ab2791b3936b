"""A worker killed mid-run without fault domains (`fault_domains=False`; with them a lost
cluster leaves and the others go on: test_fault_domains): the run restarts from its newest
checkpoint and ends where an uninterrupted run ends (same accuracy band; here even the same
parameters, since resume is exact: model, optimizer, compressor residuals, sync state, data
position and RNG).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch

import training
from tests.training.helpers import final_params
from training import TrainSpec

pytestmark = pytest.mark.usefixtures("ray_session")

CASES = [
    pytest.param("every-step", "topk:0.05", {"a": 2, "b": 1}, "w1", id="every-step-topk"),
    pytest.param(
        "local-sgd:3", "int8", {"a": 1, "b": 1}, "w1", id="diloco-int8", marks=pytest.mark.slow
    ),
    pytest.param(
        "stale:2", "topk:0.05", {"a": 1, "b": 1}, "w0", id="stale-topk", marks=pytest.mark.slow
    ),
]


@pytest.mark.parametrize(("sync", "compression", "clusters", "victim"), CASES)
def test_killed_worker_resumes_from_checkpoint(
    tmp_path: Path, sync: str, compression: str, clusters: dict[str, int], victim: str
) -> None:
    def spec(name: str) -> TrainSpec:
        return TrainSpec(
            task="builtin:mnist1d-mlp",
            clusters=clusters,
            steps=24,
            sync=sync,
            compression=compression,
            checkpoint=str(tmp_path / name),
            checkpoint_every=6,
            eval_every=4,
            fault_domains=False,
        )

    clean = training.run(spec("clean"))
    killed: list[str] = []

    def kill_once(p: training.Progress) -> None:
        if killed or p.step < 8:
            return
        names = [n for n in ray.util.list_named_actors() if n.endswith(f"-0-{victim}")]
        assert len(names) == 1
        ray.kill(ray.get_actor(names[0]))
        killed.append(names[0])

    report = training.run(spec("killed"), on_progress=kill_once)
    assert killed and report.restarts == 1
    assert report.steps == 24
    assert abs(report.final_accuracy - clean.final_accuracy) <= 0.02
    _, want = final_params(str(tmp_path / "clean"))
    _, got = final_params(str(tmp_path / "killed"))
    for k in want:
        assert torch.equal(got[k], want[k]), k
