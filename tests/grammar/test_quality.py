"""One quality policy for both layers: the planner's steps factors and the runtime's ladder
come from `grammar.quality`, and its rule picks the least lossy option within the slack."""

from __future__ import annotations

import pytest

from grammar import DOCUMENTED_SYNCS, SyncKind, parse_sync
from grammar.auto import (
    GRADIENT_LEVELS,
    PSEUDO_GRADIENT_LEVELS,
    SURVIVES_LOSS,
    candidates,
    resilience,
)
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
from training.spec import TrainSpec


def test_the_planner_and_the_runtime_read_one_table() -> None:
    for value in ("none", "bf16", "int8", "int4", "topk:0.01", "powersgd:2", "sign"):
        assert compressor_model(value).steps_factor == pytest.approx(1 + compression_cost(value))
    for value in ("every-step", "stale:1", "local-sgd:32", "partial:16", "async-ps:4"):
        assert sync_model(value).steps_factor == pytest.approx(1 + sync_cost(value))
    # each menu's levels are ordered least to most lossy under the syncs they pair with
    for levels, sync in ((GRADIENT_LEVELS, "every-step"), (PSEUDO_GRADIENT_LEVELS, "local-sgd:8")):
        costs = [compression_cost(level, sync) for level in levels]
        assert costs == sorted(costs), levels
    # pseudo-gradients: int8 costs no quality (int4 less than a doubling of the period)
    assert compression_cost("int8", "local-sgd:32") == 0.0 < compression_cost("int8")
    assert quality_cost("int4", "local-sgd:32") < quality_cost("int8", "local-sgd:64")
    assert TrainSpec(task="builtin:mnist1d-mlp").speed_bound == SPEED_BOUND


def test_the_runtime_switches_within_the_planners_menu() -> None:
    planner = set(candidates("auto", "auto", hetero=True, sparse=True))
    runtime = candidates("auto", "auto", switchable=True)
    assert runtime and set(runtime) < planner
    assert {parse_sync(s).kind for _, s in runtime} == {
        SyncKind.EVERY_STEP,
        SyncKind.LOCAL_SGD,
        SyncKind.STREAMING,
    }
    # a fixed value stays fixed in both
    assert {c for c, _ in candidates("int4", "auto")} == {"int4"}
    assert {s for _, s in candidates("auto", "local-sgd:8")} == {"local-sgd:8"}
    assert candidates("none", "every-step") == [("none", "every-step")]


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


def test_local_data_costs_the_modes_that_drift_more() -> None:
    for sync in ("every-step", "stale:1"):
        assert sync_cost(sync, local_data=True) == sync_cost(sync)
    costs = {s: sync_cost(s, True) - sync_cost(s) for s in ("local-sgd:16", "gossip:16",
             "async-ps:4", "streaming:16:f4")}  # fmt: skip
    assert 0 < costs["local-sgd:16"] < costs["async-ps:4"] < costs["gossip:16"]
    assert costs["gossip:16"] < costs["streaming:16:f4"]  # fragments named
    # streaming's default there is one fragment: it costs what one fragment costs
    assert sync_cost("streaming:16", True) == sync_cost("streaming:16:f1:d3", True)
    assert sync_cost("streaming:16", True) < sync_cost("streaming:16:f4", True)
    assert quality_cost("int8", "local-sgd:16", local_data=True) > quality_cost(
        "int8", "local-sgd:16"
    )


def test_the_modes_auto_calls_resilient_are_those_the_runtime_regroups() -> None:
    from training.sync import regroups

    for value in DOCUMENTED_SYNCS:
        sync = parse_sync(value)
        if not sync.is_auto:
            assert (sync.kind in SURVIVES_LOSS) == regroups(sync), value
    # of equal quality cost within the slack, a resilient mode first
    assert resilience("local-sgd:32") == resilience("partial:16") == resilience("gossip:8") == 0
    assert resilience("async-ps:4") == 0
    assert resilience("every-step") < resilience("stale:1")
