"""The hold for faster GPUs (`scheduler.waiting`): when waiting for GPUs a running job hands
back finishes a job sooner than the plan it could take now, and when it does not."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler import (
    Assignment,
    Estimate,
    Plan,
    QoS,
    RunningJob,
    Snapshot,
    plan,
    soonest_wait,
)
from tests.scheduler.builders import cluster, job, link

NOW = 1_000_000.0


def network(ends_in_s: float | None) -> Snapshot:
    """`fast`: 8 H100s, all held by one job ending in `ends_in_s`; `slow`: 8 free T4s."""
    ends = None if ends_in_s is None else NOW + ends_in_s
    busy = RunningJob("busy", (Assignment("fast", 8),), ends_at_s=ends)
    return Snapshot(
        clusters=(
            cluster("fast", gpus=0, gpu_model="H100"),
            cluster("slow", gpus=8, gpu_model="T4"),
        ),
        running=(busy,),
    )


def run_now(snapshot: Snapshot, gpus: int = 8) -> Estimate:
    result = plan(snapshot, job(gpus), "time")
    assert isinstance(result, Plan), result
    assert result.placement == (Assignment("slow", gpus),)
    return result.estimate


def taking(seconds: float) -> Estimate:
    """A plan now that runs the job for `seconds`."""
    return replace(run_now(network(None)), total_time_s=seconds)


def test_a_job_waits_for_fast_gpus_handed_back_soon() -> None:
    snapshot = network(ends_in_s=60.0)
    now = run_now(snapshot)
    wait = soonest_wait(snapshot, job(8), NOW)
    assert wait is not None
    assert (wait.cluster, wait.gpus, wait.at_s) == ("fast", 8, NOW + 60.0)
    # an H100 is ~15x a T4: a minute's wait and the H100s' run beat the T4s' run by far
    assert wait.finish_s - NOW < 0.25 * now.total_time_s
    assert wait.beats(NOW, now)
    assert wait.beats(NOW)  # beats any plan now, without planning


def test_a_job_takes_what_is_free_when_the_fast_gpus_come_back_too_late() -> None:
    snapshot = network(ends_in_s=None)
    now = run_now(snapshot)
    late = network(ends_in_s=now.total_time_s)  # back only when the T4s would be done
    wait = soonest_wait(late, job(8), NOW)
    assert wait is not None and not wait.beats(NOW, now) and not wait.beats(NOW)


@pytest.mark.parametrize("ends_in_s", [None, -1.0], ids=["unknown", "already-past"])
def test_no_wait_on_an_end_nobody_knows(ends_in_s: float | None) -> None:
    """An end already past was a wrong estimate: nothing says when those GPUs come back."""
    assert soonest_wait(network(ends_in_s), job(8), NOW) is None


def test_the_margin_keeps_a_job_from_waiting_for_a_small_gain() -> None:
    snapshot = network(ends_in_s=60.0)
    wait = soonest_wait(snapshot, job(8), NOW)
    assert wait is not None
    took = wait.finish_s - NOW
    assert wait.beats(NOW, taking(took / 0.79))  # 21 % sooner: waits
    assert not wait.beats(NOW, taking(took / 0.81))  # 19 % sooner: goes now
    assert wait.beats(NOW, taking(took / 0.95), margin=0.0)


def test_a_wait_keeps_to_the_deadline_regions_and_data() -> None:
    snapshot = network(ends_in_s=600.0)
    assert soonest_wait(snapshot, job(8, qos=QoS(deadline_s=300.0)), NOW) is None
    assert soonest_wait(snapshot, job(8, qos=QoS(regions=("eu",))), NOW) is None
    assert soonest_wait(snapshot, job(8, data_clusters=("slow",)), NOW) is None
    assert soonest_wait(snapshot, job(8, qos=QoS(regions=("us",))), NOW) is not None


@pytest.mark.parametrize(("fast_price", "waits"), [(2.0, True), (40.0, False)])
def test_a_job_with_a_deadline_waits_only_when_that_costs_no_more(
    fast_price: float, waits: bool
) -> None:
    """Placed for the cheapest plan that meets its deadline, it waits for the H100s when they
    are sooner and cost no more than the T4s free now (the same 2 $/h: ~15x less per FLOP),
    not when they cost more (40 $/h: more per FLOP), though they would finish it sooner (held
    for them, it was held again each time they came back, the planner choosing the T4s)."""
    busy = RunningJob("busy", (Assignment("fast", 8),), ends_at_s=NOW + 60.0)
    snapshot = Snapshot(
        clusters=(
            cluster("fast", gpus=0, gpu_model="H100", price_per_gpu_hour=fast_price),
            cluster("slow", gpus=8, gpu_model="T4", price_per_gpu_hour=2.0),
        ),
        running=(busy,),
    )
    request = job(8, qos=QoS(deadline_s=36_000.0))
    now = plan(snapshot, request, "cost-within-deadline")
    assert isinstance(now, Plan) and now.placement == (Assignment("slow", 8),)
    wait = soonest_wait(snapshot, request, NOW)
    assert wait is not None and wait.frugal and wait.cluster == "fast"
    assert wait.finish_s - NOW < 0.8 * now.estimate.total_time_s  # sooner either way
    assert wait.beats(NOW, now.estimate) is waits
    assert (wait.cost <= now.estimate.cost) is waits
    assert not wait.beats(NOW)  # never held without planning: no bound on the cost now
    no_deadline = soonest_wait(snapshot, job(8), NOW)
    assert no_deadline is not None and not no_deadline.frugal
    assert no_deadline.beats(NOW, now.estimate)


def test_a_cluster_that_can_take_the_job_now_is_not_waited_for() -> None:
    """Free room is the planner's to use now; a wait is only for GPUs still held."""
    snapshot = Snapshot(
        clusters=(
            cluster("fast", gpus=4, gpu_model="H100"),
            cluster("slow", gpus=8, gpu_model="T4"),
        ),
        running=(RunningJob("busy", (Assignment("fast", 4),), ends_at_s=NOW + 60.0),),
    )
    assert soonest_wait(snapshot, job(4), NOW) is None
    wait = soonest_wait(snapshot, job(8), NOW)  # 4 free + 4 back in a minute
    assert wait is not None and (wait.cluster, wait.at_s) == ("fast", NOW + 60.0)


def test_the_gpus_come_back_when_enough_jobs_have_ended() -> None:
    snapshot = Snapshot(
        clusters=(
            cluster("fast", gpus=0, gpu_model="H100"),
            cluster("slow", gpus=8, gpu_model="T4"),
        ),
        running=(
            RunningJob("a", (Assignment("fast", 2),), ends_at_s=NOW + 10.0),
            RunningJob("b", (Assignment("fast", 4),), ends_at_s=NOW + 300.0),
            RunningJob("c", (Assignment("fast", 2),), ends_at_s=NOW + 20.0),
        ),
    )
    assert soonest_wait(snapshot, job(2), NOW).at_s == NOW + 10.0  # type: ignore[union-attr]
    assert soonest_wait(snapshot, job(4), NOW).at_s == NOW + 20.0  # type: ignore[union-attr]
    assert soonest_wait(snapshot, job(8), NOW).at_s == NOW + 300.0  # type: ignore[union-attr]


def test_the_releases_kept_through_placements_are_those_counted_afresh() -> None:
    """`Snapshot.with_free` joins a placed runner's end to the releases it had (a reconcile
    pass places thousands); a release of runners counts them afresh."""
    base = network(ends_in_s=60.0)
    assert base.releases == {"fast": ((NOW + 60.0, 8),)}
    placed = RunningJob("new", (Assignment("slow", 3),), ends_at_s=NOW + 5.0)
    unknown = RunningJob("blind", (Assignment("slow", 1),))
    after = base.with_free({"slow": -3}, (*base.running, placed))
    after = after.with_free({"slow": -1}, (*after.running, unknown))
    fresh = Snapshot(clusters=after.clusters, running=after.running)
    assert (
        after.releases
        == fresh.releases
        == {
            "fast": ((NOW + 60.0, 8),),
            "slow": ((NOW + 5.0, 3),),
        }
    )
    gone = after.with_free({"fast": 8}, after.running[1:])
    assert gone.releases == {"slow": ((NOW + 5.0, 3),)}


def test_a_wait_is_pending_until_its_gpus_are_due_or_back() -> None:
    """What the loop skips a waiting job by, without weighing it again."""
    snapshot = network(ends_in_s=60.0)
    wait = soonest_wait(snapshot, job(8), NOW)
    assert wait is not None and wait.pending(snapshot, NOW)
    assert not wait.pending(snapshot, NOW + 60.0)  # due
    back = snapshot.with_free({"fast": 8}, ())  # the runner ended early
    assert not wait.pending(back, NOW + 1.0)


def test_a_wait_for_wan_rate_is_pending_until_due_or_its_holders_end() -> None:
    """A wait for the rate runners hold on ports (`bandwidth_wait`) is not over when GPUs
    free up elsewhere, only when it is due or every runner it waits for has ended."""
    from scheduler import Wait

    snapshot = network(ends_in_s=60.0)
    wait = Wait("a", 0, NOW + 60.0, NOW + 90.0, 1.0, False, 0.0, holders=("busy",))
    assert wait.pending(snapshot, NOW)
    assert wait.pending(snapshot.with_free({"slow": -8}, snapshot.running), NOW)
    assert not wait.pending(snapshot, NOW + 60.0)  # due
    assert not wait.pending(snapshot.with_free({"fast": 8}, ()), NOW + 1.0)  # ended early


@pytest.mark.parametrize("calibrated", [False, True], ids=["indexed", "calibrated"])
@pytest.mark.parametrize(("gpus", "most"), [(1, 1), (1, 16), (3, 3), (3, 16), (8, 8), (8, 16)])
def test_no_plan_now_runs_the_job_faster_than_the_floor(
    gpus: int, most: int, calibrated: bool
) -> None:
    """`Wait.floor_s` bounds every plan now, so a wait that beats it may skip planning. (It
    was one cluster's run on the job's fewest GPUs: 641 s for a job of 1-16 GPUs that a plan
    now ran in 122 s.) Read off the snapshot's rank index, or, with calibrated efficiency
    factors (the model's own rates), by a scan: the same bound."""
    snapshot = Snapshot(
        clusters=(
            cluster("fast", gpus=0, gpu_model="H100"),
            cluster("a100", gpus=4, gpu_model="A100", price_per_gpu_hour=1.5),
            cluster("l4", gpus=6, gpu_model="L4", price_per_gpu_hour=0.6),
            cluster("slow", gpus=8, gpu_model="T4", price_per_gpu_hour=0.4),
        ),
        links=(link("a100", "l4"), link("a100", "slow"), link("l4", "slow")),
        running=(RunningJob("busy", (Assignment("fast", 8),), ends_at_s=NOW + 60.0),),
    )
    request = job(gpus, max_gpus=most)
    efficiency = {"no-such-cluster": 1.0} if calibrated else None  # the builders' own 0.5
    wait = soonest_wait(snapshot, request, NOW, efficiency)
    assert wait is not None
    indexed = soonest_wait(snapshot, request, NOW)
    assert indexed is not None and wait.floor_s == pytest.approx(indexed.floor_s)
    result = plan(snapshot, request, "time", efficiency=efficiency)
    assert isinstance(result, Plan), result
    assert wait.floor_s <= result.estimate.total_time_s
    assert wait.floor_s > 0.5 * result.estimate.total_time_s  # worth having: within 2x here
