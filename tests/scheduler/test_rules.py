"""One test per rule; each fails if the planner stops applying that rule."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest

from scheduler import (
    POOLED,
    Assignment,
    Infeasible,
    Observation,
    Plan,
    QoS,
    QueuedJob,
    RunningJob,
    Snapshot,
    calibrate,
    evaluate,
    order_queue,
    plan,
    reference_run_s,
)
from tests.scheduler.builders import cluster, job, link


def _names(p: Plan) -> set[str]:
    return {a.cluster for a in p.placement}


def _feasible(r: object) -> Plan:
    assert isinstance(r, Plan), r
    return r


# fast and dear vs slow and cheap, one cluster each
FAST_DEAR = cluster("fast", 8, gpu_model="H100", price_per_gpu_hour=10.0)
SLOW_CHEAP = cluster("slow", 8, gpu_model="L4", price_per_gpu_hour=0.5)
TWO = Snapshot((FAST_DEAR, SLOW_CHEAP))


def test_objectives_pick_different_clusters() -> None:
    j = job(8, steps=1000)
    assert _names(_feasible(plan(TWO, j, "time"))) == {"fast"}
    assert _names(_feasible(plan(TWO, j, "cost"))) == {"slow"}


def test_deadline_forces_the_faster_dearer_plan() -> None:
    cheap = _feasible(plan(TWO, job(8, steps=1000), "cost"))
    fast = _feasible(plan(TWO, job(8, steps=1000), "time"))
    deadline = (cheap.estimate.total_time_s + fast.estimate.total_time_s) / 2
    j = job(8, steps=1000, qos=QoS(deadline_s=deadline))
    for objective in ("cost", "cost-within-deadline"):
        p = _feasible(plan(TWO, j, objective))
        assert _names(p) == {"fast"}
        assert p.estimate.total_time_s <= deadline
    tight = job(8, steps=1000, qos=QoS(deadline_s=fast.estimate.total_time_s * 0.9))
    r = plan(TWO, tight, "time")
    assert isinstance(r, Infeasible) and r.constraint == "deadline"
    assert r.closest is not None and _names(r.closest) == {"fast"}


def test_cost_within_deadline_needs_a_deadline() -> None:
    with pytest.raises(ValueError, match="deadline_s"):
        plan(TWO, job(8), "cost-within-deadline")


def test_budget_forces_the_cheaper_slower_plan() -> None:
    cheap = _feasible(plan(TWO, job(8, steps=1000), "cost"))
    fast = _feasible(plan(TWO, job(8, steps=1000), "time"))
    budget = (cheap.estimate.cost + fast.estimate.cost) / 2
    p = _feasible(plan(TWO, job(8, steps=1000, qos=QoS(max_cost=budget)), "time"))
    assert _names(p) == {"slow"} and p.estimate.cost <= budget
    r = plan(TWO, job(8, steps=1000, qos=QoS(max_cost=cheap.estimate.cost * 0.5)), "time")
    assert isinstance(r, Infeasible) and r.constraint == "budget"


def test_regions_keep_data_resident() -> None:
    snap = Snapshot((replace(FAST_DEAR, region="us"), replace(SLOW_CHEAP, region="eu")))
    p = _feasible(plan(snap, job(8, qos=QoS(regions=("eu",))), "time"))
    assert _names(p) == {"slow"}
    r = plan(snap, job(16, qos=QoS(regions=("eu",))), "time")
    assert isinstance(r, Infeasible) and r.constraint == "regions"
    bad = evaluate(snap, job(8, qos=QoS(regions=("eu",))), [Assignment("fast", 8)])
    assert isinstance(bad, Infeasible) and bad.constraint == "regions"


def test_max_clusters() -> None:
    snap = Snapshot(
        (cluster("a", 8), cluster("b", 8), cluster("big", 16, gpu_model="A100")),
        (link("a", "b", gbps=100.0, rtt_ms=1.0), link("a", "big", 1.0), link("b", "big", 1.0)),
    )
    assert len(_feasible(plan(snap, job(16), "time")).placement) >= 2
    p = _feasible(plan(snap, job(16, qos=QoS(max_clusters=1)), "time"))
    assert _names(p) == {"big"}
    r = plan(snap, job(24, qos=QoS(max_clusters=1)), "time")
    assert isinstance(r, Infeasible) and r.constraint == "max_clusters"


@pytest.mark.parametrize("change", [{"cordoned": True}, {"state": "DOWN"}])
def test_cordoned_and_down_clusters_are_excluded(change: dict[str, object]) -> None:
    best = cluster("best", 8, gpu_model="H100")
    other = cluster("other", 8, gpu_model="A100")
    assert _names(_feasible(plan(Snapshot((best, other)), job(8), "time"))) == {"best"}
    snap = Snapshot((replace(best, **change), other))  # type: ignore[arg-type]
    p = _feasible(plan(snap, job(8), "time"))
    assert _names(p) == {"other"}
    assert any("excluded best" in line for line in p.explanation)
    assert isinstance(evaluate(snap, job(8), [Assignment("best", 8)]), Infeasible)


def test_suspect_clusters_stay_usable() -> None:
    snap = Snapshot((cluster("a", 8, state="SUSPECT"),))
    assert _names(_feasible(plan(snap, job(8), "time"))) == {"a"}


def test_gang_is_all_or_nothing() -> None:
    snap = Snapshot((cluster("a", 7),))
    r = plan(snap, job(8), "time")
    assert isinstance(r, Infeasible) and r.constraint == "capacity"
    bad = evaluate(Snapshot((cluster("a", 8),)), job(8), [Assignment("a", 6)])
    assert isinstance(bad, Infeasible) and bad.constraint == "gpus"


def test_unlinked_clusters_cannot_share_a_job() -> None:
    snap = Snapshot((cluster("a", 4), cluster("b", 4)))
    r = plan(snap, job(8), "time")
    assert isinstance(r, Infeasible) and r.constraint == "links"
    linked = Snapshot(snap.clusters, (link("a", "b"),))
    assert _names(_feasible(plan(linked, job(8), "time"))) == {"a", "b"}


def test_elastic_range() -> None:
    elastic = job(4, max_gpus=8)
    six = _feasible(plan(Snapshot((cluster("a", 6),)), elastic, "time"))
    assert six.gpus == 6
    many = _feasible(plan(Snapshot((cluster("a", 16),)), elastic, "time"))
    assert 4 <= many.gpus <= 8
    assert many.gpus == 8  # compute-bound job: more GPUs are faster
    r = plan(Snapshot((cluster("a", 3),)), elastic, "time")
    assert isinstance(r, Infeasible) and r.constraint == "capacity"
    over = evaluate(Snapshot((cluster("a", 16),)), elastic, [Assignment("a", 9)])
    assert isinstance(over, Infeasible) and over.constraint == "gpus"


def test_quota() -> None:
    busy = RunningJob("old", (Assignment("a", 4),), tenant="t1")
    snap = Snapshot((cluster("a", 16),), running=(busy,), quotas=(("t1", 8),))
    r = plan(snap, job(8, tenant="t1"), "time")
    assert isinstance(r, Infeasible) and r.constraint == "quota"
    p = _feasible(plan(snap, job(2, max_gpus=8, tenant="t1"), "time"))
    assert p.gpus == 4  # what is left of the quota
    assert _feasible(plan(snap, job(8, tenant="t2"), "time")).gpus == 8
    bad = evaluate(snap, job(8, tenant="t1"), [Assignment("a", 8)])
    assert isinstance(bad, Infeasible) and bad.constraint == "quota"


def test_preemption_fewest_then_cheapest_victims() -> None:
    running = (
        RunningJob(
            "small-dear", (Assignment("a", 4),), priority=0, preemptible=True, preemption_cost=10.0
        ),
        RunningJob(
            "small-cheap", (Assignment("a", 4),), priority=0, preemptible=True, preemption_cost=1.0
        ),
        RunningJob(
            "big", (Assignment("b", 8),), priority=0, preemptible=True, preemption_cost=50.0
        ),
        RunningJob(
            "big-cheap", (Assignment("c", 8),), priority=0, preemptible=True, preemption_cost=20.0
        ),
        RunningJob(
            "pinned", (Assignment("d", 8),), priority=0, preemptible=False, preemption_cost=0.0
        ),
        RunningJob("vip", (Assignment("e", 8),), priority=9, preemptible=True, preemption_cost=0.0),
    )
    snap = Snapshot(tuple(cluster(n, 0) for n in "abcde"), running=running)
    urgent = job(8, qos=QoS(priority=5))
    p = _feasible(plan(snap, urgent, "time"))
    # one 8-GPU victim beats two 4-GPU ones; of the two single victims the cheaper one
    assert p.victims == ("big-cheap",)
    assert _names(p) == {"c"}
    # 12 GPUs need two victims; the cheapest pair that frees 12 GPUs on linked clusters is
    # small-cheap + big-cheap (4 on a + 8 on c, cost 21), not the cheaper 4+4 pair on a (8 GPUs)
    linked = replace(snap, links=(link("a", "c"), link("b", "c"), link("a", "b")))
    p12 = _feasible(plan(linked, job(12, qos=QoS(priority=5)), "time"))
    assert set(p12.victims) == {"small-cheap", "big-cheap"}
    # equal priority cannot preempt; non-preemptible and higher-priority jobs never are
    r = plan(snap, job(8, qos=QoS(priority=0)), "time")
    assert isinstance(r, Infeasible) and r.constraint == "capacity"
    assert not any(v in ("pinned", "vip") for v in p.victims + p12.victims)


def test_a_job_short_of_bandwidth_preempts_only_jobs_holding_wan() -> None:
    """a and b each have 4 GPUs free but no path between them (their ports are full): an
    8-GPU job must cross it. It may preempt the lower-priority job holding a WAN rate (the
    caller's `release` gives the path back), never one holding GPUs alone; without a caller
    that knows the ports nothing comes back and it waits."""
    wan = RunningJob(
        "on-the-wan", (Assignment("a", 1), Assignment("b", 1)), priority=0, preemptible=True,
        wan_kbps=(("a", 900_000), ("b", 900_000)),
    )  # fmt: skip
    local = RunningJob("local", (Assignment("c", 8),), priority=0, preemptible=True)
    snap = Snapshot((cluster("a", 4), cluster("b", 4), cluster("c", 0)), running=(wan, local))
    urgent = job(8, qos=QoS(priority=5))
    alone = plan(snap, urgent, "time")
    assert isinstance(alone, Infeasible) and alone.constraint == "links"
    freed: list[tuple[str, ...]] = []

    def release(s: Snapshot, victims: Sequence[RunningJob]) -> Snapshot:
        freed.append(tuple(v.id for v in victims))
        back = any(v.wan_kbps for v in victims)
        return replace(s, links=(link("a", "b", gbps=1.0),) if back else s.links)

    p = _feasible(plan(snap, urgent, "time", release=release))
    assert p.victims == ("on-the-wan",) and _names(p) == {"a", "b"}
    assert all("local" not in ids for ids in freed)  # it holds no rate: never tried
    r = plan(snap, job(8, qos=QoS(priority=0)), "time", release=release)
    assert isinstance(r, Infeasible) and r.constraint == "links"  # equal priority: no


def test_cluster_preference_is_tried_in_order() -> None:
    snap = Snapshot((cluster("a", 8), cluster("b", 8), cluster("c", 4)), (link("a", "c"),))
    assert _names(_feasible(plan(snap, job(8), "time"))) == {"a"}  # tie -> first by name
    assert _names(_feasible(plan(snap, job(8, preference=("b", "a")), "time"))) == {"b"}
    # "c" alone is too small; the first two preferred together are used
    p = _feasible(plan(snap, job(12, preference=("c", "a")), "time"))
    assert _names(p) == {"a", "c"}


def test_fair_share_and_quota_in_queue_order() -> None:
    q = [
        QueuedJob("a1", "alice", 4, submitted_at=1),
        QueuedJob("a2", "alice", 4, submitted_at=2),
        QueuedJob("b1", "bob", 4, submitted_at=3),
        QueuedJob("b2", "bob", 4, submitted_at=4),
        QueuedJob("urgent", "bob", 4, priority=5, submitted_at=9),
        QueuedJob("c1", "carol", 16, submitted_at=0),
    ]
    out = order_queue(q, usage={"alice": 0, "bob": 8}, quotas={"carol": 8})
    ids = [j.id for j in out.order]
    # priority first; then alice (0 in use) before bob (8 + 4 urgent), alternating by usage
    assert ids == ["urgent", "a1", "a2", "b1", "b2"]
    assert [j.id for j, _ in out.held] == ["c1"]
    # shares weight the usage: bob (share 4) holding 8 counts 2, then 3, then 4, against
    # alice's 0 then 4; without shares bob would wait for both of alice's jobs
    fair = order_queue(q[:4], usage={"bob": 8}, shares={"bob": 4.0})
    assert [j.id for j in fair.order] == ["a1", "b1", "b2", "a2"]
    plain = order_queue(q[:4], usage={"bob": 8})
    assert [j.id for j in plain.order] == ["a1", "a2", "b1", "b2"]


def test_fair_share_weighs_the_wan_a_tenant_holds_beside_its_gpus() -> None:
    """DRF over GPUs and uplinks: alice holds 10 of 100 GPUs but 8 of 10 Gbit/s of uplink
    (dominant share 0.8), bob 40 GPUs and no WAN (0.4): bob's jobs go first while his GPUs
    stay below alice's share of the WAN. Counting GPUs alone, alice would go first."""
    q = [
        QueuedJob("a1", "alice", 4, submitted_at=1),
        QueuedJob("b1", "bob", 20, submitted_at=2),
        QueuedJob("b2", "bob", 20, submitted_at=3),
    ]
    usage = {"alice": 10, "bob": 40}
    drf = order_queue(q, usage=usage, wan={"alice": 8_000_000}, totals=(100, 10_000_000))
    assert [j.id for j in drf.order] == ["b1", "b2", "a1"]  # bob 0.4, then 0.6: below 0.8
    gpus_only = order_queue(q, usage=usage)
    assert [j.id for j in gpus_only.order] == ["a1", "b1", "b2"]


def test_a_tenants_jobs_go_by_response_ratio_and_long_ones_age() -> None:
    """(waited + size) / size at `now`: short jobs pass long ones, a long one that has waited
    passes a short one just come; tenants still alternate by usage; without `now`, by
    submission."""
    q = [
        QueuedJob("long", "alice", 4, submitted_at=0, run_s=10_000),  # ratio 1.1 at 1,000
        QueuedJob("short", "alice", 4, submitted_at=900, run_s=100),  # ratio 2.0
        QueuedJob("fresh", "alice", 4, submitted_at=1_000, run_s=10),  # ratio 1.0
        QueuedJob("b", "bob", 4, submitted_at=500, run_s=1),
    ]
    ids = [j.id for j in order_queue(q, now=1_000).order]
    # both tenants hold nothing: the heads' ratios break the tie (bob's 501); then alice's
    # short job passes her long one, and the long one, having waited, passes the fresh one
    assert ids == ["b", "short", "long", "fresh"]
    assert [j.id for j in order_queue(q).order] == ["long", "b", "short", "fresh"]
    # a job of unknown size counts as an hour's
    unknown = [
        QueuedJob("u", "c", 1, submitted_at=0),
        QueuedJob("k", "c", 1, submitted_at=0, run_s=3_000),
    ]
    assert [j.id for j in order_queue(unknown, now=3_600).order] == ["k", "u"]


def test_reference_run_s_is_the_work_per_gpu_on_the_reference_model() -> None:
    base = reference_run_s(job(8))
    assert base == pytest.approx(100 * 1e15 / 8 / (312e12 * 0.4))
    assert reference_run_s(job(8, steps=1000)) == pytest.approx(10 * base)
    assert reference_run_s(job(4)) == pytest.approx(2 * base)
    # a step measured on another model counts the same work: 1 s on an H100 = 3.17 s on an A100
    timed = job(1, flops_per_step=None, step_time_s_ref=1.0, ref_gpu="H100", steps=1)
    assert reference_run_s(timed) == pytest.approx(989 / 312)


def test_calibration_recovers_efficiency_and_changes_estimates() -> None:
    # observed: A100 steps run at 30 % of peak 312 TFLOPS
    obs = [
        Observation("A100", g, f, f / (g * 312e12 * 0.3))
        for g, f in [(1, 1e14), (4, 1e15), (8, 3e15)]
    ]
    factors = calibrate(obs)
    assert factors["A100"] == pytest.approx(0.3)
    snap = Snapshot((cluster("a", 8, gpu_model="A100", efficiency=None),))
    base = _feasible(plan(snap, job(8), "time"))
    tuned = _feasible(plan(snap, job(8), "time", efficiency=factors))
    # default efficiency 0.4 -> 0.3: compute-bound step 4/3 as long
    assert tuned.estimate.compute_s == pytest.approx(base.estimate.compute_s * 0.4 / 0.3)
    # a GPU model not observed yet takes the pooled fit, not the datasheet prior
    assert factors[POOLED] == pytest.approx(0.3)
    other = Snapshot((cluster("h", 8, gpu_model="H100", efficiency=None),))
    h_base = _feasible(plan(other, job(8), "time"))
    h_tuned = _feasible(plan(other, job(8), "time", efficiency=factors))
    assert h_tuned.estimate.compute_s == pytest.approx(h_base.estimate.compute_s * 0.4 / 0.3)
    with pytest.raises(ValueError, match="observation"):
        calibrate([Observation("nope", 1, 1e12, 1.0)])


def test_a_release_frees_the_victims_gpus_and_keeps_the_link_tables() -> None:
    from scheduler.rules import release

    snap = Snapshot(
        (cluster("a", 2), cluster("b", 8), cluster("c", 4)),
        links=(link("a", "b"), link("b", "c")),
        running=(RunningJob("j1", (Assignment("a", 6), Assignment("b", 2)), "t"),),
    )
    table = snap.directed_links
    after = release(snap, snap.running)
    assert [c.gpus_free for c in after.clusters] == [8, 10, 4]
    assert after.running == ()
    assert after.clusters[2] is snap.clusters[2]  # untouched clusters are not rebuilt
    assert after.directed_links is table  # links are unchanged: not rebuilt per release
    assert after.neighbours == {"a": {"b"}, "b": {"a", "c"}, "c": {"b"}}
    assert after.by_name["a"].gpus_free == 8  # not the stale table of the old snapshot
    fresh = Snapshot(snap.clusters, links=snap.links)  # no table built yet: copies share one
    one, two = (fresh.reallocated(fresh.clusters, ()) for _ in range(2))
    assert one.directed_links is two.directed_links and one.neighbours is two.neighbours
    with pytest.raises(ValueError, match="same clusters"):
        snap.reallocated(snap.clusters[:2], ())
