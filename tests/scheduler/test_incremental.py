"""What the planner keeps between plans instead of rebuilding per placement: the snapshot's
incrementally updated tables (`Snapshot.with_free`) and the seed rankings read off a kept
index (`_Search._rankings`) must equal what a rebuild from every cluster gives."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from scheduler import Assignment, QoS, RunningJob, Snapshot
from scheduler.cost import CostModel
from scheduler.optimizer import _Search
from scheduler.rules import exclusions, release
from tests.scheduler.builders import cluster, job, link

MODELS = ("H100", "A100", "T4")


def _fleet(rng: random.Random, n: int) -> Snapshot:
    """Few GPU models and prices, so that ranking keys tie and names must break the ties."""
    clusters = tuple(
        cluster(
            f"c{i:03d}",
            rng.choice((0, 0, 1, 2, 3, 8, 16, 64)),
            gpu_model=rng.choice(MODELS),
            price_per_gpu_hour=rng.choice((1.0, 2.0, 2.5)),
            efficiency=rng.choice((None, 0.5)),
            region=rng.choice(("eu", "us")),
            state="DOWN" if rng.random() < 0.05 else "READY",
            cordoned=rng.random() < 0.05,
        )
        for i in range(n)
    )
    links = tuple(
        link(a.name, b.name)
        for i, a in enumerate(clusters)
        for b in clusters[i + 1 :]
        if rng.random() < 0.2
    )
    return Snapshot(clusters, links)


def _exclusions_scan(snap: Snapshot) -> list[tuple[str, str]]:
    """`exclusions` for a job without region or data limits, from every cluster."""
    out = []
    for c in snap.clusters:
        if c.state == "DOWN":
            out.append((c.name, "DOWN"))
        elif c.cordoned:
            out.append((c.name, "cordoned"))
        elif c.gpus_free < 1:
            out.append((c.name, "no free GPUs"))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_with_free_and_release_keep_the_tables_a_rebuild_gives(seed: int) -> None:
    rng = random.Random(seed)
    snap = _fleet(rng, 40)
    # built: the copies update them rather than rebuild
    _ = snap.by_name, snap.free_gpus, snap.full, snap.open_clusters
    table, memo = snap.directed_links, snap.memo
    for step in range(200):
        if snap.running and rng.random() < 0.4:
            victims = rng.sample(snap.running, rng.randint(1, min(3, len(snap.running))))
            after = release(snap, victims)
        else:
            free = [c for c in snap.clusters if c.gpus_free > 0]
            if not free:
                continue
            chosen = rng.sample(free, rng.randint(1, min(3, len(free))))
            placement = tuple(Assignment(c.name, rng.randint(1, c.gpus_free)) for c in chosen)
            after = snap.with_free(
                {a.cluster: -a.gpus for a in placement},
                (*snap.running, RunningJob(f"j{step}", placement)),
            )
        rebuilt = Snapshot(after.clusters, snap.links, after.running)
        assert after.by_name == rebuilt.by_name
        assert after.free_gpus == rebuilt.free_gpus
        assert after.full == rebuilt.full
        assert after.open_clusters == rebuilt.open_clusters
        assert list(exclusions(after, job(1)).items()) == _exclusions_scan(after)
        assert after.directed_links is table and after.memo is memo
        touched = sum(1 for a, b in zip(after.clusters, snap.clusters, strict=True) if a is not b)
        assert touched <= 9  # only the placement's or the victims' clusters are rebuilt
        snap = after
    assert snap.free_gpus == sum(c.gpus_free for c in snap.clusters if c.schedulable)


def test_a_reallocation_changes_free_gpus_only() -> None:
    """Copies share tables derived from names, models and prices (`Snapshot.memo`)."""
    snap = Snapshot((cluster("a", 2), cluster("b", 8)))
    ok = snap.reallocated((snap.clusters[0], replace(snap.clusters[1], gpus_free=3)), ())
    assert ok.by_name["b"].gpus_free == 3 and ok.free_gpus == 5
    with pytest.raises(ValueError, match="more than its free GPUs"):
        snap.reallocated((snap.clusters[0], replace(snap.clusters[1], price_per_gpu_hour=9)), ())


@pytest.mark.parametrize("seed", range(40))
def test_indexed_seed_rankings_equal_scoring_every_cluster(seed: int) -> None:
    rng = random.Random(seed)
    snap = _fleet(rng, rng.choice((20, 60, 150)))
    gmin = rng.choice((1, 1, 2, 4, 8, 16, 32))
    gmax = gmin if rng.random() < 0.7 else gmin * 2
    objective = rng.choice(("time", "cost", "cost-within-deadline"))
    regions = ("eu",) if rng.random() < 0.3 else None
    deadline = 1e9 if objective != "time" else None
    request = job(gmin, max_gpus=gmax, qos=QoS(deadline_s=deadline, regions=regions))
    model = CostModel(snap, request)
    assert model.rank_index() is not None
    excluded = exclusions(snap, request)
    cands = [c.name for c in snap.clusters if c.name not in excluded]
    search = _Search(model, request, objective, gmin, gmax)  # type: ignore[arg-type]
    assert search._rankings(set(cands)) == search._rankings_scan(cands)
    # and again on a copy after a placement: the index is shared, the free GPUs are new
    taken = dict.fromkeys(rng.sample(cands, min(5, len(cands))), -1)
    later = snap.with_free(taken, ())
    model = CostModel(later, request)
    assert model.rate is CostModel(snap, request).rate
    search = _Search(model, request, objective, gmin, gmax)  # type: ignore[arg-type]
    excluded = exclusions(later, request)
    cands = [c.name for c in later.clusters if c.name not in excluded]
    assert search._rankings(set(cands)) == search._rankings_scan(cands)
