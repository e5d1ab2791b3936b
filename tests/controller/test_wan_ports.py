"""A datacenter's uplink and downlink as reserved resources (issue 49), on both backends.

A job placed across the WAN reserves its plan's rate on the uplink and downlink of each of
its clusters, in the transaction that reserves its GPUs, and gives it back exactly once when
its run ends; where an admin declared a port's capacity (`uplink_gbps` / `downlink_gbps`
labels) the reservations never exceed it, and the planner sees only what is left.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select, update

import scheduler
from controller.jobs import lifecycle
from controller.jobs.service import cancel
from controller.network.labels import check_labels
from controller.network.snapshot import _shared, build_world
from controller.store.models import Allocation, Cluster, Job, JobEvent, WanPort
from controller.values.errors import Invalid
from grammar.states import JobState
from tests.controller.world import Net, east_west, progress, report, spec
from wire.spec import JobSpec


@pytest.fixture
def net(db_url: str, tmp_path: Path) -> Iterator[Net]:
    """Clusters east and west (4 A100 each) joined by a 100 Gbit/s link both ways."""
    n = east_west(db_url, tmp_path)
    yield n
    n.close()


def _label(net: Net, cluster: str, **values: float) -> None:
    with net.sessions() as s, s.begin():
        row = s.scalars(select(Cluster).where(Cluster.name == cluster)).one()
        row.labels = {**row.labels, **{k: str(v) for k, v in values.items()}}


def _reserved(net: Net) -> dict[tuple[str, str], int]:
    with net.sessions() as s:
        return {
            (name, direction): kbps
            for name, direction, kbps in s.execute(
                select(Cluster.name, WanPort.direction, WanPort.reserved_kbps).join(
                    Cluster, Cluster.id == WanPort.cluster_id
                )
            )
        }


def _need(net: Net, job_id: str) -> dict[str, int]:
    with net.sessions() as s:
        return {
            name: kbps or 0
            for name, kbps in s.execute(
                select(Cluster.name, Allocation.wan_kbps)
                .join(Cluster, Cluster.id == Allocation.cluster_id)
                .where(Allocation.job_id == job_id, Allocation.ended_at.is_(None))
            )
        }


def _path_gbps(net: Net, src: str, dst: str) -> float | None:
    with net.sessions() as s:
        world = build_world(s, "standard")
    for link in world.snapshot.links:
        if (world.origins[link.a][0], world.origins[link.b][0]) == (src, dst):
            return link.bandwidth_gbps
    return None


def test_a_job_across_the_wan_reserves_its_rate_at_both_ends_and_gives_it_back_once(
    net: Net,
) -> None:
    tenant = net.tenant("acme")
    job_id = net.submit(tenant, spec("wide", gpus=8))  # 4 + 4: its exchange crosses the WAN
    assert net.place() == [job_id]
    need = _need(net, job_id)
    assert set(need) == {"east", "west"} and min(need.values()) > 0
    assert _reserved(net) == {
        (c, d): need[c] for c in ("east", "west") for d in ("up", "down")
    }  # fmt: skip
    with net.sessions() as s, s.begin():
        row = s.get(Job, job_id)
        assert row is not None
        cancel(s, row, "done")
    with net.sessions() as s, s.begin():  # a second end of the same run gives nothing back
        row = s.get(Job, job_id)
        assert row is not None
        lifecycle.end_run(s, row)
    assert set(_reserved(net).values()) == {0}


def test_a_job_on_one_cluster_reserves_no_wan(net: Net) -> None:
    job_id = net.submit(net.tenant("acme"), spec("narrow", gpus=4))
    assert net.place() == [job_id]
    assert set(_need(net, job_id).values()) == {0}
    assert set(_reserved(net).values()) <= {0}


def _others_hold(net: Net, cluster: str, kbps: int) -> None:
    """What other jobs' reservations hold of the cluster's uplink (written as they would be)."""
    with net.sessions() as s, s.begin():
        cluster_id = s.scalars(select(Cluster.id).where(Cluster.name == cluster)).one()
        if s.get(WanPort, (cluster_id, "up")) is None:
            s.add(WanPort(cluster_id=cluster_id, direction="up", reserved_kbps=kbps))
        else:
            s.execute(
                update(WanPort)
                .where(WanPort.cluster_id == cluster_id, WanPort.direction == "up")
                .values(reserved_kbps=kbps)
            )


def test_a_full_uplink_is_never_over_committed_and_the_planner_sees_what_is_left(
    net: Net,
) -> None:
    tenant = net.tenant("acme")
    _label(net, "east", uplink_gbps=1)  # 1 Gbit/s, all of it held by others
    _others_hold(net, "east", 1_000_000)
    assert _path_gbps(net, "east", "west") is None  # nothing left: the path carries nothing
    # west's uplink is not declared, but every exchange crosses a pair both ways: the pair is
    # left out (its direction west -> east alone would be mirrored at its full speed)
    assert _path_gbps(net, "west", "east") is None
    job_id = net.submit(tenant, spec("wide", gpus=8))  # 4 + 4: it must cross east's uplink
    assert net.place() == []
    row = net.job(job_id)
    assert row.state is JobState.PENDING
    # refused by the planner, which names the full port (not planned across it, then
    # refused at the reservation)
    assert row.reason == (
        "waiting: no set of pairwise-linked clusters has 8 free GPUs: the uplink of east has "
        "no bandwidth left"
    )
    assert _reserved(net)[("east", "up")] == 1_000_000
    # A little left: the planner plans on it, and the job is placed only within it.
    _others_hold(net, "east", 999_000)
    assert _path_gbps(net, "east", "west") == pytest.approx(0.001)
    placed = net.place()
    assert _reserved(net)[("east", "up")] <= 1_000_000
    if placed:
        assert _reserved(net)[("east", "up")] == 999_000 + _need(net, job_id)["east"]
    else:
        assert "uplink of east" in net.job(job_id).reason
    # A larger uplink: the planner sees what the others leave of it.
    _label(net, "east", uplink_gbps=3)
    left = 3 - _reserved(net)[("east", "up")] / 1e6
    assert _path_gbps(net, "east", "west") == pytest.approx(left)


def test_a_direction_declared_alone_is_not_mirrored_past_its_port() -> None:
    """A link declared one way is mirrored by the snapshot (`scheduler.both_ways`): the
    mirror's direction is held to its source's free uplink too, and where that has nothing
    free the pair is left out both ways."""
    links = (scheduler.Link("east", "west", 10.0, 2.0),)
    origins = {"east": ("east", "A100"), "west": ("west", "A100")}
    shared = _shared(links, origins, {"west": (4.0, None)}, {})
    assert {(k.a, k.b, k.bandwidth_gbps) for k in shared} == {
        ("east", "west", 10.0),
        ("west", "east", 4.0),
    }
    assert _shared(links, origins, {"west": (0.0, None)}, {}) == ()


@pytest.mark.parametrize("value", ["0", "-1", "fast", "1e9"])
def test_a_port_capacity_is_a_positive_number_of_gbits(value: str) -> None:
    with pytest.raises(Invalid) as refused:
        check_labels({"uplink_gbps": value})
    assert refused.value.field == "labels.uplink_gbps"


def test_a_link_planned_at_a_share_of_a_declared_uplink_is_paced_on_real_links_too(
    net: Net,
) -> None:
    """Without emulation the runtime gets no link table, so nothing slows its sends: a link
    whose uplink an admin declared is planned at the share left and the run is paced to it."""
    from dataclasses import replace

    from controller.jobs.request import spec_of
    from controller.loop.ray_run import train_spec_of

    real = replace(net.launcher.config, emulate_wan=False)
    tenant = net.tenant("acme")

    def launched() -> tuple[list[tuple[str, str, float]], dict[str, int]]:
        job_id = net.submit(tenant, spec("w", gpus=8))
        assert net.place() == [job_id]
        with net.sessions() as s:
            job = s.get(Job, job_id)
            assert job is not None and job.placement is not None
            # what the plan says it reserves is what was reserved
            assert job.placement.wan_kbps == _need(net, job_id)
            train = train_spec_of(real, job, spec_of(job), net.held(job_id))
            cancel(s, job, "seen")
            s.commit()
        return [(k.a, k.b, k.mbps) for k in train.links], train.wan_kbps

    assert launched() == ([], {})  # no port declared: real links run as they are
    _label(net, "east", uplink_gbps=3)
    _others_hold(net, "east", 1_000_000)
    [(a, b, mbps)], paced = launched()
    assert {a, b} == {"east", "west"} and mbps == pytest.approx(2000.0)  # the 2 Gbit/s left
    # each end of the paced link keeps, on average, to what the plan reserved there
    assert set(paced) == {"east", "west"} and min(paced.values()) > 0


def test_a_run_whose_exchanges_send_below_its_reservation_says_so_once(net: Net) -> None:
    """Each cluster sends 1000 bytes a step in 10 ms of exchange (800 kbit/s while
    exchanging): short of a 1 Mbit/s reservation, not of a 500 kbit/s one."""
    from controller.loop.progress import flush

    job_id = net.submit(net.tenant("acme"), spec("wide", gpus=8))
    assert net.place() == [job_id]
    handle = net.start(job_id)
    handle.reserved_kbps = {"east": 1000, "west": 500}
    for step in (10, 20, 30, 40, 50):  # one report a pass: the count carries across passes
        handle.on_progress(progress(step, handle.clusters, exchange_s=0.01 * step))
        flush(net.sessions, handle)
    with net.sessions() as s:
        warnings = s.scalars(
            select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.kind == "warning")
        ).all()
    [warning] = warnings  # once, after two short reports in a row, not on every report
    assert warning.message.startswith("WAN of east: exchanges sent at 0.8 Mbit/s")
    assert warning.data == {
        "cluster": "east", "step": 30, "measured_bps": 800_000, "reserved_bps": 1_000_000
    }  # fmt: skip


def test_the_ports_view_names_the_jobs_holding_each_port_until_they_end(net: Net) -> None:
    from controller.network.allocations import ports

    _label(net, "east", uplink_gbps=3)  # west declares nothing: listed once it holds a job
    tenant = net.tenant("acme")
    job_id = net.submit(tenant, spec("wide", gpus=8))
    assert net.place() == [job_id]
    need = _need(net, job_id)
    with net.sessions() as s:
        found = {(p.cluster, p.direction): p for p in ports(s)}
    assert set(found) == {(c, d) for c in ("east", "west") for d in ("up", "down")}
    up = found[("east", "up")]
    # free: what the planner plans a next job on, the job's bursts kept
    assert up.capacity_kbps == 3_000_000 and up.free_kbps is not None
    assert up.free_kbps < 3_000_000 - need["east"]
    assert up.free_kbps == pytest.approx(1e6 * (_path_gbps(net, "east", "west") or 0), abs=1)
    assert [(h.job_id, h.tenant_id, h.kbps) for h in up.holders] == [(job_id, tenant, need["east"])]
    assert (
        found[("west", "down")].capacity_kbps is None and found[("west", "down")].free_kbps is None
    )
    with net.sessions() as s, s.begin():
        row = s.get(Job, job_id)
        assert row is not None
        cancel(s, row, "done")
    with net.sessions() as s:
        after = {(p.cluster, p.direction): p for p in ports(s)}
    assert all(p.reserved_kbps == 0 and p.holders == () for p in after.values())


def test_fair_share_reads_what_each_tenant_holds_of_the_declared_uplinks(net: Net) -> None:
    """The queue's DRF inputs: a tenant's reserved rate on declared uplinks, all GPUs and all
    declared uplinks (west's undeclared uplink is no resource to share)."""
    from controller.loop.placement import _shares

    _label(net, "east", uplink_gbps=3)
    tenant = net.tenant("acme")
    job_id = net.submit(tenant, spec("wide", gpus=8))
    assert net.place() == [job_id]
    with net.sessions() as s:
        wan, totals = _shares(s, build_world(s, "standard"))
    assert wan == {tenant: _need(net, job_id)["east"]}
    assert totals == (8, 3_000_000)


def test_the_next_job_of_a_pass_plans_on_what_the_first_left_of_a_port(net: Net) -> None:
    """Two jobs placed in one pass across east's declared uplink: the second is planned on
    what the first's reservation and bursts leave (`scheduler.bandwidth.burst_room`), as a
    later pass would plan it, not at what the pass read before the first; nobody is warned."""
    from scheduler.bandwidth import BURST_TOLERANCE
    from wire.spec import DataSpec

    _label(net, "east", uplink_gbps=3)
    tenant = net.tenant("acme")
    both = DataSpec(residency="local", clusters=["east", "west"])  # each runs east:1 + west:1
    first, second = (
        net.submit(tenant, spec(name, gpus=2).model_copy(update={"data": both}))
        for name in ("first", "second")
    )
    assert net.place() == [first, second]  # one pass
    shares = {}
    for job_id in (first, second):
        plan = net.job(job_id).placement
        assert plan is not None
        [link] = [k for k in plan.links if {k.src, k.dst} == {"east", "west"}]
        shares[job_id] = link.bandwidth_gbps
    need = _need(net, first)["east"]
    assert shares[first] == pytest.approx(3.0)
    assert 0 < shares[second] < 3.0 - need / 1e6
    assert _slowdown(net, first, round(shares[second] * 1e6)) == pytest.approx(BURST_TOLERANCE)
    assert _reserved(net)[("east", "up")] == need + _need(net, second)["east"] <= 3_000_000
    assert _warnings(net, first) == [] and _warnings(net, second) == []


def test_a_job_is_planned_on_no_more_than_its_share_of_a_port(net: Net) -> None:
    """`wan_job_share` 0.25 of east's 4 Gbit/s uplink: each job's path across it is planned
    at 1 Gbit/s, whatever is free, so later jobs find their share."""
    _label(net, "east", uplink_gbps=4, wan_job_share=0.25)
    assert _path_gbps(net, "east", "west") == pytest.approx(1.0)
    assert _path_gbps(net, "west", "east") == 100.0  # west's ports are not declared
    _others_hold(net, "east", 3_500_000)  # less than the share is left: that is the limit
    assert _path_gbps(net, "east", "west") == pytest.approx(0.5)
    # the planner's ports are the same limits (what a collective's copies share)
    with net.sessions() as s:
        world = build_world(s, "standard")
    [port] = world.snapshot.ports
    assert (world.origins[port.cluster][0], port.up_gbps, port.down_gbps) == ("east", 0.5, None)
    # a placement in the same pass takes its reservation out of them too
    after = world.after("j", "t", 0, False, (), wan_kbps={"east": 250_000})
    assert after.snapshot.port_of[port.cluster].up_gbps == pytest.approx(0.25)


def _measured(net: Net, src: str, dst: str, gbps: float) -> None:
    """An agent of `src` reports its probe to `dst` carried `gbps`."""
    from agents.protocol import LinkMeasurement, LinkReport
    from controller.network.resources import ingest_links
    from controller.store.models import utcnow

    m = LinkMeasurement(
        dst=dst, bandwidth_gbps=gbps, rtt_ms=1.0, bytes_transferred=1 << 22, measured_at=utcnow()
    )
    with net.sessions() as s, s.begin():
        ingest_links(s, LinkReport(cluster=src, links=[m]))


def test_a_port_is_planned_on_no_more_than_its_agents_probes_carried_over_it(net: Net) -> None:
    """east declares a 3 Gbit/s uplink, but its agent's probe to west carried 2.5 (a flow's
    goodput through the port): jobs are planned on 90 % of that (`FLOW_HEADROOM`: what
    paced exchanges keep up through it), less what others reserved; the admission's bound
    stays the declared capacity. A faster measurement changes nothing: the declared
    capacity is the most a port is planned on."""
    from controller.network.allocations import ports

    _label(net, "east", uplink_gbps=3)
    _others_hold(net, "east", 1_000_000)
    assert _path_gbps(net, "east", "west") == pytest.approx(2.0)
    _measured(net, "east", "west", 2.5)
    assert _path_gbps(net, "east", "west") == pytest.approx(1.25)  # 2.25 less the 1 held
    with net.sessions() as s:
        found = {(p.cluster, p.direction): p for p in ports(s)}
    up = found[("east", "up")]
    assert (up.capacity_kbps, up.carried_kbps) == (3_000_000, 2_500_000)
    assert up.free_kbps == 1_250_000
    assert ("west", "down") not in found  # measured into west, but nothing declared there
    _measured(net, "east", "west", 5.0)  # the window's largest: now above the declared 3
    assert _path_gbps(net, "east", "west") == pytest.approx(2.0)


@pytest.mark.parametrize("value", ["0", "1.5", "-0.1"])
def test_a_jobs_share_of_a_port_is_a_fraction(value: str) -> None:
    with pytest.raises(Invalid) as refused:
        check_labels({"wan_job_share": value})
    assert refused.value.field == "labels.wan_job_share"
    assert "such as 0.5" in refused.value.detail


def _spanning(name: str, gpus: int, qos: dict[str, object]) -> JobSpec:
    """A job whose data lives at east and west, so it runs (and reserves its rate) at both."""
    from wire.spec import DataSpec

    both = DataSpec(residency="local", clusters=["east", "west"])
    return spec(name, gpus=gpus, qos=qos).model_copy(update={"data": both})


@pytest.mark.parametrize("preemptible", [True, False])
def test_a_job_short_of_bandwidth_preempts_by_the_rules_for_gpus(
    net: Net, preemptible: bool
) -> None:
    """East's and west's ports hold exactly what a low-priority job reserved: a job of higher
    priority that must cross them (6 GPUs, 3 free a side) has no path. It preempts the
    holder when that one is preemptible, as it would for GPUs, and is placed on what its end
    frees; otherwise it waits, saying why, and nothing is preempted."""
    tenant = net.tenant("acme", priority_ceiling=10)
    low = net.submit(
        tenant, _spanning("low", 2, {"qos_class": "spot" if preemptible else "standard"})
    )
    assert net.place() == [low]
    need = _need(net, low)
    assert set(need) == {"east", "west"} and min(need.values()) > 0
    for side in ("east", "west"):  # the ports are full: nothing left for anyone else
        _label(net, side, uplink_gbps=need[side] / 1e6, downlink_gbps=need[side] / 1e6)
    assert _path_gbps(net, "east", "west") is None
    high = net.submit(tenant, spec("high", gpus=6, qos={"priority": 10}))
    assert net.place() == []
    if not preemptible:
        assert net.job(low).preempted_by is None
        assert net.job(high).reason.startswith("waiting: no set of pairwise-linked clusters")
        return
    assert net.job(low).preempted_by == high
    assert net.job(high).reason.startswith("waiting: preempting 1 ")
    run = net.start(low)
    net.launcher.tick()  # asks the run to stop; it ends, its GPUs and rates are given back
    net.finish(run, report=report(10, run.clusters, stopped=True))
    assert net.job(low).state is JobState.PENDING
    assert set(_reserved(net).values()) == {0}
    assert net.place()[0] == high  # the victim may follow, in what the ports have left
    placed = net.job(high).placement
    assert placed is not None and {s.cluster for s in placed.clusters} == {"east", "west"}
    assert 0 < _need(net, high)["east"] <= _reserved(net)[("east", "up")] <= need["east"]


def _both(net: Net, tenant: str, name: str, task: str | None = None) -> str:
    from wire.spec import DataSpec

    both = DataSpec(residency="local", clusters=["east", "west"])
    update: dict[str, object] = {"data": both, **({} if task is None else {"task": task})}
    return net.submit(net.tenant(tenant), spec(name, gpus=2).model_copy(update=update))


def _slowdown(net: Net, first: str, others_kbps: int) -> float:
    """How much longer `first`'s steps take while others send `others_kbps` through east's
    3 Gbit/s uplink, as its plan was timed."""
    from scheduler.bandwidth import burst_slowdown

    plan = net.job(first).placement
    assert plan is not None
    est = plan.estimate
    assert est.compute_s is not None
    share = (est.step_time_s - est.compute_s - (est.intra_s or 0.0) - est.step_overhead_s) / (
        est.step_time_s
    )
    return burst_slowdown(share, 3.0, 3.0, others_kbps / 1e6)


def _warnings(net: Net, job_id: str) -> list[JobEvent]:
    with net.sessions() as s:
        return list(
            s.scalars(
                select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.kind == "warning")
            ).all()
        )


def test_a_later_job_is_planned_on_what_leaves_a_running_jobs_bursts_their_time(
    net: Net,
) -> None:
    """The first job across east's 3 Gbit/s uplink is planned on all of it and reserves its
    average. A second (another tenant's) admitted on what the reservations leave would send
    steadily through the first one's bursts and slow its steps by more than
    `BURST_TOLERANCE`: it is planned on no more than keeps them within it, so the first
    job's plan holds and it is not warned."""
    from scheduler.bandwidth import BURST_TOLERANCE

    _label(net, "east", uplink_gbps=3)
    first = _both(net, "acme", "first")
    assert net.place() == [first]
    left = 3.0 - _need(net, first)["east"] / 1e6  # what the reservations leave
    assert _slowdown(net, first, round(left * 1e6)) > BURST_TOLERANCE  # the case at hand
    room = _path_gbps(net, "east", "west")
    assert room is not None and room < left
    assert _slowdown(net, first, round(room * 1e6)) == pytest.approx(BURST_TOLERANCE)
    second = _both(net, "other", "second")
    assert net.place() == [second]
    assert _slowdown(net, first, _need(net, second)["east"]) <= BURST_TOLERANCE + 1e-6
    assert _warnings(net, first) == [] and _warnings(net, second) == []


def test_a_running_job_is_told_when_a_reservation_on_an_older_view_slows_its_bursts(
    net: Net,
) -> None:
    """A job reserved on a view of the ports older than the first job's placement (another
    replica's pass) takes all that the reservations leave of east's uplink, through the
    first one's bursts: the first is told, with the numbers (and without the other job's
    name: it is another tenant's); the job just reserved is not."""
    from controller.loop.placement import _warn_bursts
    from controller.network.allocations import Slot, reserve
    from scheduler.bandwidth import BURST_TOLERANCE

    _label(net, "east", uplink_gbps=3)
    first = _both(net, "acme", "first")
    assert net.place() == [first]
    second = _both(net, "other", "second")
    rest = 3_000_000 - _need(net, first)["east"]
    with net.sessions() as s, s.begin():
        job = s.get(Job, second)
        assert job is not None
        reserve(s, job, [Slot("east", "A100", 1), Slot("west", "A100", 1)], {"east": rest})
        _warn_bursts(s, second, {"east"})
    slower = _slowdown(net, first, rest)
    told = _warnings(net, first)
    assert slower > BURST_TOLERANCE, slower  # the case this test is about
    assert [e.data["cluster"] for e in told] == ["east"]  # its uplink; west declares nothing
    assert told[0].data["slower"] == pytest.approx(slower)
    assert "may take up to" in told[0].message and second not in told[0].message
    assert _warnings(net, second) == []


WIDE = "builtin:wide-mlp"
"""A task whose exchange is large against its compute: what a small share of a port slows."""


@pytest.mark.parametrize("ends_in_s", [5.0, 30 * 86400.0])
def test_a_job_waits_for_the_rate_a_runner_due_to_end_soon_holds_when_that_is_sooner(
    net: Net, ends_in_s: float
) -> None:
    """The first job across east's 0.5 Gbit/s uplink leaves a few Mbit/s of it to others
    (its bursts kept). A second job that must cross it, planned on those, would run an hour
    where waiting for the first to end (in 5 s) and taking the whole uplink runs it in about
    a minute: it waits for the first one's rate, saying so, and is not planned again while
    that one runs; once the first ends it is placed on more than was free. Where the first
    ends only in a month, the second is placed now on what is free."""
    from datetime import timedelta

    from controller.store.models import utcnow
    from scheduler import Wait

    _label(net, "east", uplink_gbps=0.5)
    first = _both(net, "acme", "first", WIDE)
    assert net.place() == [first]
    with net.sessions() as s, s.begin():
        row = s.get(Job, first)
        assert row is not None
        row.ends_at = utcnow() + timedelta(seconds=ends_in_s)
    run = net.start(first)
    room = _path_gbps(net, "east", "west")
    assert room is not None and room < 0.01  # a few Mbit/s
    second = _both(net, "other", "second", WIDE)
    waits: dict[str, Wait] = {}
    placed = net.place(waits=waits)
    if ends_in_s > 3600:
        assert placed == [second] and not waits
        assert 0 < _need(net, second)["east"] <= room * 1e6 + 1
        return
    assert placed == [] and second in waits
    reason = net.job(second).reason
    assert reason.startswith("waiting: for the WAN rate 1 running job(s) hold on the ports of")
    assert "east" in reason and "sooner than on the rate free now" in reason
    assert net.place(waits=waits) == []  # still held by the first: not weighed again
    net.finish(run, report=report(100, run.clusters))
    assert net.place(waits=waits) == [second]
    assert _need(net, second)["east"] > room * 1e6  # planned on what the first gave back
