"""bench.collectives' planner side: the pick and the estimates its table prints."""

from __future__ import annotations

import pytest

from bench.collectives import REGIMES, _estimates, links_of


@pytest.mark.parametrize(
    ("regime", "pick"), list(zip(REGIMES, ("ring", "hub", "hub", "hub"), strict=True))
)
def test_the_planner_picks_the_collective_its_estimates_favour(
    regime: tuple[str, float, float, float | None], pick: str
) -> None:
    _, mbps, rtt, spokes = regime
    got, est, ring, trees = _estimates(links_of(mbps, rtt, spokes), rtt, 23_050)
    assert got == pick and min(est, key=est.__getitem__) == pick
    assert sorted(ring) == ["a", "b", "c", "d"]
    assert set(trees["hub"].values()) == {"a"} and len(trees["hub"]) == 3
