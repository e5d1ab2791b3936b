"""A running job's plan follows its datacenters (issue 50, item 3: "the plan is updated"):
when a cluster leaves a run that shrinks in place, the stored plan is re-estimated on what is
left, with the same decisions, and an event says what changed; when one joins, it is
placed on its planned links, reservation and batch share, which the run is told."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from controller.loop.runs import RunHandle
from controller.store.models import Allocation, Cluster, WanPort
from tests.controller.world import Net, progress, spec
from wire.spec import DataSpec


@pytest.fixture
def net(db_url: str, tmp_path: Path) -> Iterator[Net]:
    n = Net(db_url, tmp_path)
    for name in ("east", "west", "north"):
        n.cluster(name, gpus=4)
    n.link("east", "west", gbps=100.0)
    n.link("east", "north", gbps=0.5, rtt_ms=80.0)
    n.link("west", "north", gbps=0.5, rtt_ms=80.0)
    yield n
    n.close()


def _running(net: Net) -> tuple[str, RunHandle]:
    job_spec = spec("diloco", gpus=12, steps=400, heavy=True).model_copy(
        update={"sync": "local-sgd:8"}
    )
    job_id = net.submit(net.tenant("acme"), job_spec)
    assert net.place() == [job_id]
    handle = net.start(job_id)
    handle.live = True  # as `ray_run` marks a run whose mode shrinks in place
    handle.want(handle.clusters)
    report = progress(100, handle.clusters, total_steps=400)
    report.clusters = dict(handle.clusters)
    handle.on_progress(report)
    return job_id, handle


def test_a_lost_cluster_re_estimates_the_plan_on_what_is_left(net: Net) -> None:
    job_id, handle = _running(net)
    before = net.job(job_id).placement
    assert before is not None and {s.cluster for s in before.clusters} == {"east", "west", "north"}
    net.lose("north")
    net.launcher.tick()
    after = net.job(job_id).placement
    assert after is not None
    assert {s.cluster: s.gpus for s in after.clusters} == {"east": 4, "west": 4}
    assert (str(after.sync), str(after.compression)) == (str(before.sync), str(before.compression))
    assert {(k.src, k.dst) for k in after.links} == {("east", "west")}
    # compute-bound on 8 GPUs of 12: the step is slower; the estimate is remade, not copied
    assert after.estimate.step_time_s > before.estimate.step_time_s
    note = next(m for m in net.messages(job_id) if m.startswith("plan updated"))
    assert "east:4, west:4" in note and "the 300 steps left" in note
    wanted = handle.wanted
    assert wanted is not None and wanted.clusters == {"east": 4, "west": 4}
    assert wanted.links is not None and {(k.a, k.b) for k in wanted.links} == {("east", "west")}
    assert wanted.batch_shares == after.estimate.batch_shares == {"east": 0.5, "west": 0.5}
    assert net.held(job_id) == {"east": 4, "west": 4}


def test_a_cluster_that_joins_runs_on_its_planned_links(net: Net) -> None:
    job_id, handle = _running(net)
    net.lose("north")
    net.launcher.tick()
    report = progress(160, {"east": 4, "west": 4}, total_steps=400)
    report.clusters = {"east": 4, "west": 4}
    handle.on_progress(report)  # the run shrank
    net.beat("north")  # its agent is back: READY again
    net.launcher.tick()
    wanted = handle.wanted
    assert wanted is not None and set(wanted.clusters) == {"east", "west", "north"}
    assert wanted.links is not None
    slow = {(k.a, k.b): k.mbps for k in wanted.links if "north" in (k.a, k.b)}
    assert slow and all(mbps == 500.0 for mbps in slow.values()), slow  # not the default link
    plan = net.job(job_id).placement
    assert plan is not None and {s.cluster for s in plan.clusters} == {"east", "west", "north"}
    assert sum(1 for m in net.messages(job_id) if m.startswith("plan updated")) == 2
    assert net.held(job_id) == {"east": 4, "west": 4, "north": 4}


def test_a_local_data_job_takes_no_cluster_that_lacks_its_data(net: Net) -> None:
    net.cluster("south", gpus=4)  # free GPUs, but none of the job's data
    net.link("south", "east")
    net.link("south", "west")
    job_spec = spec("local", gpus=12, steps=400, heavy=True).model_copy(
        update={
            "sync": "local-sgd:8",
            "data": DataSpec(residency="local", clusters=["east", "west", "north"]),
        }
    )
    job_id = net.submit(net.tenant("acme"), job_spec)
    assert net.place() == [job_id]
    handle = net.start(job_id)
    handle.live = True
    handle.want(handle.clusters)
    net.lose("north")
    net.beat("south", "east", "west")
    net.launcher.tick()
    report = progress(160, {"east": 4, "west": 4}, total_steps=400)
    report.clusters = {"east": 4, "west": 4}
    handle.on_progress(report)
    net.launcher.tick()  # south is READY with 4 free GPUs: the run does not take them
    assert handle.wanted is not None and set(handle.wanted.clusters) == {"east", "west"}
    assert net.held(job_id) == {"east": 4, "west": 4}


def _declare_ports(net: Net, *clusters: str, gbps: float = 10.0) -> None:
    with net.sessions() as s, s.begin():
        for row in s.scalars(select(Cluster).where(Cluster.name.in_(clusters))):
            row.labels = {**row.labels, "uplink_gbps": str(gbps), "downlink_gbps": str(gbps)}


def _port_books(net: Net) -> tuple[dict[str, int], dict[str, int]]:
    """(reserved on each cluster's uplink, the job allocations' rates summed per cluster)."""
    with net.sessions() as s:
        up = (
            select(Cluster.name, WanPort.reserved_kbps)
            .join(Cluster, Cluster.id == WanPort.cluster_id)
            .where(WanPort.direction == "up")
        )
        ports: dict[str, int] = {}
        for name, reserved in s.execute(up):
            ports[name] = reserved
        held: dict[str, int] = {}
        for name, kbps in s.execute(
            select(Cluster.name, Allocation.wan_kbps)
            .join(Cluster, Cluster.id == Allocation.cluster_id)
            .where(Allocation.ended_at.is_(None))
        ):
            held[name] = held.get(name, 0) + (kbps or 0)
    return ports, held


def test_the_wan_rates_held_follow_the_new_plan(net: Net) -> None:
    _declare_ports(net, "east", "west", "north")
    job_id, handle = _running(net)
    before = net.job(job_id).placement
    assert before is not None and all(r > 0 for r in before.wan_kbps.values())
    net.lose("north")
    net.launcher.tick()
    after = net.job(job_id).placement
    assert after is not None and set(after.wan_kbps) == {"east", "west"}
    ports, held = _port_books(net)
    assert held == after.wan_kbps  # what the allocations hold is the new plan's rate
    assert ports == {"east": held["east"], "west": held["west"], "north": 0}  # north's back
    wanted = handle.wanted
    assert wanted is not None and wanted.wan_kbps == after.wan_kbps  # what the run paces to
