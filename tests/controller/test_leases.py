"""The lease policy as a pure function of time."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from controller.network.leases import MISSED_BEAT_FACTOR, LeasePolicy
from grammar.states import ClusterState

T0 = datetime(2026, 1, 1, tzinfo=UTC)
POLICY = LeasePolicy(heartbeat_interval_s=10, grace_s=40)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_states_follow_silence() -> None:
    assert POLICY.state_at(at(0), T0, ClusterState.READY) == "READY"
    assert POLICY.state_at(at(10 * MISSED_BEAT_FACTOR), T0, ClusterState.READY) == "READY"
    assert POLICY.state_at(at(10 * MISSED_BEAT_FACTOR + 0.01), T0, ClusterState.READY) == "SUSPECT"
    assert POLICY.state_at(at(40), T0, ClusterState.SUSPECT) == "SUSPECT"
    assert POLICY.state_at(at(40.01), T0, ClusterState.SUSPECT) == "DOWN"


def test_never_heard_from_stays_pending() -> None:
    assert POLICY.state_at(at(1000), None, ClusterState.PENDING) == "PENDING"


def test_expiry_is_heartbeat_plus_grace() -> None:
    assert POLICY.expiry(T0) == at(40)
