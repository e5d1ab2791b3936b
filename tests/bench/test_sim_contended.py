"""The contended-WAN simulation keeps the invariants it reports (bench/sim/contended.py)."""

from __future__ import annotations

from bench.sim.contended import build, simulate, trace
from bench.sim.engine import Cpn


def test_link_aware_reservations_never_pass_a_ports_capacity_and_every_job_ends() -> None:
    network = build(4, 16, 10.0)
    jobs = trace(40, seed=3, mean_gap_s=60.0)
    aware = simulate(Cpn(network), network, jobs, port_gbps=2.0, aware=True)
    blind = simulate(Cpn(network), network, jobs, port_gbps=2.0, aware=False)
    assert aware.finished == blind.finished == len(jobs)
    assert 0 < aware.most_reserved_of_capacity <= 1.0
    assert blind.most_reserved_of_capacity == 0.0  # it reserves nothing
    assert aware.mean_jct_s > 0 and blind.mean_jct_s > 0
