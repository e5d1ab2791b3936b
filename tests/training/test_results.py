"""Typed worker results: WAN counters keyed by (src, dst), addable, and the JSON they keep."""

from __future__ import annotations

import json
import math

import pytest

from training import Progress, TrainReport, WanBytes
from training.results import ExchangeCounters


def test_wan_bytes_add_total_and_json_round_trip() -> None:
    a = WanBytes({("a", "b"): 10, ("b", "a"): 5})
    b = WanBytes({("b", "a"): 1, ("b", "c"): 7})
    total = a + b
    assert dict(total) == {("a", "b"): 10, ("b", "a"): 6, ("b", "c"): 7}
    assert total.total == 23 and a.total == 15 and WanBytes().total == 0
    assert dict(a) == {("a", "b"): 10, ("b", "a"): 5}  # values: adding made a new one
    assert total.to_json() == {"a->b": 10, "b->a": 6, "b->c": 7}  # first-use order
    assert WanBytes.from_json(total.to_json()) == total
    # cluster names may hold '-' (never '>'): the first '->' splits
    assert WanBytes.from_json({"eu-west->us-east": 3}) == {("eu-west", "us-east"): 3}
    with pytest.raises(ValueError, match="'ab'"):
        WanBytes.from_json({"ab": 1})


def test_exchange_counters_add_up() -> None:
    one = ExchangeCounters(WanBytes({("a", "b"): 100}), raw_bytes=400, sent_bytes=100, rounds=1)
    two = one + one
    assert (two.rounds, two.sent_bytes, two.raw_bytes, two.wan_bytes.total) == (2, 200, 800, 200)
    assert two.compression_ratio == 4.0 and ExchangeCounters().compression_ratio == 1.0


def test_progress_and_report_keep_their_json() -> None:
    wan = WanBytes({("a", "b"): 3, ("b", "a"): 4})
    progress = Progress(
        step=2,
        total_steps=4,
        loss=1.5,
        accuracy=None,
        wall_s=1.0,
        compute_s=0.5,
        comm_s=0.25,
        wan_bytes=wan,
        wan_bytes_total=7,
        compression_ratio=2.0,
        compression="int8",
        compute_by_cluster={"a": 0.5},
    )
    data = json.loads(json.dumps(progress.to_dict()))
    assert data["wan_bytes"] == {"a->b": 3, "b->a": 4} and data["step"] == 2
    report = TrainReport(
        task="builtin:mnist1d-mlp",
        clusters={"a": 1, "b": 1},
        compression="int8",
        sync="every-step",
        steps=4,
        final_loss=1.0,
        final_accuracy=math.nan,
        wall_s=2.0,
        compute_s=1.0,
        comm_s=0.5,
        wan_s=0.4,
        wan_bytes=wan,
        wan_bytes_total=7,
        compression_ratio=2.0,
        wan_emulated=False,
        links=[],
        restarts=0,
        resumed_from_step=None,
        stopped=False,
        history=[{"wall_s": 1.0, "step": 2, "loss": 1.5}],
    )
    data = json.loads(json.dumps(report.to_dict()))
    assert data["wan_bytes"] == {"a->b": 3, "b->a": 4}
    assert data["wan_bytes_total"] == 7 and data["history"][0]["step"] == 2
    assert report.wan_bytes[("a", "b")] == 3  # the attribute stays typed


def test_a_run_that_fell_from_its_best_says_so() -> None:
    from training.results import quality_of

    def h(step: int, acc: float, loss: float) -> dict[str, float]:
        return {"step": step, "accuracy": acc, "eval_loss": loss, "loss": loss, "wall_s": 0.0}

    steady = quality_of([h(10, 0.2, 2.0), h(20, 0.5, 1.4), h(30, 0.6, 1.2)])
    assert steady.warning == "" and steady.best_step == 30 and steady.best_accuracy == 0.6
    # the demo's shape before issue 47: up to 0.34, down to 0.217 with the loss tripled
    fell = quality_of([h(15, 0.2, 2.2), h(150, 0.34, 1.9), h(300, 0.217, 6.23)])
    assert fell.best_step == 150 and fell.best_eval_loss == 1.9
    assert "diverged" in fell.warning and "0.2170" in fell.warning and "0.3400" in fell.warning
    # eval loss up 40 %, accuracy kept: worse (over-fitting, say), not diverged
    worse = quality_of([h(10, 0.2, 2.0), h(20, 0.6, 1.0), h(30, 0.59, 1.4)])
    assert "got worse" in worse.warning and worse.best_step == 20
    # a little noise at the end is no divergence
    noisy = quality_of([h(10, 0.2, 2.0), h(20, 0.6, 1.2), h(30, 0.58, 1.25)])
    assert noisy.warning == ""
    assert quality_of([]).best_step is None
