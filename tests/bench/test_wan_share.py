"""The shared-uplink testbed benchmark's pure parts: what it reads off a run's reports."""

from __future__ import annotations

import pytest

from bench.wan_share import measured, rates


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
