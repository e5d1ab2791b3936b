"""Every documented concrete compression and sync value runs on the real runtime (real Ray).

The control-plane half (each value is quoted and placed) is
tests/service/test_documented_values.py; `auto` is the planner's and never reaches a run.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import training
from grammar import DOCUMENTED_COMPRESSIONS, DOCUMENTED_SYNCS, parse_compression, parse_sync
from training import TrainSpec
from training.runner import WorkerPool

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.slow]

RUNS = [(c, "every-step") for c in DOCUMENTED_COMPRESSIONS if not parse_compression(c).is_auto] + [
    ("int8", s) for s in DOCUMENTED_SYNCS if not parse_sync(s).is_auto and s != "every-step"
]


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    """One worker group for all the runs: they differ in values, not in placement."""
    workers = WorkerPool()
    yield workers
    workers.close()


@pytest.mark.parametrize(("compression", "sync"), RUNS, ids=[f"{c}|{s}" for c, s in RUNS])
def test_documented_value_runs(pool: WorkerPool, compression: str, sync: str) -> None:
    steps = 8
    report = training.run(
        TrainSpec(
            task="builtin:mnist1d-mlp",
            clusters={"a": 1, "b": 1},
            compression=compression,
            sync=sync,
            steps=steps,
            eval_every=steps,
            link_mbps=1000,
            rtt_ms=1,
        ),
        pool=pool,
    )
    assert report.steps == steps and not report.stopped
    assert report.sync == sync
    if sync != "adaptive":  # adaptive reports the levels it moved through
        assert report.compression == compression
    assert report.wan_bytes_total > 0
    assert report.final_loss == report.final_loss  # not NaN
