"""On local (label-skewed) data streaming sends the whole model as one fragment unless the
fragments are named: fragments synced at staggered steps ended 8-13 points below
synchronous training there, one fragment 3.3 (bench/results/local-data.md). One reading of
a sync value on local data for every layer: the grammar, a job's spec, a run's spec, and the
menu `auto` picks from (the planner's and the runtime's)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from grammar import SyncKind, parse_sync
from grammar.auto import adaptable, candidates
from scheduler import CostModel, Snapshot
from scheduler.optimizer import _Search
from tests.scheduler.builders import cluster, job, link
from training import TrainSpec
from wire.spec import JobSpec

LOCAL = {"residency": "local", "clusters": ["a", "b"]}


@pytest.mark.parametrize(
    ("text", "shared", "local"),
    [
        ("streaming:16", "streaming:16:f4:d3", "streaming:16:f1:d3"),
        ("streaming:32:d2", "streaming:32:f4:d2", "streaming:32:f1:d2"),
        ("streaming:2", "streaming:2:f2:d0", "streaming:2:f1:d0"),
        ("streaming:16:f4", "streaming:16:f4:d3", "streaming:16:f4:d3"),  # named: kept
        ("local-sgd:8", "local-sgd:8", "local-sgd:8"),
    ],
)
def test_streaming_on_local_data_is_one_fragment_unless_named(
    text: str, shared: str, local: str
) -> None:
    assert str(parse_sync(text)) == shared
    assert str(parse_sync(text, local_data=True)) == local
    spec = {"name": "j", "task": "builtin:mnist1d-mlp", "gpus": 2, "steps": 10, "sync": text}
    assert JobSpec.model_validate(spec).sync == shared
    assert JobSpec.model_validate({**spec, "data": LOCAL}).sync == local
    assert str(TrainSpec(sync=text).sync) == shared
    assert str(TrainSpec(sync=text, data="local").sync) == local


def test_one_fragment_waits_as_the_first_of_four_would() -> None:
    """H/F - 1 steps of delay with F = 1 would leave one step of progress a period (the rest
    is dropped when the sum lands): one fragment keeps the delay four would have."""
    assert parse_sync("streaming:16:f1").delay == 3
    assert parse_sync("streaming:64:f1").delay == 15
    assert parse_sync("streaming:16:f2").delay == 7  # named fragments: H/F - 1 as before


def test_a_stored_spec_keeps_its_sync_and_a_bad_one_names_the_field() -> None:
    stored = {"name": "j", "task": "builtin:mnist1d-mlp", "gpus": 2, "steps": 10}
    kept = {**stored, "sync": "streaming:16:f4:d3", "data": LOCAL}
    assert JobSpec.model_validate(kept, context={"stored": True}).sync == "streaming:16:f4:d3"
    with pytest.raises(ValueError, match="sync"):
        JobSpec.model_validate({**stored, "sync": "streaming:0", "data": LOCAL})


def test_auto_weighs_streaming_on_local_data_as_one_fragment() -> None:
    """The menu the planner and the runtime pick from holds streaming as one fragment on local
    data (of the same period and delay), and the runtime may still re-decide from a plan
    that picked one."""
    for switchable in (False, True):
        menu = candidates("auto", "auto", switchable=switchable, local_data=True)
        streams = [parse_sync(s) for _, s in menu if s.startswith("streaming")]
        assert streams and all(s.fragments == 1 for s in streams)
        shared = candidates("auto", "auto", switchable=switchable)
        assert {(s.period, s.delay) for s in streams} == {
            (parse_sync(s).period, parse_sync(s).delay)
            for _, s in shared
            if s.startswith("streaming")
        }
    planned = next(p for p in candidates("auto", "auto", local_data=True) if "streaming" in p[1])
    assert adaptable("auto", "auto", *planned, local_data=True) == ("sync", "compression")
    assert adaptable("auto", "auto", *planned) == ()  # not a shared-data menu entry
    snap = Snapshot((cluster("a", 8), cluster("b", 8)), (link("a", "b"),))
    j = replace(job(16, sync="auto", compression="auto"), data_clusters=("a", "b"))
    search = _Search(CostModel(snap, j), j, "time", 1, 16)
    syncs = [parse_sync(s) for _, s in search.combos(("a", "b"))]
    assert {s.fragments for s in syncs if s.kind is SyncKind.STREAMING} == {1}
