"""Pure pieces of the runtime: data sharding, specs, link tables, checkpoint store, adaptivity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from grammar import Sync, SyncKind, parse_compression, parse_sync
from grammar.compression import message_bytes
from training.adaptive import choose
from training.checkpoint import DirectoryStore, open_store
from training.data import batch_indices, rank_weights, shard, shard_sizes
from training.placement import cluster_resource
from training.spec import TrainSpec, parse_clusters
from training.wan import Link, LinkTable, load_links_file, load_regions_file, ring_edges


def test_shards_cover_the_global_batch_exactly() -> None:
    idx = batch_indices(1000, 128, seed=3, step=17)
    assert len(idx) == 128 and len(set(idx.tolist())) == 128
    for world in (1, 3, 5, 7):
        parts = [shard(idx, r, world) for r in range(world)]
        assert torch.equal(torch.cat(parts), idx)
        assert sum(shard_sizes(128, world)) == 128


def test_batch_shares_split_by_weight_and_every_rank_gets_a_sample() -> None:
    # the plan's 94/6 split of H100 + T4: a cluster's share over its ranks
    weights = rank_weights({"h100": 0.94, "t4": 0.06}, ["h100", "h100", "t4"])
    assert weights == pytest.approx([0.47, 0.47, 0.06])
    sizes = shard_sizes(100, 3, weights)
    assert sum(sizes) == 100 and sizes == [47, 47, 6]
    idx = batch_indices(1000, 100, seed=1, step=2)
    assert torch.equal(torch.cat([shard(idx, r, 3, weights) for r in range(3)]), idx)
    assert shard_sizes(5, 3, [0.98, 0.01, 0.01]) == [3, 1, 1]  # a sample a rank at least
    assert rank_weights({}, ["a", "b"]) is None
    # a cluster that joined mid-run weighs as the named ones' ranks do on average
    assert rank_weights({"a": 0.75, "b": 0.25}, ["a", "b", "c"]) == pytest.approx([0.75, 0.25, 0.5])
    with pytest.raises(ValueError, match="batch_shares: 'z'"):
        TrainSpec(clusters={"a": 1}, batch_shares={"z": 1.0}).validate()
    with pytest.raises(ValueError, match="share > 0"):
        TrainSpec(clusters={"a": 1}, batch_shares={"a": 0.0}).validate()


def test_batches_depend_only_on_seed_and_step() -> None:
    assert torch.equal(batch_indices(500, 64, 1, 9), batch_indices(500, 64, 1, 9))
    assert not torch.equal(batch_indices(500, 64, 1, 9), batch_indices(500, 64, 2, 9))
    epoch = torch.cat([batch_indices(512, 64, 0, s) for s in range(8)])
    assert sorted(epoch.tolist()) == list(range(512))  # one epoch visits every sample once


def test_cluster_resource_is_one_function_and_rejects_bad_names() -> None:
    assert cluster_resource("eu-west_1") == "cpn-cluster-eu-west_1"
    with pytest.raises(ValueError, match="cluster name"):
        cluster_resource("bad name")


def test_parsers_name_the_fix() -> None:
    assert parse_clusters("a:2, b:1") == {"a": 2, "b": 1}
    assert parse_sync("local-sgd:8") == Sync(SyncKind.LOCAL_SGD, period=8)
    assert parse_sync("stale:2") == Sync(SyncKind.STALE, staleness=2)
    assert parse_sync("streaming:32") == Sync(SyncKind.STREAMING, 32, fragments=4, delay=7)
    assert str(parse_sync("streaming:8:d0")) == "streaming:8:f4:d0"
    assert str(parse_sync("adaptive")) == "adaptive"
    for bad, msg in [("a", "NAME:WORKERS"), ("a:0", "at least 1"), ("a:1,a:2", "twice")]:
        with pytest.raises(ValueError, match=msg):
            parse_clusters(bad)
    for bad in ("sometimes", "local-sgd:0", "stale:x", "streaming:4:f5", "streaming:4:d4"):
        with pytest.raises(ValueError, match="every-step"):
            parse_sync(bad)
    with pytest.raises(ValueError, match="resume"):
        TrainSpec(resume=True).validate()
    with pytest.raises(ValueError, match="links"):
        TrainSpec(links=[__import__("training").LinkSpec("a", "zz", 10, 1)]).validate()


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"sync": "sometimes"}, "sync 'sometimes'.*every-step"),
        ({"sync": "stale:1", "compression": "auto"}, "compression 'auto'.*local-sgd:H"),
        ({"compression": "topk:2"}, "compression 'topk:2'.*valid forms"),
        ({"sync": "adaptive", "compression": "gzip"}, "compression 'gzip'"),
        ({"sync": "adaptive", "adaptive_levels": ["none", "auto"]}, r"adaptive_levels\[1\]"),
        ({"sync": "adaptive", "adaptive_levels": []}, "adaptive_levels"),
    ],
)
def test_spec_validates_sync_and_compression_through_the_grammar(
    fields: dict[str, object], needle: str
) -> None:
    with pytest.raises(ValueError, match=needle):
        TrainSpec(**fields).validate()  # type: ignore[arg-type]


def test_spec_accepts_every_runnable_documented_value() -> None:
    from grammar import DOCUMENTED_COMPRESSIONS, DOCUMENTED_SYNCS

    for sync in DOCUMENTED_SYNCS:
        for compression in DOCUMENTED_COMPRESSIONS:
            spec = TrainSpec(sync=sync, compression=compression)
            auto_ok = sync.split(":")[0] in ("auto", "every-step", "local-sgd", "adaptive")
            if compression == "auto" and not auto_ok:  # the runtime's policy picks the rest
                with pytest.raises(ValueError, match="concrete compression"):
                    spec.validate()
            else:
                spec.validate()  # adaptive runs its levels, whatever `compression` says


def test_link_table_allgather_time_is_gloos_ring() -> None:
    from training.spec import LinkSpec

    table = LinkTable.build([LinkSpec("a", "b", 8.0, 20.0)], mbps=80.0, rtt_ms=10.0)
    assert table is not None
    assert ring_edges(["a", "b", "c"]) == [("a", "b"), ("b", "c"), ("c", "a")]
    assert ring_edges(["a"]) == []
    # a->b: 10 ms one way + 1e6 B at 8 Mbit/s = 1.01 s; b->c, c->a at the 80 Mbit/s default:
    # 0.105 s. Two rounds, each as slow as a->b, each after a 10 ms round of block sizes.
    t = table.allgather_time(["a", "b", "c"], 1_000_000)
    assert t == pytest.approx(2 * (0.01 + 0.01 + 1.0))
    # two clusters on the default link: one round of sizes (5 ms), one of the block
    assert table.allgather_time(["a", "c"], 1_000_000) == pytest.approx(0.005 + 0.105)
    assert table.slowest(["a", "b", "c"]) == Link(8e6, 0.02)
    assert LinkTable.build([], None, None) is None
    only_ab = LinkTable.build([LinkSpec("a", "b", 8.0, 20.0)])
    assert only_ab is not None and only_ab.allgather_time(["c", "d"], 10**6) == 0.0


def test_link_table_rounds_time_is_a_ring_all_reduce() -> None:
    from training.spec import LinkSpec

    table = LinkTable.build([LinkSpec("a", "b", 8.0, 20.0)], mbps=80.0, rtt_ms=10.0)
    assert table is not None
    # each round as slow as its slowest message: a->b 10 ms + 1e6 B at 8 Mbit/s = 1.01 s
    rounds = [{("a", "b"): 10**6, ("b", "c"): 10**6}, {("b", "c"): 10**6, ("c", "a"): 0}]
    assert table.rounds_time(rounds) == pytest.approx(1.01 + 0.105)
    assert table.rounds_time([]) == 0.0
    only_ab = LinkTable.build([LinkSpec("a", "b", 8.0, 20.0)])
    assert only_ab is not None and only_ab.rounds_time([{("c", "d"): 10**6}]) == 0.0


def test_pieces_of_a_flat_slice_name_their_parameter_and_place() -> None:
    from training.exchange import chunk_bounds, cut, param_pieces

    assert chunk_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert chunk_bounds(2, 3) == [(0, 1), (1, 2), (2, 2)]
    shapes = [torch.Size([2, 3]), torch.Size([4]), torch.Size([5])]
    whole = param_pieces(["w", "b", "c"], shapes, 0, 15)
    assert [(p.key, p.lo, p.hi, p.shape) for p in whole] == [
        ("w", 0, 6, (2, 3)),
        ("b", 6, 10, (4,)),
        ("c", 10, 15, (5,)),
    ]
    part = param_pieces(["w", "b", "c"], shapes, 4, 8)  # a fragment: flat [4, 12)
    assert [(p.key, p.lo, p.hi) for p in part] == [("w[4:6]", 0, 2), ("b", 2, 6), ("c[0:2]", 6, 8)]
    chunk = cut(whole, 5, 12)  # a ring chunk of the whole model
    assert [(p.key, p.lo, p.hi, p.shape) for p in chunk] == [
        ("w[5:6]", 0, 1, (1,)),
        ("b", 1, 5, (4,)),
        ("c[0:2]", 5, 7, (2,)),
    ]


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"outer_lr": 0.0}, "outer_lr: 0.0 must be a number > 0"),
        ({"outer_lr": float("inf")}, "outer_lr"),
        ({"outer_momentum": 1.0}, r"outer_momentum: 1.0 must be in \[0, 1\)"),
        ({"outer_momentum": -0.1}, "outer_momentum"),
    ],
)
def test_outer_optimizer_settings_are_validated(fields: dict[str, float], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        TrainSpec(**fields).validate()  # type: ignore[arg-type]
    TrainSpec(outer_lr=1.0, outer_momentum=0.0, outer_nesterov=False).validate()


def test_links_file(tmp_path: Path) -> None:
    f = tmp_path / "links.json"
    f.write_text(json.dumps({"links": [{"a": "x", "b": "y", "mbps": 100, "rtt_ms": 30}]}))
    [link] = load_links_file(f)
    assert (link.a, link.b, link.mbps, link.rtt_ms) == ("x", "y", 100.0, 30.0)
    f.write_text(json.dumps({"links": [{"a": "x", "mbps": 100}]}))
    with pytest.raises(ValueError, match=r"links\[0\]: missing field 'b'"):
        load_links_file(f)
    with pytest.raises(ValueError, match="cannot be read"):
        load_links_file(tmp_path / "nope.json")


def test_links_file_regions(tmp_path: Path) -> None:
    """The link table may say where each emulated cluster is (async-ps: a server per
    region); without it the run has one region."""
    f = tmp_path / "links.json"
    links = [{"a": "x", "b": "y", "mbps": 100}]
    f.write_text(json.dumps({"links": links}))
    assert load_regions_file(f) == {}
    f.write_text(json.dumps({"links": links, "regions": {"x": "eu", "y": "us"}}))
    assert load_regions_file(f) == {"x": "eu", "y": "us"}
    assert len(load_links_file(f)) == 1
    f.write_text(json.dumps({"links": links, "regions": ["eu", "us"]}))
    with pytest.raises(ValueError, match="regions: expected"):
        load_regions_file(f)


def test_checkpoint_store_latest_keep_and_file_uri(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}/ck")
    assert isinstance(store, DirectoryStore) and store.latest() is None
    for step in (5, 10, 15, 20):
        store.save(step, {"step": step, "w": torch.full((2,), float(step))})
    assert store.steps() == [10, 15, 20]  # keeps the newest three
    step, state = store.latest()  # type: ignore[misc]
    assert step == 20 and torch.equal(state["w"], torch.full((2,), 20.0))
    assert not list((tmp_path / "ck").glob(".tmp-*"))
    with pytest.raises(ValueError, match="scheme 'nope'"):
        open_store("nope://bucket/x")  # s3:// is an ObjectStore (test_checkpoint_store)


def test_adaptive_picks_lightest_level_that_hides_under_compute() -> None:
    levels = [parse_compression(v) for v in ("none", "bf16", "int8", "topk:0.01")]
    shapes = [(1000, 1000)]  # 4 MB in fp32
    fast = Link(10e9, 0.001)
    slow = Link(100e6, 0.03)
    assert str(choose(levels, {}, shapes, compute_s=0.1, link=fast)) == "none"
    # at 100 Mbit/s: fp32 0.32 s, bf16 0.16 s, int8 0.08 s, top-k 1% 0.005 s on the wire
    assert str(choose(levels, {}, shapes, compute_s=0.1, link=slow)) == "int8"
    assert str(choose(levels, {}, shapes, compute_s=0.05, link=slow)) == "topk:0.01"
    assert str(choose(levels, {}, shapes, compute_s=0.2, link=slow)) == "bf16"  # RTT not counted
    # three clusters: each block crosses the slowest ring edge twice (bf16 0.32 s > 0.2 s)
    assert str(choose(levels, {}, shapes, compute_s=0.2, link=slow, rounds=2)) == "int8"
    assert str(choose(levels, {}, shapes, compute_s=0.001, link=slow)) == "topk:0.01"
    # a measured size beats the estimate
    assert str(choose(levels, {"int8": 4_000_000}, shapes, compute_s=0.1, link=slow)) == "topk:0.01"
    assert message_bytes("powersgd:4", [(100, 50)]) == 4 * 4 * 150 + 16
    assert str(choose(levels, {}, shapes, compute_s=0.1, link=None)) == "none"


def test_mnist1d_is_generated_once_and_a_bad_cache_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from training.tasks.datasets import mnist1d_split

    generate = mnist1d_split.__wrapped__
    monkeypatch.setenv("CPN_CACHE_DIR", str(tmp_path))
    fresh = generate(7)
    (cached,) = tmp_path.glob("mnist1d-*-seed7.pt")
    assert all(torch.equal(a, b) for a, b in zip(fresh, generate(7), strict=True))
    assert len(fresh[0]) > 1000 and fresh[0].shape[1] == 40
    marked = (fresh[0] + 1, *fresh[1:])
    torch.save(marked, cached)
    assert torch.equal(generate(7)[0], marked[0])  # read from the file, not regenerated
    cached.write_bytes(b"half a file")
    assert all(torch.equal(a, b) for a, b in zip(fresh, generate(7), strict=True))
    assert torch.load(cached, weights_only=True)[0].shape == fresh[0].shape
    assert not list(tmp_path.glob("*.tmp"))
