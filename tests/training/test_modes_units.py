"""The pure parts of the heterogeneous and decentralised sync modes (issue 17): the grammar of
`partial:H`, `async-ps:S` and `gossip:P`, the step counts of fast clusters, the gossip graph,
the parameter server's staleness rule and the non-IID split of local data."""

from __future__ import annotations

import pytest
import torch

from grammar import Sync, SyncKind, parse_compression, parse_sync
from training.collective import Collective
from training.compression import make_compressor
from training.exchange import Piece, decode, encode
from training.residency import local_samples, split_by_label
from training.spec import LinkSpec, TrainSpec, parse_slowdown
from training.sync import AsyncPSSync, GossipSync, PartialSync, SyncContext, make_sync_strategy
from training.sync.async_ps import ParameterServer
from training.sync.hetero import (
    bandwidth_ring,
    ps_host,
    region_groups,
    region_hosts,
    ring_neighbours,
    staleness_weight,
    steps_per_tick,
)
from training.tasks.base import OptimizerSpec, Task
from training.wan import LinkTable


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("partial:4", Sync(SyncKind.PARTIAL, period=4)),
        ("async-ps:0", Sync(SyncKind.ASYNC_PS, staleness=0)),
        ("ASYNC-PS:3", Sync(SyncKind.ASYNC_PS, staleness=3)),
        ("gossip:2", Sync(SyncKind.GOSSIP, period=2)),
    ],
)
def test_new_sync_values_parse_and_print_back(text: str, value: Sync) -> None:
    assert parse_sync(text) == value
    assert parse_sync(str(value)) == value


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("partial:0", "H must be >= 1"),
        ("gossip:0", "P must be >= 1"),
        ("async-ps", "async-ps needs a whole number S"),
        ("gossip:2:3", "gossip needs a whole number P"),
        ("partial:x", "partial needs a whole number H"),
    ],
)
def test_bad_new_sync_values_say_the_fix(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_sync(text)


def test_fast_clusters_fit_their_speed_into_the_slowest_step_up_to_the_bound() -> None:
    assert steps_per_tick(0.01, 0.04, 8) == 4
    assert steps_per_tick(0.01, 0.019, 8) == 1  # rounded down: noise never runs ahead
    assert steps_per_tick(0.001, 0.04, 4) == 4  # the bound
    assert steps_per_tick(0.04, 0.04, 4) == 1
    assert steps_per_tick(0.0, 0.04, 4) == 1  # not measured yet


def test_gossip_ring_follows_the_fast_links() -> None:
    links = LinkTable.build(
        [
            LinkSpec("a", "c", 1000, 1),
            LinkSpec("c", "b", 900, 1),
            LinkSpec("b", "d", 800, 1),
            LinkSpec("a", "b", 10, 1),
            LinkSpec("a", "d", 10, 1),
            LinkSpec("c", "d", 10, 1),
        ]
    )
    ring = bandwidth_ring(["a", "b", "c", "d"], links)
    assert ring == ["a", "c", "b", "d"]
    assert ring_neighbours(ring, "a") == ["d", "c"]
    assert ring_neighbours(["a", "b"], "a") == ["b"]
    assert ring_neighbours(["a"], "a") == []
    assert bandwidth_ring(["x", "y", "z"], None) == ["x", "y", "z"]


def test_the_parameter_server_lives_where_the_bandwidth_is() -> None:
    links = LinkTable.build(
        [LinkSpec("a", "b", 10, 1), LinkSpec("b", "c", 1000, 1), LinkSpec("a", "c", 10, 1)]
    )
    assert ps_host(["a", "b", "c"], links) in ("b", "c")
    assert ps_host(["a", "b", "c"], None) == "a"


def test_stale_updates_are_down_weighted_not_dropped() -> None:
    assert staleness_weight(2, 2) == 1.0
    assert staleness_weight(5, 2) == pytest.approx(0.5)
    assert 0.0 < staleness_weight(1000, 0) < 0.01


def test_parameter_server_counts_versions_and_down_weights_stale_pushes() -> None:
    pieces = [Piece("w", 0, 3, (3,))]
    server = ParameterServer(torch.zeros(3), {"a": 0.5, "b": 0.5}, 1, pieces)
    views = {"a": torch.zeros(3), "b": torch.zeros(3)}

    def push(cluster: str, base: int) -> int:
        payload = encode(
            parse_compression("none"), make_compressor("none"), ["w"], [torch.full((3,), -2.0)], {}
        )
        pull, version, slowest = server.push(cluster, payload, base, 0.01)
        assert slowest == 0.01
        # what comes back is the change since this cluster's previous pull
        views[cluster] += decode("", pull, {"none": make_compressor("none")}).tensors[0]
        return version

    assert push("a", 0) == 1 and torch.allclose(views["a"], torch.ones(3))  # share 0.5 of +2
    push("b", 0)
    push("b", 0)  # made from version 0 at version 2: 2 > S=1, weight 2/3
    assert push("a", 0) == 4  # 3 stale: weight 2/4
    expected = torch.full((3,), 1.0 + 1.0 + 2 / 3 + 0.5)
    assert torch.allclose(views["a"], expected) and torch.allclose(server.final(), expected)
    assert torch.allclose(views["b"], torch.full((3,), 1.0 + 1.0 + 2 / 3))
    assert server.stats() == (4, 2, 3)


def test_label_split_is_non_iid_disjoint_and_complete() -> None:
    y = torch.arange(100) % 10
    parts = split_by_label(y, ["a", "b", "c"])
    labels = {c: {int(v) for v in y[i]} for c, i in parts.items()}
    assert labels == {"a": {0, 3, 6, 9}, "b": {1, 4, 7}, "c": {2, 5, 8}}
    joined = torch.cat(list(parts.values())).sort().values
    assert torch.equal(joined, torch.arange(100))
    # fewer labels than clusters: contiguous parts, still disjoint and complete
    two = split_by_label(torch.tensor([0, 1] * 5), ["a", "b", "c"])
    assert sorted(int(i) for p in two.values() for i in p) == list(range(10))


class _Counted(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A dataset that remembers which samples were read."""

    def __init__(self, n: int) -> None:
        self.n, self.read = n, set[int]()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.read.add(i)
        return torch.full((2,), float(i)), torch.tensor(i % 3)


def _task(**hooks: object) -> Task:
    data = _Counted(30)
    return Task(lambda: torch.nn.Linear(2, 3), torch.nn.functional.cross_entropy, data, data,
                OptimizerSpec(), **hooks)  # type: ignore[arg-type]  # fmt: skip


def test_a_cluster_reads_only_its_own_samples() -> None:
    clusters = ["a", "b", "c"]
    # indices the task names: a Dataset is read there and nowhere else
    task = _task(cluster_data=lambda c, cs: range(cs.index(c), 30, 3))
    _, y = local_samples(task, "b", clusters)
    assert task.train.read == set(range(1, 30, 3)) and set(y.tolist()) == {1}  # type: ignore[union-attr]
    # samples loaded where they live: `train` is never read
    task = _task(cluster_train=lambda c, cs: (torch.zeros(4, 2), torch.full((4,), 2)))
    _, y = local_samples(task, "c", clusters)
    assert len(y) == 4 and task.train.read == set()  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="cluster_train gave cluster 'c' no samples"):
        local_samples(
            _task(cluster_train=lambda c, cs: (torch.zeros(0, 2), torch.zeros(0))), "c", clusters
        )
    # no hook: the whole set is read, then split by label as before
    _, y = local_samples(_task(), "a", clusters)
    assert set(y.tolist()) == {0} and len(y) == 10


def test_the_outer_step_is_diloco_s_on_shared_data_the_plain_average_on_local_data() -> None:
    assert TrainSpec().outer_settings == (0.7, 0.5)
    assert TrainSpec(data="local").outer_settings == (1.0, 0.0)
    assert TrainSpec(data="local", outer_momentum=0.5).outer_settings == (1.0, 0.5)
    assert TrainSpec(outer_lr=0.3).outer_settings == (0.3, 0.5)
    assert TrainSpec(sync="partial:16").outer_settings == (0.7, 0.9)  # normalised rounds
    assert TrainSpec(sync="partial:16", data="local").outer_settings == (1.0, 0.0)
    with pytest.raises(ValueError, match="outer_momentum"):
        TrainSpec(data="local", outer_momentum=1.0).validate()


def test_spec_checks_slowdown_and_data() -> None:
    assert parse_slowdown("c:4, b:1.5") == {"c": 4.0, "b": 1.5}
    for bad in ("c", "c:0.5", "c:x", "c:2,c:3"):
        with pytest.raises(ValueError, match="CLUSTER:FACTOR"):
            parse_slowdown(bad)
    with pytest.raises(ValueError, match="slowdown: cluster 'z'"):
        TrainSpec(slowdown={"z": 2.0}).validate()
    with pytest.raises(ValueError, match="data: 'remote'"):
        TrainSpec(data="remote").validate()
    TrainSpec(sync="partial:4", slowdown={"b": 4.0}, data="local").validate()


def test_registry_builds_the_new_modes() -> None:
    model = torch.nn.Linear(3, 2)
    params = list(model.parameters())
    comm = Collective(
        rank=0,
        ranks_cluster=["a"],
        intra=None,
        leaders=None,
        names=[n for n, _ in model.named_parameters()],
        shapes=[p.shape for p in params],
        device=torch.device("cpu"),
        links=None,
    )
    for value, cls in (
        ("partial:4", PartialSync),
        ("async-ps:2", AsyncPSSync),
        ("gossip:2", GossipSync),
    ):
        ctx = SyncContext(TrainSpec(sync=value), comm, model, params, lambda f: None, 1.0)
        strategy = make_sync_strategy(parse_sync(value), ctx)
        assert isinstance(strategy, cls)
        assert strategy.exchanges_gradients is False
        assert strategy.local_steps(0) == 1


def test_regions_group_clusters_and_place_a_server_per_region_and_a_global_one() -> None:
    links = LinkTable.build(
        [LinkSpec("a", "b", 1000, 1), LinkSpec("b", "e", 1000, 1), LinkSpec("c", "d", 1000, 1)],
        mbps=10,
        rtt_ms=1,
    )
    regions = {"a": "eu", "b": "eu", "c": "us", "d": "us", "e": "eu"}
    groups = region_groups(["a", "b", "c", "d", "e"], regions)
    assert groups == {"eu": ["a", "b", "e"], "us": ["c", "d"]}
    assert region_groups(["a", "b"], {}) == {"": ["a", "b"]}  # no regions: flat
    # b has the most bandwidth inside eu; us's tie goes to c; the global server at b (tie)
    assert region_hosts(groups, links) == ("b", {"eu": "b", "us": "c"})
    TrainSpec(clusters={"a": 1, "b": 1}, regions={"a": "eu", "b": "us"}).validate()
    with pytest.raises(ValueError, match="regions: name the region of every cluster"):
        TrainSpec(clusters={"a": 1, "b": 1}, regions={"a": "eu"}).validate()


def test_local_data_barrier_period_keeps_worst_staleness_within_s() -> None:
    """(B + 1)(n - 1) <= S where the bound allows a period, else every tick."""
    from training.sync.async_ps import ticks_between_barriers

    assert ticks_between_barriers(4, 3) == 1
    assert ticks_between_barriers(16, 3) == 7 and (7 + 1) * 2 <= 16
    assert ticks_between_barriers(4, 8) == 1  # S below one tick of pushes: every tick
    assert ticks_between_barriers(4, 1) == 1
