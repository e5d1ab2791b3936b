"""bench.promise's comparison: planned against executed and promised against charged are
read from the job, its run's report and its ledger lines as the API gives them."""

from __future__ import annotations

from typing import Any

import pytest

from bench.promise import CASES, compare, ring_edges, summary


def _job(**over: Any) -> dict[str, Any]:
    plan = {
        "compression": "none",
        "sync": "local-sgd:8",
        "clusters": [{"cluster": "a", "gpus": 2}, {"cluster": "b", "gpus": 4}],
        "estimate": {
            "total_time_s": 30.0,
            "wan_bytes": 7_000_000,
            "ring": ["a", "b"],
            "quality_cost": 0.06,
        },
        "price": {"total": 0.15},
        "parallel": {"mode": "data"},
    }
    return {
        "held_price": plan,
        "placement": plan,
        "started_at": "2026-12-02T00:00:00+00:00",
        "finished_at": "2026-12-02T00:00:25+00:00",
        **over,
    }


REPORT = {
    "compression": "none",
    "sync": "local-sgd:8",
    "wan_bytes": {"a->b": 3_500_000, "b->a": 3_500_000},
    "final_accuracy": 0.61,
    "best_accuracy": 0.62,
}


def test_a_run_as_planned_within_its_quote() -> None:
    ledger = [{"amount": "0.100000", "kind": "gpu"}, {"amount": "0.001", "kind": "egress"}]
    row = compare("demo", _job(), REPORT, ledger)
    assert row.decisions_equal and row.held and row.credit == 0
    assert row.actual_s == 25.0 and row.time_error == 0.2
    assert row.wan_error == 0.0 and row.billed == 0.101
    assert summary([row])["held_exceeded"] == 0


def test_a_run_that_differs_from_its_plan_is_caught() -> None:
    other_sync = compare("x", _job(), {**REPORT, "sync": "local-sgd:32"}, [])
    assert not other_sync.decisions_equal
    # bytes over a link the planner's ring does not use: the ring was not the plan's
    three = _job()
    three["held_price"] = {**three["held_price"], "estimate": {
        **three["held_price"]["estimate"], "ring": ["a", "c", "b", "d"]}}  # fmt: skip
    off_ring = compare("x", three, {**REPORT, "wan_bytes": {"a->b": 1}}, [])
    assert not off_ring.decisions_equal
    assert ("a", "b") not in ring_edges(["a", "c", "b", "d"]) and ring_edges(["a"]) == set()


def test_a_credited_overrun_is_counted() -> None:
    ledger = [{"amount": "0.300000", "kind": "gpu"}, {"amount": "-0.150000", "kind": "credit"}]
    row = compare("x", _job(), REPORT, ledger)
    assert row.credit == 0.15 and row.billed == 0.15
    assert summary([row])["credits"] == 1 and summary([row])["held_exceeded"] == 0


def test_the_set_is_varied() -> None:
    assert len(CASES) >= 12
    syncs = {c.spec["sync"].split(":")[0] for c in CASES}
    assert {"auto", "every-step", "local-sgd", "stale", "partial", "async-ps", "gossip"} <= syncs
    assert any(c.held for c in CASES) and any(not c.held for c in CASES)
    assert any(c.spec.get("parallelism") == "pipeline" for c in CASES)


def test_the_wan_share_is_the_plan_s_waits_against_the_run_s() -> None:
    job = _job()
    est = {**job["held_price"]["estimate"], "step_time_s": 0.05, "compute_s": 0.03,
           "intra_s": 0.01, "step_overhead_s": 0.0}  # fmt: skip
    job["held_price"] = {**job["held_price"], "estimate": est}
    report = {**REPORT, "steps": 300, "comm_s": 6.0, "intra_s": 2.5}
    row = compare("x", job, report, [])
    assert row.est_wan_share == pytest.approx(0.01 * 300 / 30.0)  # its waits over its time
    assert row.wan_share == pytest.approx((6.0 - 2.5) / 25.0)  # the run's over its time
    assert row.wan_share_error is not None and abs(row.wan_share_error - 0.04) < 1e-9
    assert summary([row])["wan_share_within_5_points"] == 1
    # one cluster waits on no WAN: no share to compare
    one = _job()
    one["held_price"] = {**one["held_price"], "clusters": [{"cluster": "a", "gpus": 2}]}
    assert compare("x", one, report, []).wan_share_error is None
