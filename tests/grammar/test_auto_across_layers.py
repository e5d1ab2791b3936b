"""One auto policy across the layers: given the same compute, link and model, the planner
(`scheduler.plan`, over a snapshot) and the runtime's auto (`training.auto.decide`, over what
it measures) pick the same compression and sync, regime by regime."""

from __future__ import annotations

import pytest

from grammar import parse_sync
from grammar.auto import SWITCHABLE, candidates
from grammar.quality import least_lossy, quality_cost
from scheduler import Plan, Snapshot, estimate, plan
from tests.scheduler.builders import cluster, job, link
from training.auto import decide
from training.wan import Link

PARAMS = 4_000_000
COMPUTE_S = 0.05


def _snapshot(mbps: float) -> Snapshot:
    """Three clusters of one GPU each and links of `mbps` without latency; no set-up or step
    overhead, so a run's time is its steps'."""
    clusters = tuple(cluster(n, 1, efficiency=0.5) for n in "abc")
    links = tuple(link(a, b, mbps / 1000, 0.0) for a, b in ("ab", "bc", "ca"))
    return Snapshot(clusters, links)


@pytest.mark.parametrize("mbps", [100_000, 10_000, 3_000, 1_000, 400, 200, 100, 20, 2, 0.5])
def test_the_planner_and_the_runtime_choose_alike(mbps: float) -> None:
    """Where the planner's pick is a mode the runtime switches between, the runtime picks it
    from the same measurements; where it is not (stale:1 from 400 Mbit/s to 3 Gbit/s here),
    the runtime picks what the planner's own estimates rank first among those it can run."""
    snap = _snapshot(mbps)
    rate = snap.clusters[0].peak_tflops * 1e12 * 0.5
    j = job(3, params=PARAMS, flops_per_step=COMPUTE_S * rate * 3, steps=1000)
    planned = plan(snap, j, "time")
    assert isinstance(planned, Plan) and len(planned.placement) == 3
    assert planned.estimate.compute_s == pytest.approx(COMPUTE_S)
    ran = decide(COMPUTE_S, Link(mbps * 1e6, 0.0), PARAMS, 3)
    runtime = (ran.compression, str(ran.sync))
    if parse_sync(planned.sync).kind in SWITCHABLE:
        assert (planned.compression, planned.sync) == runtime
        return
    options = candidates("auto", "auto", switchable=True)
    times = {o: estimate(snap, j, planned.placement, *o).total_time_s for o in options}
    wire = {o: estimate(snap, j, planned.placement, *o).wan_bytes for o in options}
    best = least_lossy(
        options, times.__getitem__, lambda o: quality_cost(*o), rank=lambda o: (times[o], wire[o])
    )
    assert best == runtime
