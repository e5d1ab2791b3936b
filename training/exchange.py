"""The compressed exchange between cluster leaders over the (possibly emulated) WAN.

Each leader compresses its cluster's tensors, serialises them into one message with
`packet_to_bytes`, and all leaders all-gather the messages over their own gloo group. Gloo's
all-gather is a ring of n-1 rounds over blocks padded to the longest message, so each ring edge
(`ring_edges`) carries n-1 such blocks and no other link carries any: that is what is counted
per directed link, and what the interface counters of a real WAN show. With a link table, the
exchange then waits until it has lasted as long as the links would have needed
(`LinkTable.allgather_time`), so one machine behaves like clusters in several datacenters.
"""

from __future__ import annotations

import json
import struct
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from training.compression import Compressor, packet_from_bytes, packet_to_bytes
from training.wan import LinkTable, ring_edges

_HEADER = struct.Struct("<I")


@dataclass
class Message:
    """What one leader said in one exchange: its tensors plus a little shared information."""

    cluster: str
    compression: str
    tensors: list[torch.Tensor]
    info: dict[str, float]
    nbytes: int


@dataclass
class ExchangeCounters:
    """Cumulative totals over a run (all directed links; every leader sees the same sizes)."""

    wan_bytes: dict[str, int] = field(default_factory=dict)
    raw_bytes: int = 0
    sent_bytes: int = 0
    rounds: int = 0
    wall_s: float = 0.0
    link_s: float = 0.0  # what the links alone needed (emulated or not)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def encode(
    compression: str,
    compressor: Compressor,
    keys: list[str],
    tensors: list[torch.Tensor],
    info: dict[str, float],
) -> bytes:
    """One leader's message: a small JSON header, then each packet's serialised bytes."""
    blobs = [packet_to_bytes(compressor.compress(k, t)) for k, t in zip(keys, tensors, strict=True)]
    header = json.dumps(
        {"c": compression, "n": [len(b) for b in blobs], "i": info}, separators=(",", ":")
    ).encode()
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
    return Message(cluster, header["c"], tensors, header["i"], len(data))


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


class LeaderExchange:
    """Runs on a cluster leader; all leaders call `exchange` in the same order."""

    def __init__(self, clusters: list[str], me: str, group: Any) -> None:
        self.clusters = clusters
        self.me = me
        self.group = group
        self.counters = ExchangeCounters()

    def exchange(
        self,
        compression: str,
        compressor: Compressor,
        decompressors: dict[str, Compressor],
        keys: list[str],
        tensors: list[torch.Tensor],
        info: dict[str, float],
        links: LinkTable | None,
    ) -> list[Message]:
        """Send this cluster's tensors, receive every cluster's (in cluster order, self too)."""
        start = time.perf_counter()
        payload = encode(compression, compressor, keys, tensors, info)
        compressor.step()
        datas = all_gather_bytes(payload, self.group)
        messages = [decode(c, d, decompressors) for c, d in zip(self.clusters, datas, strict=True)]
        block = max(len(d) for d in datas)
        rounds = len(self.clusters) - 1
        sent = {edge: rounds * block for edge in ring_edges(self.clusters)}
        need = links.allgather_time(self.clusters, block) if links is not None else 0.0
        elapsed = time.perf_counter() - start
        if need > elapsed:  # the emulated WAN: wait out what the links would still need
            time.sleep(need - elapsed)
        c = self.counters
        for (src, dst), n in sent.items():
            key = f"{src}->{dst}"
            c.wan_bytes[key] = c.wan_bytes.get(key, 0) + n
        raw = sum(t.numel() * 4 for t in tensors)
        peers = len(self.clusters) - 1
        c.raw_bytes += raw * peers * len(self.clusters)
        c.sent_bytes += sum(sent.values())
        c.rounds += 1
        c.link_s += need
        c.wall_s += time.perf_counter() - start
        return messages
