"""bench.emulation's verdict: the gap is emulated over testbed wall time, judged at 15 %."""

from __future__ import annotations

from bench.emulation import Pair, table


def _pair(testbed: float, emulated: float) -> Pair:
    return Pair("(e) cpn DiLoCo int8", "local-sgd:32", "int8", testbed, emulated, 80, 78, 238, 230)


def test_gap_and_verdict() -> None:
    assert _pair(100.0, 114.0).within
    assert not _pair(100.0, 116.0).within
    assert not _pair(100.0, 84.0).within
    assert abs(_pair(200.0, 150.0).gap + 0.25) < 1e-9
    assert _pair(170.0, 160.0).testbed_wait_s == 90.0


def test_table_counts_rows_within() -> None:
    md = table([_pair(100, 110), _pair(100, 130)], 25.0, "cmd", "meta")
    assert "1 of 2 rows within 15%" in md
    assert "| +30 % | **no** |" in md
