"""The market bench (`python -m bench.market`): offers follow each provider's strategy, the
books of a simulated run add up, a small run completes."""

from __future__ import annotations

import pytest

from bench.market import FEE, PROVIDERS, offers, owners, run
from bench.sim.network import build_network


def test_offers_follow_each_providers_strategy() -> None:
    network = build_network(10, seed=0)
    listed = {c.name: c.price_per_gpu_hour for c in network.snapshot.clusters}
    owner = owners(network)
    assert sorted(set(owner.values())) == sorted(PROVIDERS)
    reprice = offers(network)
    night = reprice(3600.0, network.snapshot).by_name  # 01:00, all idle
    day = reprice(12 * 3600.0, network.snapshot).by_name
    for name, price in listed.items():
        factor = {"steady": 1.0, "nights": 0.6, "surge": 0.7}[owner[name]]
        assert night[name].price_per_gpu_hour == pytest.approx(price * factor, abs=1e-4)
        by_day = {"steady": 1.0, "nights": 1.15, "surge": 0.7}[owner[name]]
        assert day[name].price_per_gpu_hour == pytest.approx(price * by_day, abs=1e-4)


def test_a_small_market_run_adds_up() -> None:
    rows, outcomes = run(10, 60, 0.9, 0)
    assert [(r.policy, r.regime) for r in rows] == [
        ("cpn", "list"),
        ("cpn", "offers"),
        ("cpn-cost", "list"),
        ("cpn-cost", "offers"),
    ]
    for row, out in zip(rows, outcomes, strict=True):
        assert row.finished == len(out.runs) > 0
        revenue = sum(p.revenue for p in row.parties.values())
        assert revenue + row.platform_fee == pytest.approx(row.gpu_cost)
        assert row.platform_fee == pytest.approx(row.gpu_cost * FEE)
        assert row.tenants_cost >= row.gpu_cost - 1e-6  # egress on top
    # the list regime pays list prices; under offers the cheap night hours show in the mean
    listed, offered = rows[2].parties["nights"], rows[3].parties["nights"]
    assert offered.mean_price < listed.mean_price
