"""The WAN's shared ports, pure: what a plan needs of them and what a path carries."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler import Assignment, Estimate
from scheduler.bandwidth import burst_slowdown, free_gbps, path_gbps, wan_need_kbps

ESTIMATE = Estimate(
    step_time_s=1.0,
    total_time_s=100.0,
    wan_bytes=10**9,  # 1 GB in 100 s over two clusters: 40 Mbit/s each
    cost=1.0,
    compute_s=0.5,
    intra_s=0.0,
    wan_s=0.5,
    overhead_s=0.0,
    effective_steps=100.0,
    gpu_cost=1.0,
    egress_cost=0.0,
)
TWO = (Assignment("a", 4), Assignment("b", 4))


def test_a_plan_needs_its_share_of_its_bytes_over_its_run_at_each_cluster() -> None:
    assert wan_need_kbps(ESTIMATE, TWO) == {"a": 40_000, "b": 40_000}
    three = (*TWO, Assignment("c", 1))
    assert wan_need_kbps(ESTIMATE, three) == dict.fromkeys("abc", 26_667)  # rounded up
    assert wan_need_kbps(ESTIMATE, (Assignment("a", 8),)) == {}
    assert wan_need_kbps(replace(ESTIMATE, wan_bytes=0), TWO) == {}
    assert wan_need_kbps(replace(ESTIMATE, wan_bytes=1), TWO) == {"a": 1, "b": 1}  # never 0


def test_over_a_tree_each_cluster_reserves_by_its_edges() -> None:
    """A hub sends a whole payload to every spoke: of 6 payloads an exchange over 4
    clusters, 3 are the hub's, 1 each spoke's; the ring's equal shares would short it."""
    four = (*TWO, Assignment("c", 1), Assignment("h", 1))
    hub = replace(ESTIMATE, tree=(("a", "h"), ("b", "h"), ("c", "h")))
    need = wan_need_kbps(hub, four)
    assert need == {"a": 13_334, "b": 13_334, "c": 13_334, "h": 40_000}
    assert sum(need.values()) == pytest.approx(sum(wan_need_kbps(ESTIMATE, four).values()), 1e-3)


def test_the_set_up_time_does_not_dilute_the_rate_the_steps_need() -> None:
    """A run's launch and set-up send nothing to speak of: the bytes cross while steps run."""
    setup = replace(ESTIMATE, total_time_s=150.0, setup_s=50.0)
    assert wan_need_kbps(setup, TWO) == wan_need_kbps(ESTIMATE, TWO)
    assert wan_need_kbps(replace(ESTIMATE, setup_s=100.0), TWO) == {}


@pytest.mark.parametrize(
    ("link", "up", "down", "path"),
    [(10.0, None, None, 10.0), (10.0, 4.0, None, 4.0), (10.0, 4.0, 2.5, 2.5), (1.0, 4.0, 2.5, 1.0)],
)
def test_a_path_carries_the_least_of_what_it_crosses(
    link: float, up: float | None, down: float | None, path: float
) -> None:
    assert path_gbps(link, up, down) == path


def test_what_is_left_of_a_port() -> None:
    assert free_gbps(None, 5) is None
    assert free_gbps(10.0, 2_500_000) == 7.5
    assert free_gbps(1.0, 2_000_000) == 0.0  # a capacity lowered below what is held


def test_a_burst_is_slowed_by_what_others_leave_of_the_port() -> None:
    # planned at 1 Gbit/s of a 3 Gbit/s port: others may take 2 before its bursts slow
    assert burst_slowdown(0.5, 1.0, 3.0, 2.0) == 0.0
    # planned on the whole port, half its step on the WAN, others take a quarter of it:
    # the WAN half takes 4/3 as long, the step a sixth longer
    assert burst_slowdown(0.5, 3.0, 3.0, 0.75) == pytest.approx(0.5 * (3.0 / 2.25 - 1.0))
    assert burst_slowdown(0.5, 3.0, 3.0, 3.0) == float("inf")


@pytest.mark.parametrize("share", [0.05, 0.3, 0.86, 1.0])
def test_the_room_beside_a_burst_is_what_slows_it_by_the_tolerance(share: float) -> None:
    from scheduler.bandwidth import BURST_TOLERANCE, burst_room

    # planned on the whole 3 Gbit/s port: a later stream may take what slows it by 5 %
    room = burst_room(share, 3.0, 3.0, 0.0)
    assert 0 < room < 3.0
    assert burst_slowdown(share, 3.0, 3.0, room) == pytest.approx(BURST_TOLERANCE)
    assert burst_slowdown(share, 3.0, 3.0, 1.01 * room) > BURST_TOLERANCE
    # a job that hardly waits on the WAN leaves more room than one that mostly does
    assert burst_room(0.05, 3.0, 3.0, 0.0) > burst_room(0.86, 3.0, 3.0, 0.0)
    assert burst_room(0.0, 3.0, 3.0, 0.5) == 2.5  # never slowed: what is left
    assert burst_room(0.5, 3.0, 3.0, 0.5) == 0.0  # already slowed past it by others
    assert burst_room(0.5, 1.0, 3.0, 0.5) == 2.5 - 1.0 / 1.1  # planned at a third of it
