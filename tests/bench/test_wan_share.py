"""The shared-uplink testbed benchmark's pure parts: what it reads off a run's reports."""

from __future__ import annotations

import argparse

import pytest

from bench.wan_share import CASE, measured, plan_all, promises, rates


def _report(wall: float, step: int, sent: int) -> dict[str, object]:
    return {"wall_s": wall, "step": step, "wan_bytes": {"a->b": sent, "b->a": 7}}


def test_the_rate_and_step_leave_out_the_first_segment_and_the_final_checkpoint() -> None:
    reports = [_report(5.0, 4, 1_000_000), _report(7.0, 8, 2_000_000), _report(9.0, 12, 3_000_000)]
    reports.append(_report(30.0, 16, 3_000_000))  # the end: a checkpoint, nothing sent
    rate, step = measured(reports, "a->b")
    assert rate == pytest.approx(8 * 2_000_000 / 4.0 / 1e6)  # 4 Mbit/s between 5 s and 9 s
    assert step == pytest.approx(0.5)
    assert measured(reports[:2], "a->b") == (None, None)  # too few reports to say


def test_the_series_is_each_segments_rate() -> None:
    reports = [_report(1.0, 4, 0), _report(3.0, 8, 500_000), _report(3.0, 8, 500_000)]
    (start, rate), *more = rates(reports, "a->b")
    assert not more and start == 3.0 and rate == pytest.approx(2.0)  # a zero-length gap skipped


def test_a_job_waiting_for_the_rate_is_placed_once_its_holder_ends() -> None:
    """The bench's control plane (SQLite, no Ray, no testbed): with J1 holding most of a's
    uplink J2 waits for it (slow compute would not: a WAN-heavy regime); once J1's run ended
    J2 is placed on a and c, and its promise is set against when its run was seen to end."""
    args = argparse.Namespace(
        mbit=100.0,
        task="builtin:wide-mlp",
        compression="none",
        sync="local-sgd:4",
        steps=64,
        eval_every=4,
        job_share=0.5,
    )
    planned, board = plan_all("cpn", args, {"T4": 0.05}, {})
    try:
        j1, j2, _ = planned
        assert j1.placed == {"a": 1, "b": 1} and j1.train is not None
        assert not j2.placed and j2.train is None
        assert j2.reason.startswith("waiting: for the WAN rate 1 running job(s) hold")
        assert j2.waits_for == [board.ids["J1"]]
        assert j1.total_s is not None and j2.promised_done_s is not None
        assert j2.promised_done_s > j1.total_s  # done after J1's run, then its own
        board.place({"T4": 0.05})  # J1 still runs: J2 still waits, not planned again
        assert not board.planned(CASE["J2"]).placed
        board.end("J1")
        board.place({"T4": 0.05})
        then = board.planned(CASE["J2"])
        assert then.placed == {"a": 1, "c": 1} and then.train is not None
    finally:
        board.close()
    [kept] = promises([j2], {"J2": {"ended_at": j2.submitted_at + 90.0}})
    assert kept["done_s"] == pytest.approx(90.0) and kept["promised_done_s"] == j2.promised_done_s
