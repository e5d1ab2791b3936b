"""bench.collectives' planner side: the pick and the estimates its table prints."""

from __future__ import annotations

import pytest

from bench.collectives import REGIMES, _estimates


@pytest.mark.parametrize(("regime", "pick"), [(REGIMES[0], "ring"), (REGIMES[1], "tree")])
def test_the_planner_picks_the_collective_its_estimates_favour(
    regime: tuple[str, float, float], pick: str
) -> None:
    _, mbps, rtt = regime
    got, est = _estimates(mbps, rtt, 23_050)
    assert got == pick and min(est, key=est.__getitem__) == pick
