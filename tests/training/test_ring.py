"""The exchange between cluster leaders as a ring all-reduce, and the start-up check.

Real processes joined by real gloo groups (one per leader, spawned), and on real Ray: the sum
is right and the same bits on every leader, the bytes each leader sends stay at 2(n-1)/n of
one (compressed) copy of the model whatever the number of clusters, and the model crosses the
WAN at start-up only when the workers did not build the same one.
"""

from __future__ import annotations

import multiprocessing
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

import training
from grammar import Compression, CompressionKind, parse_compression
from training import TrainSpec
from training.runner import WorkerPool
from training.worker import free_port

SHAPES = [torch.Size([40, 30]), torch.Size([30]), torch.Size([7, 3, 3])]
NAMES = ["w", "b", "k"]
NUMEL = sum(s.numel() for s in SHAPES)
NONE = Compression(CompressionKind.NONE)


def _collective(
    rank: int,
    ranks_cluster: list[str],
    port: int,
    reserved_kbps: int | None = None,
    links: Any = None,
    tree: dict[str, str] | None = None,
) -> Any:
    import torch.distributed as dist

    from training.collective import Collective

    torch.set_num_threads(1)
    world = len(ranks_cluster)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    clusters = list(dict.fromkeys(ranks_cluster))
    intra = None
    for c in clusters:  # every rank creates every group, in the same order (as the Worker)
        group = dist.new_group([r for r, x in enumerate(ranks_cluster) if x == c])
        if c == ranks_cluster[rank]:
            intra = group
    leaders = dist.new_group([ranks_cluster.index(c) for c in clusters])
    return Collective(
        rank=rank,
        ranks_cluster=ranks_cluster,
        intra=intra,
        leaders=leaders,
        names=NAMES,
        shapes=SHAPES,
        device=torch.device("cpu"),
        links=links,
        reserved_kbps=reserved_kbps,
        paced=reserved_kbps is not None,
        tree=tree,
    )


def _contribution(rank: int, step: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(1000 * step + rank))


def _ring_rank(rank: int, ranks_cluster: list[str], port: int, out: str) -> None:
    import torch.distributed as dist

    comm = _collective(rank, ranks_cluster, port)
    found: dict[str, Any] = {}
    for level in ("none", "int4", "topk:0.1:m0", "powersgd:2"):
        before = comm.counters.sent_bytes
        value = parse_compression(level)
        totals = [comm.wan_exchange(_contribution(rank, s), s, value) for s in range(3)]
        found[level] = {
            "totals": [t.total for t in totals],
            "infos": totals[-1].infos,
            "sent": (comm.counters.sent_bytes - before) / 3,
            "ring": comm.uses_ring(value),
        }
    # a fragment: flat positions [1000, 1210) of the model, keyed by its pieces
    found["fragment"] = comm.wan_sum(torch.full((210,), float(rank)), 0, NONE, 1000)
    found["edges"] = dict(comm.counters.wan_bytes)
    dist.destroy_process_group()
    torch.save(found, Path(out) / f"rank{rank}.pt")


def _spawn(target: Any, ranks_cluster: list[str], out: Path) -> list[dict[str, Any]]:
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=target, args=(r, ranks_cluster, port, str(out)))
        for r in range(len(ranks_cluster))
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
        assert p.exitcode == 0, f"rank process ended with {p.exitcode}"
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(len(procs))]


def test_ring_all_reduce_sums_and_every_leader_gets_the_same_bits(tmp_path: Path) -> None:
    n = 3
    found = _spawn(_ring_rank, ["a", "b", "c"], tmp_path)
    exact = [torch.stack([_contribution(r, s) for r in range(n)]).sum(0) for s in range(3)]
    for level in ("none", "int4", "topk:0.1:m0", "powersgd:2"):
        first = found[0][level]
        for other in found[1:]:  # the same bits everywhere, whatever the compressor
            for a, b in zip(first["totals"], other[level]["totals"], strict=True):
                assert torch.equal(a, b), level
        assert len(first["infos"]) == n  # every leader's announcement reached every leader
    assert all(found[0][lv]["ring"] for lv in ("none", "int4", "topk:0.1:m0"))
    assert not found[0]["powersgd:2"]["ring"]  # all-gathered
    for got, want in zip(found[0]["none"]["totals"], exact, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # int4 in the ring: three rounds of rounding noise (error feedback carries it to the next
    # exchange), well below the sum itself
    for got, want in zip(found[0]["int4"]["totals"], exact, strict=True):
        assert float((got - want).norm() / want.norm()) < 0.5
    # a fragment of the model sums like the rest
    torch.testing.assert_close(found[0]["fragment"], torch.full((210,), 0.0 + 1 + 2))
    # bytes each leader sends per exchange: 2(n-1)/n of one copy (plus headers), where an
    # all-gather sends n-1 copies; the ring's edges carry them, no other link does
    fp32 = 4 * NUMEL
    for rank in range(n):
        assert 2 * (n - 1) / n * fp32 <= found[rank]["none"]["sent"] / n <= 4 / 3 * fp32 + 600
        int4 = found[rank]["int4"]["sent"] / n
        assert int4 <= 4 / 3 * (NUMEL * 4.125 / 8) + 600
    assert set(found[0]["edges"]) == {("a", "b"), ("b", "c"), ("c", "a")}


def _start_rank(rank: int, ranks_cluster: list[str], port: int, out: str) -> None:
    import torch.distributed as dist

    comm = _collective(rank, ranks_cluster, port)
    results = {}
    for name, seed in (("same", 0), ("differ", rank)):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(20, 10), torch.nn.BatchNorm1d(10))
        before = comm.counters.setup_bytes
        sent = comm.align_start(model)
        results[name] = {
            "sent": sent,
            "bytes": comm.counters.setup_bytes - before,
            "state": {k: v.clone() for k, v in model.state_dict().items()},
        }
    dist.destroy_process_group()
    torch.save(results, Path(out) / f"rank{rank}.pt")


TREE = {"b": "a", "c": "a", "d": "b"}  # a at the root, d two hops down


def _tree_rank(rank: int, ranks_cluster: list[str], port: int, out: str) -> None:
    import torch.distributed as dist

    comm = _collective(rank, ranks_cluster, port, tree=TREE)
    found: dict[str, Any] = {"collective": comm.collective}
    for level in ("none", "int8", "powersgd:2"):
        before = dict(comm.counters.wan_bytes)
        value = parse_compression(level)
        done = [comm.wan_exchange(_contribution(rank, s), s, value) for s in range(3)]
        after = dict(comm.counters.wan_bytes)
        found[level] = {
            "totals": [d.total for d in done],
            "infos": done[-1].infos,
            "edges": {e: (after[e] - before.get(e, 0)) / 3 for e in after},
        }
    dist.destroy_process_group()
    torch.save(found, Path(out) / f"rank{rank}.pt")


def test_tree_all_reduce_sums_up_the_tree_and_every_leader_gets_the_same_bits(
    tmp_path: Path,
) -> None:
    """Partial sums go up the plan's tree and the total comes down it: exact uncompressed,
    the same bits on every leader compressed, every announcement everywhere, and the bytes of
    each tree edge counted alike on every leader (whole copies up and down; no other link).
    A compressor that cannot sum in a ring all-gathers as always."""
    n = 4
    found = _spawn(_tree_rank, ["a", "b", "c", "d"], tmp_path)
    assert {f["collective"] for f in found} == {"tree"}
    exact = [torch.stack([_contribution(r, s) for r in range(n)]).sum(0) for s in range(3)]
    for got, want in zip(found[0]["none"]["totals"], exact, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    for level in ("none", "int8", "powersgd:2"):
        for other in found[1:]:
            for a, b in zip(found[0][level]["totals"], other[level]["totals"], strict=True):
                assert torch.equal(a, b), level
            assert other[level]["edges"] == found[0][level]["edges"], level
        infos = found[0][level]["infos"]
        assert len(infos) == n and all("compute" in i for i in infos), infos
    for got, want in zip(found[0]["int8"]["totals"], exact, strict=True):
        assert float((got - want).norm() / want.norm()) < 0.05
    edges = found[0]["none"]["edges"]
    tree_edges = set(TREE.items()) | {(p, c) for c, p in TREE.items()}
    assert set(edges) == tree_edges
    fp32 = 4 * NUMEL  # each message one whole copy (plus its header)
    assert all(fp32 <= v <= fp32 + 600 for v in edges.values()), edges
    down = {edges[(p, c)] for c, p in TREE.items()}
    assert len(down) == 1  # the root's total, relayed unchanged
    assert set(found[0]["powersgd:2"]["edges"]) != tree_edges  # all-gathered, on the ring


def test_the_model_crosses_at_start_up_only_when_workers_built_different_ones(
    tmp_path: Path,
) -> None:
    found = _spawn(_start_rank, ["a", "a", "b"], tmp_path)
    model_bytes = 4 * (20 * 10 + 10 + 10 + 10) + 4 * (10 + 10) + 8  # params, BN stats, count
    digests = 2 * 33  # two clusters: one round of 33 bytes each way
    for rank, f in enumerate(found):
        # same seed everywhere: digests only, no model
        assert f["same"]["sent"] is False
        if rank in (0, 2):  # leaders keep the counters
            assert f["same"]["bytes"] == digests
            # rank 1 built another model: everyone takes rank 0's, sent once to each leader
            assert f["differ"]["bytes"] == digests + model_bytes
        assert f["differ"]["sent"] is True
        for k, v in found[0]["differ"]["state"].items():
            assert torch.equal(f["differ"]["state"][k], v), k
    # and they really were different before (rank 1's own seed)
    torch.manual_seed(1)
    own = torch.nn.Linear(20, 10).weight
    assert not torch.equal(own, found[1]["differ"]["state"]["0.weight"])


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
def test_bytes_per_leader_stay_flat_as_clusters_are_added() -> None:
    """Uncompressed every-step on 2, 3 and 4 clusters: each leader sends 2(n-1)/n of the model
    per step (1, 1.33, 1.5 copies), never more than 2; an all-gather sent n-1 (1, 2, 3)."""
    steps = 2
    params = sum(
        t.numel() for t in training.tasks.load_task("builtin:mnist1d-mlp").model().parameters()
    )
    model = 4 * params
    pool = WorkerPool()  # the three runs share their clusters' warm workers
    try:
        reports = [
            training.run(
                TrainSpec(
                    task="builtin:mnist1d-mlp",
                    clusters=dict.fromkeys("abcd"[:n], 1),
                    steps=steps,
                    eval_every=steps,
                ),
                pool=pool,
            )
            for n in (2, 3, 4)
        ]
    finally:
        pool.close()
    for n, report in zip((2, 3, 4), reports, strict=True):
        clusters = dict.fromkeys("abcd"[:n], 1)
        assert report.wan_setup_bytes == n * (n - 1) * 33  # digests, not the model
        for leader in clusters:
            out = sum(b for (src, _), b in report.wan_bytes.items() if src == leader)
            per_step = (out - (n - 1) * 33) / steps
            assert 2 * (n - 1) / n * model <= per_step <= 2 * (n - 1) / n * model + 4096, n
            assert per_step < 2 * model


LATE_S = 1.0
"""How long the second leader "encodes" before it sends, in the emulated-link test."""
WIRE_S = 1.0
"""What the emulated link needs for the test's message."""


def _shift_rank(rank: int, ranks_cluster: list[str], port: int, out: str) -> None:
    import time

    import torch.distributed as dist

    from training.exchange import LeaderExchange
    from training.wan import LinkTable

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=60),
    )
    payload = bytes(10_000)
    links = LinkTable.build([], mbps=len(payload) * 8 / WIRE_S / 1e6)
    ring = LeaderExchange(["a", "b"], ranks_cluster[rank], dist.group.WORLD)
    dist.barrier()
    start = time.perf_counter()
    if rank == 1:
        time.sleep(LATE_S)  # its encoding: the link carries nothing meanwhile
    got = ring._shift(payload, links)  # the round under test
    took = time.perf_counter() - start
    dist.destroy_process_group()
    torch.save({"took": took, "got": len(got)}, Path(out) / f"rank{rank}.pt")


def test_an_emulated_round_delivers_after_the_sender_began_plus_the_link_time(
    tmp_path: Path,
) -> None:
    """Each ring round waits for its own bytes, counted from when the previous leader began
    sending: a leader still encoding delays what it sends, and bytes sent to a leader still
    encoding travel meanwhile, as on a real WAN. (One wait per
    exchange, counted from the exchange's start, hid the codec's time under the link's and
    made blocking DiLoCo 17 % faster emulated than on the testbed.)"""
    found = _spawn(_shift_rank, ["a", "b"], tmp_path)
    assert [f["got"] for f in found] == [10_000, 10_000]
    early, late = found[0]["took"], found[1]["took"]
    assert early >= LATE_S + WIRE_S * 0.95, early  # b's bytes left only after b encoded
    assert early < LATE_S + WIRE_S + 1.5, early
    # a's bytes left at once: they were on the way while b encoded, so b waits the rest only
    # (timed from b's own start it would take LATE_S + WIRE_S)
    assert WIRE_S * 0.95 <= late < LATE_S + WIRE_S / 2, late
