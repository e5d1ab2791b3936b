"""The compressed exchange between cluster leaders over the (possibly emulated) WAN.

Three ways to sum one flat tensor (a gradient, a fragment's pseudo-gradient) over clusters:

- `ring` (compressors with `ring`: none, fp16/bf16, int8, int4/int2, top-k without momentum):
  a ring all-reduce. The tensor is cut into one chunk per leader; in n-1 reduce-scatter
  rounds each leader sends one chunk's partial sum (compressed, with error feedback per chunk
  piece) to the next leader, which adds its own; the leader that ends with a chunk's full sum
  compresses it once more and n-1 all-gather rounds relay those bytes unchanged around the
  ring, so every leader decodes the same bits. Each leader sends 2(n-1)/n of one compressed
  copy per exchange, whatever the number of clusters.
- `tree` (the same compressors, when the plan chose it: `TrainSpec.tree`): partial sums up a
  tree of leaders, the total down it (`LeaderExchange.tree`); 2 x depth hops.
- `gather` (PowerSGD, top-k with DGC momentum, sign): each leader compresses its whole tensor
  once into one message and all leaders all-gather the messages (gloo's ring of n-1 rounds
  over blocks padded to the longest), then sum them in cluster order.

Either way each leader's message carries a little shared information (`info`: compute time,
the previous exchange's time), and the bytes each directed link carried are counted exactly
(the same on every leader), which is what the interface counters of a real WAN show. With a
link table the exchange then waits until it has lasted as long as the links would have
needed, so one machine behaves like clusters in several datacenters.
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from grammar import Compression
from grammar.graph import tree_levels
from training.compression import Compressor, packet_from_bytes, packet_to_bytes
from training.results import Edge, ExchangeCounters, WanBytes
from training.wan import Link, LinkTable, Pacer, ring_edges

_HEADER = struct.Struct("<I")


@dataclass
class Message:
    """What one leader said in one message: its tensors plus a little shared information."""

    cluster: str
    compression: str
    tensors: list[torch.Tensor]
    info: dict[str, float]
    nbytes: int
    sizes: list[int] = field(default_factory=list)
    """Ring only: the bytes of the sender's reduce-scatter messages, round by round."""


@dataclass
class Exchanged:
    """The outcome of one exchange on one leader (the same on every leader)."""

    total: torch.Tensor
    """The sum over clusters, flat float32 on the CPU."""
    compression: Compression
    infos: list[dict[str, float]]
    """What each leader announced, in cluster order."""
    edge_bytes: int
    """The most bytes one directed link carried in this exchange."""


@dataclass(frozen=True)
class Piece:
    """A stretch [lo, hi) of a flat slice that lies inside one parameter.

    `key` names it for the compressor's per-key state: the parameter's name when the piece is
    the whole parameter (then `shape` is the parameter's shape, which PowerSGD needs), else
    `name[a:b]` with the piece's place inside the parameter (and a 1-D shape)."""

    key: str
    lo: int
    hi: int
    shape: tuple[int, ...]


def param_pieces(
    names: Sequence[str], shapes: Sequence[torch.Size], offset: int, length: int
) -> list[Piece]:
    """The pieces of the flat parameter slice [offset, offset + length), positions relative
    to the slice."""
    out: list[Piece] = []
    start = 0
    end = offset + length
    for name, shape in zip(names, shapes, strict=True):
        numel = shape.numel()
        lo, hi = max(start, offset), min(start + numel, end)
        if lo < hi:
            if lo == start and hi == start + numel:
                out.append(Piece(name, lo - offset, hi - offset, tuple(shape)))
            else:
                key = f"{name}[{lo - start}:{hi - start}]"
                out.append(Piece(key, lo - offset, hi - offset, (hi - lo,)))
        start += numel
    return out


def cut(pieces: Sequence[Piece], lo: int, hi: int) -> list[Piece]:
    """`pieces` restricted to [lo, hi), 1-D, positions relative to `lo`; a whole parameter cut
    short is keyed `key[a:b]` by its place in the piece."""
    out: list[Piece] = []
    for p in pieces:
        a, b = max(p.lo, lo), min(p.hi, hi)
        if a < b:
            whole = a == p.lo and b == p.hi
            key = p.key if whole else f"{p.key}[{a - p.lo}:{b - p.lo}]"
            out.append(Piece(key, a - lo, b - lo, (b - a,)))
    return out


def chunk_bounds(length: int, n: int) -> list[tuple[int, int]]:
    """n contiguous ranges covering [0, length), sizes differing by at most one."""
    base, extra = divmod(length, n)
    out, pos = [], 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        out.append((pos, pos + size))
        pos += size
    return out


def encode(
    compression: Compression,
    compressor: Compressor,
    keys: list[str],
    tensors: list[torch.Tensor],
    info: dict[str, float],
    sizes: list[int] | None = None,
) -> bytes:
    """One leader's message: a small JSON header, then each packet's serialised bytes."""
    blobs = [packet_to_bytes(compressor.compress(k, t)) for k, t in zip(keys, tensors, strict=True)]
    head: dict[str, Any] = {"c": str(compression), "n": [len(b) for b in blobs], "i": info}
    if sizes is not None:
        head["r"] = sizes
    header = json.dumps(head, separators=(",", ":")).encode()
    return _HEADER.pack(len(header)) + header + b"".join(blobs)


def decode(cluster: str, data: bytes, decompressors: dict[str, Compressor]) -> Message:
    (hlen,) = _HEADER.unpack_from(data, 0)
    header = json.loads(data[_HEADER.size : _HEADER.size + hlen])
    comp = decompressors[header["c"]]
    pos = _HEADER.size + hlen
    tensors = []
    for n in header["n"]:
        tensors.append(comp.decompress(packet_from_bytes(data[pos : pos + n])))
        pos += n
    return Message(cluster, header["c"], tensors, header["i"], len(data), header.get("r", []))


def all_gather_bytes(payload: bytes, group: Any) -> list[bytes]:
    """All-gather variable-length byte strings over a gloo group (sizes first, then padded)."""
    world = dist.get_world_size(group)
    size = torch.tensor([len(payload)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(int(s) for s in sizes))
    buf = torch.zeros(longest, dtype=torch.uint8)
    if payload:
        buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    bufs = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(bufs, buf, group=group)
    return [bytes(b[: int(s)].numpy().tobytes()) for b, s in zip(bufs, sizes, strict=True)]


SLICE_S = 0.005
"""A paced send's slice: this many seconds of its link's planned rate (16 KiB at least)."""


def _slices(data: torch.Tensor, link: Link | None) -> list[torch.Tensor]:
    """`data` cut into the slices a paced send of it over `link` is made of (sender and
    receiver cut alike: they see the same link); whole without a link."""
    if link is None or data.numel() == 0:
        return [data]
    size = max(16384, int(link.bandwidth_bps / 8 * SLICE_S))
    return list(torch.split(data, size))


def _wait_until(deadline: float, clock: Callable[[], float] = time.perf_counter) -> None:
    """Sleep until `clock()` reaches `deadline` (no wait once it has)."""
    left = deadline - clock()
    if left > 0:
        time.sleep(left)


def model_digest(model: torch.nn.Module) -> bytes:
    """SHA-256 of a model's state (names, dtypes, shapes, bytes): equal digests, equal start."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


class LeaderExchange:
    """Runs on a cluster leader; all leaders call its exchanges in the same order."""

    def __init__(self, clusters: list[str], me: str, group: Any) -> None:
        self.clusters = clusters
        self.me = me
        self.index = clusters.index(me)
        self.group = group
        # totals so far; replaced (never mutated) after each exchange, so a reader on another
        # thread (exchanges in the background) sees a consistent value
        self.counters = ExchangeCounters()
        self.pacer: Pacer | None = None
        """Set when the job reserved a share of this cluster's uplink: its sends keep to it."""
        self.sliced = False
        """Whether ring sends go in slices at their link's rate (`_shift`); the same on every
        leader of a job (sender and receiver must cut alike): a job with a reservation."""

    # ------------------------------------------------------------------ all-gather

    def gather(
        self,
        compression: Compression,
        compressor: Compressor,
        decompressors: dict[str, Compressor],
        flat: torch.Tensor,
        pieces: list[Piece],
        info: dict[str, float],
        links: LinkTable | None,
    ) -> Exchanged:
        """Send this cluster's `flat` (CPU float32) as one message, receive every cluster's
        and sum them in cluster order."""
        paced = self.pace()
        start = time.perf_counter()
        tensors = [flat[p.lo : p.hi].view(p.shape) for p in pieces]
        payload = encode(compression, compressor, [p.key for p in pieces], tensors, info)
        compressor.step()
        wire = time.perf_counter()
        datas = all_gather_bytes(payload, self.group)
        block = max(len(d) for d in datas)
        need = links.allgather_time(self.clusters, block) if links is not None else 0.0
        _wait_until(wire + need)  # the links' time after the encoding, before the decoding
        messages = [decode(c, d, decompressors) for c, d in zip(self.clusters, datas, strict=True)]
        total = torch.zeros(flat.numel(), dtype=torch.float32)
        for m in messages:
            for p, t in zip(pieces, m.tensors, strict=True):
                total[p.lo : p.hi] += t.reshape(-1).float()
        rounds = len(self.clusters) - 1
        sent = dict.fromkeys(ring_edges(self.clusters), rounds * block)
        self._finish(start, need, sent, flat.numel(), paced)
        infos = [m.info for m in messages]
        return Exchanged(total, compression, infos, rounds * block)

    # ------------------------------------------------------------------ ring all-reduce

    def _shift(self, payload: bytes, links: LinkTable | None) -> bytes:
        """Send `payload` to the next leader of the ring, receive the previous one's; with a
        link table, not before the link from the previous leader would have delivered it.

        Waiting round by round (not once per exchange) keeps each round's encoding and
        decoding in series with its transfer, as on a real WAN: one wait at the end hid the
        codec's time under the links' and made the emulation run well ahead of the testbed
        (measured: bench/results/emulation-25mbit.md)."""
        n = len(self.clusters)
        nxt, prv = (self.index + 1) % n, (self.index - 1) % n
        # the size, and when this leader began sending (the emulation's clock: one machine)
        head = torch.tensor([len(payload), time.monotonic_ns()], dtype=torch.int64)
        sends = [dist.isend(head, group=self.group, group_dst=nxt)]
        got = torch.zeros(2, dtype=torch.int64)
        dist.recv(got, group=self.group, group_src=prv)
        began = min(int(got[1]), time.monotonic_ns()) / 1e9  # never in the future
        out = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        buf = torch.empty(int(got[0]), dtype=torch.uint8)
        link = links.get(self.clusters[prv], self.me) if links is not None else None
        if self.sliced and links is not None:
            # A paced job sends in slices at its link's planned rate, so its bursts take no
            # more of a shared uplink than that (waiting after a burst would not keep a
            # burst from crowding out others' traffic)
            out_link = links.get(self.me, self.clusters[nxt])
            recvs = [
                dist.irecv(piece, group=self.group, group_src=prv) for piece in _slices(buf, link)
            ]
            start = time.perf_counter()
            done = 0
            for piece in _slices(out, out_link):
                if out_link is not None:
                    _wait_until(start + done * 8.0 / out_link.bandwidth_bps)
                sends.append(dist.isend(piece, group=self.group, group_dst=nxt))
                done += piece.numel()
            for work in recvs:
                if work is not None:
                    work.wait()
        else:
            sends.append(dist.isend(out, group=self.group, group_dst=nxt))
            dist.recv(buf, group=self.group, group_src=prv)
        for work in sends:
            if work is not None:
                work.wait()
        if link is not None:
            _wait_until(began + link.transfer_s(int(got[0])), time.monotonic)
        return bytes(buf.numpy().tobytes())

    def ring(
        self,
        compression: Compression,
        compressor: Compressor,
        decompressors: dict[str, Compressor],
        flat: torch.Tensor,
        pieces: list[Piece],
        info: dict[str, float],
        links: LinkTable | None,
    ) -> Exchanged:
        """Ring all-reduce of `flat` (CPU float32) in compressed chunks (module docstring)."""
        paced = self.pace()
        start = time.perf_counter()
        n, me = len(self.clusters), self.index
        bounds = chunk_bounds(flat.numel(), n)
        chunks = [cut(pieces, lo, hi) for lo, hi in bounds]
        acc = flat.clone()

        def parts(c: int, prefix: str) -> tuple[list[str], list[torch.Tensor]]:
            base = bounds[c][0]
            keys = [prefix + p.key for p in chunks[c]]
            return keys, [acc[base + p.lo : base + p.hi] for p in chunks[c]]

        def place(c: int, tensors: list[torch.Tensor], into: torch.Tensor, add: bool) -> None:
            base = bounds[c][0]
            for p, t in zip(chunks[c], tensors, strict=True):
                span = into[base + p.lo : base + p.hi]
                if add:
                    span += t.reshape(-1).float()
                else:
                    span.copy_(t.reshape(-1))

        # reduce-scatter: in round r leader i sends chunk i-r and adds what arrives to i-r-1
        rs_sizes: list[int] = []
        for r in range(n - 1):
            payload = encode(compression, compressor, *parts((me - r) % n, "rs:"), {})
            rs_sizes.append(len(payload))
            received = decode("", self._shift(payload, links), decompressors)
            place((me - r - 1) % n, received.tensors, acc, add=True)
        # all-gather: leader i holds the full sum of chunk i+1; its bytes go round unchanged
        own = (me + 1) % n
        payloads = {own: encode(compression, compressor, *parts(own, "ag:"), info, rs_sizes)}
        compressor.step()
        forward = payloads[own]
        for r in range(n - 1):
            forward = self._shift(forward, links)
            payloads[(me - r) % n] = forward
        total = torch.zeros(flat.numel(), dtype=torch.float32)
        messages: dict[int, Message] = {}
        for c, data in payloads.items():
            owner = (c - 1) % n
            messages[owner] = decode(self.clusters[owner], data, decompressors)
            place(c, messages[owner].tensors, total, add=False)
        # bytes per directed link, round by round: the same bookkeeping on every leader
        edges = ring_edges(self.clusters)
        rounds: list[dict[Edge, int]] = []
        for r in range(n - 1):
            rounds.append({edges[j]: messages[j].sizes[r] for j in range(n)})
        for r in range(n - 1):
            rounds.append({edges[j]: len(payloads[(j + 1 - r) % n]) for j in range(n)})
        sent = self._finish_rounds(start, rounds, links, flat.numel(), paced)
        infos = [messages[j].info for j in range(n)]
        return Exchanged(total, compression, infos, max(sent.values()))

    # ------------------------------------------------------------------ tree all-reduce

    def _send_to(self, payload: bytes, to: int) -> list[Any]:
        """Start sending `payload` to leader `to`: its size and when it left, then its bytes."""
        head = torch.tensor([len(payload), time.monotonic_ns()], dtype=torch.int64)
        out = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return [
            dist.isend(head, group=self.group, group_dst=to),
            dist.isend(out, group=self.group, group_dst=to),
        ]

    def _recv_from(self, src: int, links: LinkTable | None) -> bytes:
        """What leader `src` sends (`_send_to`); with a link table, not before the link from
        it would have delivered it (hop by hop, as `_shift` does)."""
        got = torch.zeros(2, dtype=torch.int64)
        dist.recv(got, group=self.group, group_src=src)
        began = min(int(got[1]), time.monotonic_ns()) / 1e9  # never in the future
        buf = torch.empty(int(got[0]), dtype=torch.uint8)
        dist.recv(buf, group=self.group, group_src=src)
        link = links.get(self.clusters[src], self.me) if links is not None else None
        if link is not None:
            _wait_until(began + link.transfer_s(int(got[0])), time.monotonic)
        return bytes(buf.numpy().tobytes())

    def tree(
        self,
        compression: Compression,
        compressor: Compressor,
        decompressors: dict[str, Compressor],
        flat: torch.Tensor,
        pieces: list[Piece],
        info: dict[str, float],
        links: LinkTable | None,
        parents: dict[str, str],
    ) -> Exchanged:
        """Tree all-reduce of `flat` (CPU float32) over `parents` (`grammar.graph.
        reduction_tree`: every cluster's parent, the root has none): each leader adds what its
        children send to its own, compresses that once (error feedback per piece, as the
        ring's partial sums) and sends it to its parent; the root compresses the total once
        and it goes down the tree unchanged, so every leader decodes the same bits. Each up
        message carries its subtree's announcements and message sizes, so every leader ends
        with every leader's `info` and every link's bytes. 2 x depth hops, against the
        ring's 2(n-1): ahead where latency dominates, behind where bandwidth does (a node
        sends and receives whole copies)."""
        paced = self.pace()
        start = time.perf_counter()
        index = {c: i for i, c in enumerate(self.clusters)}
        kids = [c for c, p in parents.items() if p == self.me]
        keys = [p.key for p in pieces]
        acc = flat.clone()
        said = {f"{self.me}\t{k}": v for k, v in info.items()}  # the subtree's infos, sizes
        for kid in kids:
            data = self._recv_from(index[kid], links)
            up = decode(kid, data, decompressors)
            for p, t in zip(pieces, up.tensors, strict=True):
                acc[p.lo : p.hi] += t.reshape(-1).float()
            said.update(up.info)
            said[f"{kid}\t^bytes"] = float(len(data))
        sends: list[Any] = []
        parent = parents.get(self.me)
        if parent is not None:
            tensors = [acc[p.lo : p.hi].view(p.shape) for p in pieces]
            up_bytes = encode(compression, compressor, ["up:" + k for k in keys], tensors, said)
            sends += self._send_to(up_bytes, index[parent])
            down = self._recv_from(index[parent], links)
        else:
            tensors = [acc[p.lo : p.hi].view(p.shape) for p in pieces]
            down = encode(compression, compressor, ["down:" + k for k in keys], tensors, said)
        compressor.step()
        for kid in kids:
            sends += self._send_to(down, index[kid])
        for work in sends:
            if work is not None:
                work.wait()
        message = decode("", down, decompressors)
        total = torch.zeros(flat.numel(), dtype=torch.float32)
        for p, t in zip(pieces, message.tensors, strict=True):
            total[p.lo : p.hi] = t.reshape(-1).float()
        heard: dict[str, dict[str, float]] = {c: {} for c in self.clusters}
        for key, value in message.info.items():
            who, _, what = key.partition("\t")
            heard[who][what] = value
        levels = tree_levels(parents)
        rounds: list[dict[Edge, int]] = [
            {(c, parents[c]): int(heard[c]["^bytes"]) for c in level} for level in levels[::-1]
        ] + [{(parents[c], c): len(down) for c in level} for level in levels]
        sent = self._finish_rounds(start, rounds, links, flat.numel(), paced)
        infos = [{k: v for k, v in heard[c].items() if k != "^bytes"} for c in self.clusters]
        return Exchanged(total, compression, infos, max(sent.values()))

    # ------------------------------------------------------------------ bookkeeping

    def pace(self) -> float:
        """Wait until the job's reservation lets this leader's next exchange begin; the
        seconds waited (0 without a reservation)."""
        if self.pacer is None:
            return 0.0
        wait = self.pacer.wait_s(time.perf_counter())
        if wait > 0:
            time.sleep(wait)
        return wait

    def sent_by_me(self, start: float, sent: dict[Edge, int]) -> None:
        """Count this leader's bytes of an exchange that began at `start` against its
        reservation."""
        if self.pacer is not None:
            mine = sum(n for (src, _), n in sent.items() if src == self.me)
            self.pacer.sent(start, mine * 8.0)

    def _finish_rounds(
        self,
        start: float,
        rounds: list[dict[Edge, int]],
        links: LinkTable | None,
        numel: int,
        paced: float,
    ) -> dict[Edge, int]:
        """`_finish` an exchange made of `rounds` (bytes per directed link, round by round:
        the same on every leader); the bytes each link carried in all."""
        sent: dict[Edge, int] = {}
        for rnd in rounds:
            for edge, nbytes in rnd.items():
                sent[edge] = sent.get(edge, 0) + nbytes
        need = links.rounds_time(rounds) if links is not None else 0.0
        self._finish(start, need, sent, numel, paced)
        return sent

    def _finish(
        self, start: float, need: float, sent: dict[Edge, int], numel: int, paced: float
    ) -> None:
        """Wait out what the emulated links would still need, then add this exchange to the
        counters."""
        _wait_until(start + need)
        self.sent_by_me(start, sent)
        n = len(self.clusters)
        self.counters = self.counters + ExchangeCounters(
            wan_bytes=WanBytes(sent),
            raw_bytes=2 * (n - 1) * numel * 4,  # what a float32 ring all-reduce sends
            sent_bytes=sum(sent.values()),
            rounds=1,
            wall_s=time.perf_counter() - start,
            link_s=need,
            paced_s=paced,
        )

    def count_setup(self, sent: dict[Edge, int]) -> None:
        """Add bytes the start-up put on the links (digests; the model when starts differ)."""
        total = sum(sent.values())
        self.counters = self.counters + ExchangeCounters(
            wan_bytes=WanBytes(sent), sent_bytes=total, setup_bytes=total
        )
