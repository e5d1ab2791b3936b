"""MNIST-1D: top-k at 1% density with error feedback ends within 1 point of uncompressed."""

from __future__ import annotations

import pytest

import training
from training import TrainSpec
from training.runner import WorkerPool

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.slow]


def test_topk_one_percent_with_error_feedback_matches_uncompressed() -> None:
    def spec(compression: str) -> TrainSpec:
        # long enough for both to reach the MLP's plateau on MNIST-1D (~65-68 %)
        return TrainSpec(
            task="builtin:mnist1d-mlp",
            clusters={"a": 1, "b": 1},
            steps=1600,
            compression=compression,
            eval_every=400,
        )

    pool = WorkerPool()  # the second run takes the first's warm workers
    try:
        dense = training.run(spec("none"), pool=pool)
        sparse = training.run(spec("topk:0.01"), pool=pool)
    finally:
        pool.close()
    assert dense.final_accuracy > 0.6  # both really learned
    assert sparse.final_accuracy >= dense.final_accuracy - 0.01
    assert sparse.steps == dense.steps == 1600
    assert dense.wan_bytes_total / sparse.wan_bytes_total > 50
