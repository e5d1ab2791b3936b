"""The pure rules of settlement and SLA credits (issue 52): splits that sum to zero to the
micro-dollar, uptime from state changes, refunds only for a missed promise."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from controller.money.settlement import split
from controller.money.sla import Promise, missed, refund, uptime
from grammar.states import ClusterState

T0 = datetime(2026, 12, 6, 12, tzinfo=UTC)


@pytest.mark.parametrize(
    "amount", ["0.000001", "0.000003", "1.234567", "1000000.000001", "-0.500001", "0"]
)
@pytest.mark.parametrize("fee", ["0", "0.1", "0.125", "0.333333", "0.999999"])
def test_a_split_sums_to_zero_and_the_provider_gets_its_rounded_share(
    amount: str, fee: str
) -> None:
    sides = split(Decimal(amount), "t", "gpu", ("p", Decimal(fee)))
    assert [s.account for s in sides] == ["tenant", "provider", "platform"]
    assert sum(s.amount for s in sides) == 0
    assert sides[0].amount == -Decimal(amount)
    net = sides[1].amount
    assert abs(net - Decimal(amount) * (1 - Decimal(fee))) <= Decimal("0.0000005")
    assert all(s.amount == s.amount.quantize(Decimal("0.000001")) for s in sides)


def test_the_operators_clusters_and_held_credits_go_to_the_platform() -> None:
    assert [(s.account, s.amount) for s in split(Decimal("2"), "t", "gpu", None)] == [
        ("tenant", Decimal("-2.000000")),
        ("platform", Decimal("2.000000")),
    ]
    owner = ("p", Decimal("0.1"))
    credit = split(Decimal("-0.5"), "t", "credit", owner)  # the platform bears an overrun
    assert [(s.account, s.amount) for s in credit] == [
        ("tenant", Decimal("0.500000")),
        ("platform", Decimal("-0.500000")),
    ]
    sla = split(Decimal("-1"), "t", "sla_credit", owner)  # a refund comes back in shares
    assert [(s.account, s.amount) for s in sla] == [
        ("tenant", Decimal("1.000000")),
        ("provider", Decimal("-0.900000")),
        ("platform", Decimal("-0.100000")),
    ]


def test_uptime_counts_the_time_the_cluster_was_not_live() -> None:
    end = T0 + timedelta(seconds=100)
    ready, down, suspect = ClusterState.READY, ClusterState.DOWN, ClusterState.SUSPECT
    assert uptime(ready, [], T0, end) == 1.0
    assert uptime(down, [], T0, end) == 0.0
    changes = [
        (T0 - timedelta(seconds=50), ready),  # before the run: sets the state at its start
        (T0 + timedelta(seconds=10), suspect),  # a missed heartbeat is not down
        (T0 + timedelta(seconds=20), down),
        (T0 + timedelta(seconds=50), ready),
        (T0 + timedelta(seconds=90), down),
        (T0 + timedelta(seconds=200), ready),  # after the run: not counted
    ]
    assert uptime(down, changes, T0, end) == pytest.approx(0.6)


def test_a_refund_is_owed_only_for_a_missed_promise() -> None:
    promise = Promise(Decimal("0.99"), 10.0, Decimal("0.25"))
    assert missed(promise, 0.995, 12.0) == []
    assert missed(promise, 0.995, None) == []  # no measurement in the run: not judged
    misses = missed(promise, 0.97, 4.0)
    assert misses == [
        "uptime 97.00% against 99.00% promised",
        "uplink 4 Gbit/s measured against 10 promised",
    ]
    assert refund(Decimal("8.000002"), promise, misses) == Decimal("2.000000")
    assert refund(Decimal("8"), promise, []) == 0
    assert missed(Promise(None, 10.0, Decimal("0.1")), 0.0, 11.0) == []
