"""Tensor parallelism as the runtime runs it (issue 53, items 1 and 2): a stage replica's
layers split over T ranks of its cluster, alone (a tensor-parallel job: one stage), beside
data-parallel replicas, and under pipeline stages across clusters (3D); and data parallelism
over whole pipeline replicas on clusters of their own. Each real Ray run must train as one
process does on the same batches, and a split run's stage checkpoints must resume under
another split."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.training.helpers import reference_run
from training.pipeline.driver import StagePool
from training.pipeline.schedule import Schedule
from training.pipeline.split import Placement
from training.tasks import load_task
from training.tensor_parallel import check_split

pytestmark = pytest.mark.slow

TASK = "builtin:char-gpt"


def test_placement_keeps_a_replicas_tensor_ranks_together() -> None:
    p = Placement(("a", "b"), replicas=2, tensor=2)
    assert p.world == 8
    assert [(p.stage_of(r), p.replica_of(r), p.tensor_of(r)) for r in range(8)] == [
        (s, r, t) for s in range(2) for r in range(2) for t in range(2)
    ]
    assert all(p.rank(p.stage_of(r), p.replica_of(r), p.tensor_of(r)) == r for r in range(8))
    assert p.cluster_of(3) == "a" and p.cluster_of(4) == "b"


def test_a_split_that_does_not_divide_says_the_fix() -> None:
    model = load_task(TASK).model()
    check_split(model, 2)
    with pytest.raises(ValueError, match="tensor: 4 heads do not split over 3 GPUs"):
        check_split(model, 3)
    mlp = load_task("builtin:mnist1d-mlp").model()
    with pytest.raises(ValueError, match="no layer that says how it splits"):
        check_split(mlp, 2)
    check_split(mlp, 1)


def _reference(steps: int, batch: int) -> tuple[list[float], list[torch.Tensor]]:
    return reference_run(TASK, steps, batch)


def _spec(placement: Placement, steps: int, ckpt: Path | None = None, **kw: Any) -> Any:
    from training.pipeline import PipelineSpec
    from training.spec import TrainSpec

    train = TrainSpec(
        task=TASK,
        clusters=placement.workers(),
        steps=steps,
        batch_size=16,
        eval_every=1,
        checkpoint=str(ckpt) if ckpt is not None else None,
        checkpoint_every=1 if ckpt is not None else 0,
        run_id="job-tp" if ckpt is not None else None,
        resume=kw.pop("resume", False),
        epoch=kw.pop("epoch", 0),
        link_mbps=kw.pop("link_mbps", None),
        rtt_ms=kw.pop("rtt_ms", None),
    )
    return PipelineSpec(train, placement, **kw)


def _params(keep: list[Any], p: Placement) -> list[torch.Tensor]:
    """Replica 0's parameters, whole, in model order (every rank asked: gathering a split
    parameter takes its stage replica's ranks together)."""
    import ray

    got = ray.get([a.parameters.remote() for a in keep])
    ray.get([a.close.remote() for a in keep])
    return [q for s in range(p.stages) for q in got[p.rank(s, 0)]]


@pytest.fixture(scope="module")
def pool(ray_session: None) -> Iterator[StagePool]:
    kept = StagePool()
    yield kept
    kept.close()


# Adam turns fp-rounding-sized gradient differences into at most ~lr-sized steps
PARAM_ATOL = 1e-3


def test_tensor_parallel_with_replicas_equals_single_process(pool: StagePool) -> None:
    from training.pipeline import run_pipeline

    p = Placement(("a",), replicas=2, tensor=2)
    keep: list[Any] = []
    report = run_pipeline(_spec(p, 3, micro_batches=2), keep=keep, pool=pool)
    losses, ref = _reference(3, 16)
    assert report.parallel == "tensor" and report.tensor == 2 and report.replicas == 2
    assert [h["loss"] for h in report.history] == pytest.approx(losses, rel=1e-5)
    params = _params(keep, p)
    assert all(torch.allclose(a, b, atol=PARAM_ATOL) for a, b in zip(params, ref, strict=True))
    # each rank holds half of every block's projections: fewer parameters than the model
    whole = sum(q.numel() for q in ref)
    assert whole / 2 < report.stage_params[0] < whole
    assert report.activation_bytes.total == 0  # one cluster: nothing on the WAN


def test_3d_pipeline_of_split_stages_equals_single_process_and_resumes_unsplit(
    pool: StagePool, tmp_path: Path
) -> None:
    from training.checkpoint import open_store
    from training.pipeline import run_pipeline
    from training.pipeline.checkpoint import stage_uri

    p = Placement(("a", "b"), replicas=1, tensor=2)
    ckpt = tmp_path / "ck"
    keep: list[Any] = []
    report = run_pipeline(
        _spec(p, 3, ckpt, micro_batches=4, schedule=Schedule.ONE_F_ONE_B, link_mbps=200, rtt_ms=2),
        keep=keep,
        pool=pool,
    )
    losses, _ = _reference(5, 16)
    assert report.parallel == "3d"
    assert [h["loss"] for h in report.history] == pytest.approx(losses[:3], rel=1e-5)
    # only one rank of each stage replica sends: the WAN carries each gradient once (forward,
    # the final evaluation's activations too)
    act = 3 * 16 * 32 * 64 * 4
    wan = report.activation_bytes
    assert act <= wan[("b", "a")] < 1.5 * act and wan[("a", "b")] >= act
    ray_close(keep)
    for s in range(2):
        assert open_store(stage_uri(str(ckpt), s)).steps()[-1] == 3

    # the shards are whole: the same run resumes on one GPU a stage and ends as one process
    whole_p = Placement(("a", "b"))
    keep = []
    resumed = run_pipeline(
        _spec(whole_p, 5, ckpt, micro_batches=4, resume=True, epoch=1), keep=keep, pool=pool
    )
    assert resumed.resumed_from_step == 3
    assert [h["loss"] for h in resumed.history] == pytest.approx(losses[3:], rel=1e-4)
    _, ref = _reference(5, 16)
    params = _params(keep, whole_p)
    assert all(torch.allclose(a, b, atol=PARAM_ATOL) for a, b in zip(params, ref, strict=True))


def test_whole_pipeline_replicas_across_clusters_equal_single_process(pool: StagePool) -> None:
    """Two pipelines, (a, b) and (c, d): each stage's gradients all-reduce over the WAN
    between its replicas' clusters (counted: each replica sends its stage's gradient bytes a
    step, 2(R - 1) rounds of 1/R), the activations inside each pipeline; the run trains as
    one process does."""
    from training.pipeline import run_pipeline

    p = Placement(("a", "b"), replicas=2, pipelines=(("a", "b"), ("c", "d")))
    steps = 3
    report = run_pipeline(_spec(p, steps, micro_batches=2, link_mbps=200, rtt_ms=2), pool=pool)
    losses, _ = _reference(steps, 16)
    assert report.parallel == "hybrid" and report.pipelines == [["a", "b"], ["c", "d"]]
    assert [h["loss"] for h in report.history] == pytest.approx(losses, rel=1e-5)
    wan = report.activation_bytes
    for (x, y), stage in ((("a", "c"), 0), (("b", "d"), 1)):
        grads = steps * 4 * report.stage_params[stage]
        assert wan[(x, y)] == wan[(y, x)] == grads
    assert wan[("a", "b")] > 0 and wan[("c", "d")] > 0  # each pipeline's own activations
    assert ("a", "d") not in wan and ("c", "b") not in wan


def ray_close(keep: list[Any]) -> None:
    import ray

    ray.get([a.close.remote() for a in keep])
