"""The two decisions of datacenter fault domains, as data (`training.faults`)."""

from __future__ import annotations

import pytest

from training.faults import Agreement, Position, Recovery, agree, is_collective_error, recover
from training.runner import _follow


@pytest.mark.parametrize(
    ("live", "lost", "restarts", "stuck", "want"),
    [
        (True, {"c"}, 0, False, Recovery.SHRINK),
        (True, set(), 0, False, Recovery.REFORM),  # a slow cluster is not a dead one
        (True, {"a", "b", "c"}, 0, False, Recovery.RESTART),  # nobody left to go on
        (True, {"a", "b", "c"}, 2, False, Recovery.FAIL),
        (False, {"c"}, 0, False, Recovery.RESTART),  # the mode cannot shrink
        (False, {"c"}, 2, False, Recovery.FAIL),
        (True, set(), 0, True, Recovery.RESTART),  # re-forming did not help
    ],
)
def test_recover(live: bool, lost: set[str], restarts: int, stuck: bool, want: Recovery) -> None:
    got = recover(
        live=live,
        clusters=["a", "b", "c"],
        lost=lost,
        restarts=restarts,
        max_restarts=2,
        stuck=stuck,
    )
    assert got is want


def test_agree_keeps_equal_members_and_finishes_an_open_round() -> None:
    assert agree([Position(8), Position(8)]) == Agreement(None)
    assert agree([Position(7, True), Position(7, True)]) == Agreement(None, (), True)


def test_agree_gives_the_furthest_state_to_newcomers_and_laggards() -> None:
    assert agree([Position(12), Position(12), Position(-1), Position(-1)]) == Agreement(0, (2, 3))
    assert agree([Position(-1), Position(12), Position(13)]) == Agreement(2, (0, 1))


def test_agree_refuses_members_apart_inside_a_round() -> None:
    with pytest.raises(ValueError, match="different places"):
        agree([Position(7, True), Position(-1)])


def test_collective_errors_are_told_from_bugs() -> None:
    assert is_collective_error(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed"))
    assert not is_collective_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_collective_error(ValueError("gloo"))


def test_follow_keeps_running_clusters_and_adds_new_ones() -> None:
    assert _follow({"a": 1, "b": 2}, {"a": 1, "c": 2}) == {"a": 1, "c": 2}
    assert _follow({"a": 1, "b": 2}, {"b": 5, "a": 1}) == {"a": 1, "b": 2}
    assert _follow({"a": 1}, {"z": 1}) == {"a": 1}  # never nothing left
