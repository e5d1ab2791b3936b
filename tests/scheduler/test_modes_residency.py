"""Issue 17 in the control plane: a local-data job names where its data lives and is placed
only there; the planner has a model of each new sync mode."""

from __future__ import annotations

from dataclasses import replace

import pytest
from pydantic import ValidationError

from controller.jobs.request import job_request
from grammar.states import ClusterState
from scheduler import Infeasible, Plan, Snapshot, exclusions, plan, sync_model
from tests.scheduler.builders import cluster, job, link
from wire.spec import JobSpec

A, B, C = cluster("a", 8), cluster("b", 8), cluster("c", 8)
SNAP = Snapshot((A, B, C), (link("a", "b"), link("b", "c"), link("a", "c")))


def test_a_local_data_job_is_placed_only_where_its_data_lives() -> None:
    j = job(16, data_clusters=("b", "c"))
    result = plan(SNAP, j, "time")
    assert isinstance(result, Plan)
    assert {a.cluster for a in result.placement} <= {"b", "c"}
    assert exclusions(SNAP, j)["a"] == "does not hold the job's data (data: local)"
    too_big = plan(SNAP, job(24, data_clusters=("b", "c")), "time")
    assert isinstance(too_big, Infeasible)
    assert isinstance(plan(SNAP, job(24), "time"), Plan)  # shared data: anywhere


def _spec(**values: object) -> JobSpec:
    return JobSpec.model_validate(
        {"name": "j", "task": "builtin:mnist1d-mlp", "gpus": 2, "steps": 10, **values}
    )


def test_job_spec_data_field_reaches_the_scheduler() -> None:
    assert job_request(_spec(), "t").data_clusters is None
    local = _spec(data={"residency": "local", "clusters": ["b"]}, sync="partial:4")
    assert local.sync == "partial:4"
    assert job_request(local, "t").data_clusters == ("b",)
    shared = _spec(data={"residency": "shared", "clusters": ["b"]})
    assert job_request(shared, "t").data_clusters is None
    with pytest.raises(ValidationError, match=r"data\.clusters: a local-data job must name"):
        _spec(data={"residency": "local"})
    with pytest.raises(ValidationError):
        _spec(data={"residency": "elsewhere", "clusters": ["b"]})


@pytest.mark.parametrize(
    ("value", "kind", "period"),
    [("partial:4", "local-sgd", 4), ("gossip:2", "local-sgd", 2), ("async-ps:2", "async-ps", 1)],
)
def test_the_planner_models_each_new_mode(value: str, kind: str, period: int) -> None:
    model = sync_model(value)
    assert model.spec == value and model.kind == kind and model.period == period
    assert model.steps_factor > 1.0  # each costs a little quality against every-step
    r = plan(SNAP, replace(job(16), sync=value), "time")
    assert isinstance(r, Plan) and r.estimate.total_time_s > 0


def test_local_data_trains_on_every_cluster_that_holds_it() -> None:
    """Issue 47: a share of the data left on a cluster the job does not run on is never
    trained on; so every data cluster takes part, or the plan says which one cannot."""
    small = job(2, data_clusters=("a", "b"), flops_per_step=1e12)  # one cluster would do
    got = plan(SNAP, small, "time")
    assert isinstance(got, Plan) and {a.cluster for a in got.placement} == {"a", "b"}
    down = Snapshot((A, replace(B, state=ClusterState.DOWN), C), SNAP.links)
    waiting = plan(down, small, "time")
    assert isinstance(waiting, Infeasible) and waiting.constraint == "data"
    assert "'b'" in waiting.reason and "DOWN" in waiting.reason
    too_few = plan(SNAP, job(1, data_clusters=("a", "b")), "time")
    assert isinstance(too_few, Infeasible) and "data.clusters" in too_few.reason
    from scheduler import Assignment, evaluate

    half = evaluate(SNAP, small, (Assignment("a", 2),))
    assert isinstance(half, Infeasible) and half.constraint == "data" and "b" in half.reason
