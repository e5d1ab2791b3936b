"""A job's WAN sends keep to its reservation (issue 49): the token bucket of the exchange and
of async-ps's pushes.

`Pacer` is pure (times in, waits out); the exchange test runs it on real gloo leaders in
spawned processes: with a reservation the leaders' sends average no more than it (one
exchange of burst), without one the same exchanges run as fast as the loopback allows.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

import training
from tests.training.test_ring import NONE, NUMEL, _collective, _contribution, _spawn
from training import TrainSpec
from training.runner import WorkerPool
from training.wan import Pacer

EXCHANGES = 8
RATE_KBPS = 800  # one fp32 exchange of the test's model is ~42 kbit: ~50 ms at this rate


def test_a_job_that_keeps_to_its_plan_never_waits() -> None:
    pacer = Pacer(1000.0)  # 1 kbit/s; each exchange below sends 500 bits, one every second
    for k in range(5):
        assert pacer.wait_s(float(k)) == 0.0
        pacer.sent(float(k), 500.0)


def test_back_to_back_exchanges_wait_for_the_rate_after_one_burst() -> None:
    pacer = Pacer(1000.0)
    now = 0.0
    waits = []
    for _ in range(5):  # each exchange sends 1000 bits (1 s at the rate) and takes no time
        wait = pacer.wait_s(now)
        waits.append(wait)
        now += wait
        pacer.sent(now, 1000.0)
    assert waits == [0.0, 1.0, 1.0, 1.0, 1.0]  # the first is the burst
    assert now == pytest.approx(4.0)  # 5 exchanges' bits, less the burst's, at the rate


def test_a_rate_must_be_positive() -> None:
    with pytest.raises(ValueError, match="rate must be > 0"):
        Pacer(0.0)


def _paced_rank(rank: int, ranks_cluster: list[str], port: int, out: str) -> None:
    import torch.distributed as dist

    found: dict[str, Any] = {}
    for name, kbps in (("free", None), ("paced", RATE_KBPS)):
        comm = _collective(rank, ranks_cluster, port + (1 if kbps else 0), kbps)
        start = time.perf_counter()
        for s in range(EXCHANGES):
            comm.wan_exchange(_contribution(rank, s), s, NONE)
        me = ranks_cluster[rank]
        found[name] = {
            "wall_s": time.perf_counter() - start,
            "bits": 8 * sum(n for (src, _), n in comm.counters.wan_bytes.items() if src == me),
            "paced_s": comm.counters.paced_s,
        }
        dist.destroy_process_group()
    torch.save(found, Path(out) / f"rank{rank}.pt")


def test_leaders_sends_average_no_more_than_the_reservation(tmp_path: Path) -> None:
    found = _spawn(_paced_rank, ["a", "b"], tmp_path)
    rate = RATE_KBPS * 1e3
    for rank in found:
        paced, free = rank["paced"], rank["free"]
        burst = paced["bits"] / EXCHANGES
        assert paced["bits"] >= EXCHANGES * 4 * NUMEL * 8 / 2  # each sent its half, fp32
        # all but the burst's bits at the reservation, at least
        assert paced["wall_s"] >= (paced["bits"] - burst) / rate * 0.999
        assert paced["paced_s"] > 0.0
        assert free["paced_s"] == 0.0
        assert free["wall_s"] < paced["wall_s"] / 2  # unpaced: the loopback's speed


SLICED_MBPS = 20.0


def _sliced_rank(rank: int, ranks_cluster: list[str], port: int, out: str) -> None:
    import torch.distributed as dist

    from training.spec import LinkSpec
    from training.wan import LinkTable

    clusters = list(dict.fromkeys(ranks_cluster))
    table = LinkTable.build(
        [
            LinkSpec(a, b, SLICED_MBPS, 0.0)
            for i, a in enumerate(clusters)
            for b in clusters[i + 1 :]
        ]
    )
    comm = _collective(rank, ranks_cluster, port, 10**6, table)  # a reservation, not binding
    start = time.perf_counter()
    totals = [comm.wan_exchange(_contribution(rank, s), s, NONE).total for s in range(3)]
    me = ranks_cluster[rank]
    found = {
        "totals": totals,
        "wall_s": time.perf_counter() - start,
        "bytes": sum(n for (src, _), n in comm.counters.wan_bytes.items() if src == me),
    }
    dist.destroy_process_group()
    torch.save(found, Path(out) / f"rank{rank}.pt")


def test_a_paced_ring_sends_in_slices_at_the_planned_rate_and_sums_exactly(
    tmp_path: Path,
) -> None:
    """Three leaders on 20 Mbit/s links, ring messages sent in slices (receivers cut them
    alike): the sums are the exact ones, the same bits on every leader, and no faster than
    the links. That slices keep a burst off others' traffic shows on the shaped testbed
    (`bench.wan_share`), not on the loopback."""
    found = _spawn(_sliced_rank, ["a", "b", "c"], tmp_path)
    exact = [torch.stack([_contribution(r, s) for r in range(3)]).sum(0) for s in range(3)]
    for rank in found:
        for got, want, first in zip(rank["totals"], exact, found[0]["totals"], strict=True):
            assert torch.equal(got, first)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert rank["wall_s"] >= rank["bytes"] * 8 / (SLICED_MBPS * 1e6) * 0.999


PS_STEPS = 24
PS_RATE_KBPS = 500  # an int8 push of the MNIST-1D MLP is ~0.19 Mbit: ~0.4 s each at this rate


@pytest.mark.usefixtures("ray_session")
def test_async_ps_pushes_keep_to_the_reservation() -> None:
    """A spoke's pushes to the parameter server are its WAN sends: with a reservation they
    average no more than it (one push of burst); without one the same run pushes as fast as
    the loopback allows."""

    def run(kbps: int | None) -> training.TrainReport:
        spec = TrainSpec(
            task="builtin:mnist1d-mlp",
            clusters={"a": 1, "b": 1},
            sync="async-ps:4",
            compression="int8",
            steps=PS_STEPS,
            eval_every=PS_STEPS,
            wan_kbps=dict.fromkeys(("a", "b"), kbps) if kbps else {},
        )
        return training.run(spec, pool=pool)

    pool = WorkerPool()
    try:
        free, paced = run(None), run(PS_RATE_KBPS)
    finally:
        pool.close()
    # the spoke's pushes and the host's pulls, each paced by the push it answers
    bits = 8 * min(n for n in paced.wan_bytes.values() if n > 0)
    burst = bits / PS_STEPS * 2  # a push, with room for one of another size
    at_rate = (bits - burst) / (PS_RATE_KBPS * 1e3)
    assert bits >= PS_STEPS * 23_000 * 8 / 2  # every tick pushed int8 parameters
    assert paced.wall_s >= at_rate
    assert free.wall_s < at_rate / 2


class _GlobalServer:
    """The global server's `push` as a Ray call that has already answered."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.push = self

    def remote(self, *args: Any) -> Any:
        import ray

        return ray.put(self.server.push(*args))


@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize(
    ("rate_bps", "ticks", "expected"), [(None, 1, 11), (1000.0, 1, 2), (None, 3, 4)]
)
def test_a_regional_servers_exchanges_keep_to_its_hosts_reservation(
    rate_bps: float | None, ticks: int, expected: int
) -> None:
    """HALoS's regional server exchanges with the global one out of its host's uplink: with
    a reservation it sends once (its burst) in a second of pushes, each exchange's bits
    taking many seconds at the rate, and sums the region's progress into its next one;
    without, it sends after every push whose answer has come back, or every `ticks` pushes
    where the plan says so (`TrainSpec.relay_ticks`), though each answer came back at once."""
    from grammar import parse_compression
    from training.compression import make_compressor
    from training.exchange import encode, param_pieces
    from training.sync.async_ps import ParameterServer, RegionalServer

    params = torch.zeros(64)
    pieces = param_pieces(["w"], [torch.Size([64])], 0, 64)
    compression = parse_compression("none")
    region = RegionalServer(
        params,
        {"a": 1.0},
        4,
        pieces,
        region="eu",
        host="a",
        global_host="g",
        global_server=_GlobalServer(ParameterServer(params, {"eu": 1.0}, 4, pieces)),
        compression=compression,
        link=None,
        rate_bps=rate_bps,
        ticks=ticks,
    )
    coder = make_compressor(compression)
    for _ in range(10):
        update = encode(compression, coder, ["w"], [torch.full((64,), 0.01)], {})
        region.push("a", update, region.version, 0.1)
    sent, exchanges = region.flush()
    # unpaced: one after each push (the last one's with the flush's) and the flush's own;
    # paced: the first push's (the burst) and the flush's; every 3 ticks: after pushes 3, 6
    # and 9, and the flush's
    assert exchanges == expected
    assert sent[("a", "g")] > 0
    assert torch.allclose(region.params, torch.full((64,), -0.1))  # no progress lost
