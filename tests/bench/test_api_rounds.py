"""bench.api's summary of several rounds: each share is of the same round's bare run."""

from __future__ import annotations

import pytest

from bench.api import Result, Run, medians


def _result(target: str, writes: int, reads: int) -> Result:
    return Result(target, Run("POST", 1.0, [0.01] * writes), Run("GET", 1.0, [0.01] * reads))


def test_shares_are_of_each_rounds_own_bare_and_judged_on_the_median(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rounds = [
        [_result("bare", 1000, 1000), _result("postgres", 300, 600)],
        [_result("bare", 500, 500), _result("postgres", 200, 200)],  # the machine slowed
        [_result("bare", 800, 1000), _result("postgres", 400, 450)],
    ]
    medians(rounds)
    line = capsys.readouterr().out.strip()
    # writes 30 %, 40 %, 50 % -> median 40 %; reads 60 %, 40 %, 45 % -> median 45 %
    assert "submissions 30%, 40%, 50% of bare (median 40%: >= 1/3)" in line
    assert "reads 60%, 40%, 45% (median 45%: NOT >= 1/2)" in line
