"""One quality policy for both layers: the planner's steps factors and the runtime's ladder
come from `grammar.quality`, and its rule picks the least lossy option within the slack."""

from __future__ import annotations

import pytest

from grammar.quality import (
    MAX_COST,
    SLACK,
    SPEED_BOUND,
    compression_cost,
    least_lossy,
    quality_cost,
    sync_cost,
)
from scheduler.compression import compressor_model, sync_model
from training.auto import LADDER
from training.spec import TrainSpec


def test_the_planner_and_the_runtime_read_one_table() -> None:
    for value in ("none", "bf16", "int8", "int4", "topk:0.01", "powersgd:2", "sign"):
        assert compressor_model(value).steps_factor == pytest.approx(1 + compression_cost(value))
    for value in ("every-step", "stale:1", "local-sgd:32", "partial:16", "async-ps:4"):
        assert sync_model(value).steps_factor == pytest.approx(1 + sync_cost(value))
    # the runtime's auto ladder is ordered least to most lossy by the same costs
    costs = [compression_cost(level) for level in LADDER]
    assert costs == sorted(costs) and len(set(costs)) == len(costs)
    assert TrainSpec(task="builtin:mnist1d-mlp").speed_bound == SPEED_BOUND


def test_lossless_costs_nothing_and_lossy_options_compound() -> None:
    assert quality_cost("none", "every-step") == 0.0
    assert quality_cost("topk:0.01", "local-sgd:32") == pytest.approx(
        (1 + compression_cost("topk:0.01")) * (1 + sync_cost("local-sgd:32")) - 1
    )
    assert compression_cost("topk:0.01") > compression_cost("int8") > 0


def test_least_lossy_within_the_slack_of_the_fastest() -> None:
    options = [("lossy", 10.0, 0.3), ("mild", 10.5, 0.01), ("lossless", 12.0, 0.0)]

    def pick(opts: list[tuple[str, float, float]], slack: float = SLACK) -> str:
        return least_lossy(opts, lambda o: o[1], lambda o: o[2], slack)[0]

    assert pick(options) == "mild"  # 5 % slower than the fastest, 30x less lossy
    assert pick(options, slack=0.25) == "lossless"
    assert pick(options, slack=0.0) == "lossy"
    # an option over MAX_COST counts only where nothing else is possible
    ruinous = [("ruinous", 1.0, MAX_COST + 1), ("sound", 5.0, 0.0)]
    assert pick(ruinous) == "sound"
    assert pick(ruinous[:1]) == "ruinous"
    with pytest.raises(ValueError):
        pick([])
