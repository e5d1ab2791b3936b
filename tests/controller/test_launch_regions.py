"""The launch tells the workers where each placed cluster is (`TrainSpec.regions`, from
`Cluster.region`), so an `async-ps` job placed across regions runs a server per region under
a global one (HALoS, `training.sync.async_ps`). No Ray: `train_spec_of` is what `launch`
hands the run, built from the real database."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.loop.ray_run import train_spec_of
from controller.store.models import Job
from tests.controller.world import TASK, Net
from training import TrainSpec
from training.sync.hetero import region_groups
from wire.plan import JobPlan
from wire.spec import JobSpec


@pytest.fixture
def net(db_url: str, tmp_path: Path) -> Iterator[Net]:
    """Two clusters in us-east and one in eu-west, one GPU each: a 3-GPU job spans all."""
    n = Net(db_url, tmp_path / "checkpoints")
    n.cluster("ash", gpus=1, region="us-east")
    n.cluster("nyc", gpus=1, region="us-east")
    n.cluster("fra", gpus=1, region="eu-west")
    n.link("ash", "nyc", gbps=10.0, rtt_ms=2.0)
    n.link("ash", "fra", gbps=1.0, rtt_ms=80.0)
    n.link("nyc", "fra", gbps=1.0, rtt_ms=80.0)
    yield n
    n.close()


def _launched(net: Net, sync: str, gpus: int) -> tuple[TrainSpec, JobPlan]:
    """The run `launch` would hand the workers for a job placed now, and its plan."""
    spec = JobSpec(name="ps", task=TASK, gpus=gpus, steps=20, compression="none", sync=sync)
    job_id = net.submit(net.tenant("acme"), spec)
    assert net.place() == [job_id]
    with net.sessions() as s:
        job = s.get(Job, job_id)
        assert job is not None and job.placement is not None
        train = train_spec_of(net.launcher.config, job, spec, net.held(job_id))
        planned = job.placement
    train.validate()
    return train, planned


def test_an_async_ps_job_across_two_regions_names_every_clusters_region(net: Net) -> None:
    train, _ = _launched(net, "async-ps:4", gpus=3)
    clusters, regions = train.clusters, train.regions
    assert set(clusters) == {"ash", "nyc", "fra"}
    assert regions == {"ash": "us-east", "nyc": "us-east", "fra": "eu-west"}
    # what the runtime makes of it: two regions, so a hierarchical server
    groups = region_groups(list(clusters), regions)
    assert sorted(map(sorted, groups.values())) == [["ash", "nyc"], ["fra"]]


def test_how_often_regions_exchange_is_the_plans_and_the_run_keeps_it(net: Net) -> None:
    """Each region's server exchanges with the global one every as many ticks as one exchange
    lasts: the plan fixes the number (its bytes are counted from it), names it, and the run
    is handed it (`TrainSpec.relay_ticks`), not left to send whenever the last one landed."""
    train, planned = _launched(net, "async-ps:4", gpus=3)
    # the global server at the us-east host; eu-west's exchange crosses 80 ms of RTT, many
    # of this small model's steps
    assert list(planned.estimate.relay_ticks) == ["eu-west"]
    assert planned.estimate.relay_ticks["eu-west"] > 1
    assert train.relay_ticks == planned.estimate.relay_ticks
    every = planned.estimate.relay_ticks["eu-west"]
    assert any(f"eu-west every {every}" in line for line in planned.explanation)


def test_a_job_placed_in_one_region_names_only_its_clusters(net: Net) -> None:
    train, _ = _launched(net, "async-ps:4", gpus=1)
    clusters, regions = train.clusters, train.regions
    assert len(clusters) == 1 and set(regions) == set(clusters)
    assert len(region_groups(list(clusters), regions)) == 1  # flat


def test_the_run_emulates_the_links_its_plan_was_made_over(net: Net) -> None:
    """The plan records the links it was planned over; the launch emulates those, not what
    the links table says later (a link re-declared after placement changes no placed run)."""
    spec = JobSpec(name="dp", task=TASK, gpus=3, steps=20, compression="none", sync="every-step")
    job_id = net.submit(net.tenant("acme"), spec)
    assert net.place() == [job_id]
    net.link("ash", "fra", gbps=0.1, rtt_ms=300.0)  # after the plan was made
    with net.sessions() as s:
        job = s.get(Job, job_id)
        assert job is not None and job.placement is not None
        planned = {(k.src, k.dst): (k.bandwidth_gbps, k.rtt_ms) for k in job.placement.links}
        train = train_spec_of(net.launcher.config, job, spec, net.held(job_id))
    assert planned == {("ash", "fra"): (1.0, 80.0), ("ash", "nyc"): (10.0, 2.0),
                       ("fra", "nyc"): (1.0, 80.0)}  # fmt: skip
    assert {(k.a, k.b): (k.mbps, k.rtt_ms) for k in train.links} == {
        pair: (gbps * 1000, rtt) for pair, (gbps, rtt) in planned.items()
    }
