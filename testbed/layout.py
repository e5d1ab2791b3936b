"""Names, addresses and shaping parameters of a testbed: pure data, no I/O.

Everything the testbed creates carries a prefix (`cpntb`, or `CPN_TESTBED_PREFIX` so that a
benchmark and the test suite can each have a testbed at once), so `down` can find leftovers of a
crashed run by name alone. Addresses come from 10.77.0.0/24 and live only inside the testbed's
own namespaces (the hub holds the bridge; nothing is added to the host's namespace).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field


def _prefix() -> str:
    """Interface names hold the prefix plus up to 4 characters within Linux's 15."""
    prefix = os.environ.get("CPN_TESTBED_PREFIX", "cpntb")
    if not re.fullmatch(r"[a-z][a-z0-9]{0,10}", prefix):
        raise ValueError(
            f"CPN_TESTBED_PREFIX={prefix!r}: use 1-11 lowercase letters or digits, "
            "starting with a letter"
        )
    return prefix


PREFIX = _prefix()
HUB_NS = f"{PREFIX}-hub"
BRIDGE = "br0"  # inside the hub namespace
UPLINK_IF = "wan0"  # a datacenter's uplink, inside its namespace (gloo binds to it)
SUBNET = "10.77.0"
HUB_IP = f"{SUBNET}.1"
RAY_PORT = 6379
_NAME = re.compile(r"^[a-z][a-z0-9-]{0,19}$")


@dataclass(frozen=True)
class Datacenter:
    """One datacenter: its namespace, uplink rate (both directions) and Ray worker slots."""

    name: str
    index: int
    mbit: float
    workers: int

    @property
    def netns(self) -> str:
        return f"{PREFIX}-dc-{self.name}"

    @property
    def ip(self) -> str:
        return f"{SUBNET}.{10 + self.index}"

    @property
    def hub_if(self) -> str:
        """The hub-side end of the uplink (egress there = traffic into the datacenter)."""
        return f"{PREFIX}{self.index}h"


@dataclass(frozen=True)
class Layout:
    datacenters: list[Datacenter] = field(default_factory=list)

    @property
    def ray_address(self) -> str:
        return f"{HUB_IP}:{RAY_PORT}"

    def dc(self, name: str) -> Datacenter:
        for d in self.datacenters:
            if d.name == name:
                return d
        raise KeyError(name)


def parse_dcs(text: str, default_mbit: float, default_workers: int) -> Layout:
    """`a,b,c` or `a:100:2,b:1000:2` (NAME[:MBIT[:WORKERS]]); ValueError names the fix."""
    dcs: list[Datacenter] = []
    for i, part in enumerate(p.strip() for p in text.split(",") if p.strip()):
        bits = part.split(":")
        name = bits[0]
        if not _NAME.match(name):
            raise ValueError(
                f"datacenter {name!r}: use 1-20 lowercase letters, digits or '-', "
                "starting with a letter"
            )
        if any(d.name == name for d in dcs):
            raise ValueError(f"datacenter {name!r} is listed twice")
        if len(bits) > 3:
            raise ValueError(f"datacenter {part!r}: write NAME[:MBIT[:WORKERS]]")
        try:
            mbit = float(bits[1]) if len(bits) > 1 and bits[1] else default_mbit
            workers = int(bits[2]) if len(bits) > 2 else default_workers
        except ValueError:
            raise ValueError(
                f"datacenter {part!r}: MBIT must be a number and WORKERS an integer"
            ) from None
        if mbit <= 0:
            raise ValueError(f"datacenter {part!r}: uplink rate must be > 0 Mbit/s")
        if workers < 1:
            raise ValueError(f"datacenter {part!r}: needs at least 1 worker slot")
        dcs.append(Datacenter(name, i + 1, mbit, workers))
    if not dcs:
        raise ValueError("datacenters: name at least one, e.g. a,b or a:100:2,b:100:2")
    if len(dcs) > 200:
        raise ValueError("datacenters: at most 200")
    return Layout(dcs)


def tbf_args(mbit: float) -> list[str]:
    """Token-bucket parameters for a rate: a bucket of 1 ms of traffic (at least two full
    frames; tbf cuts larger GSO frames to fit) and a queue of 100 ms, deep enough that TCP is
    not driven into loss-recovery (which would put retransmitted bytes on the counters).

    The bucket is what a WAN link lacks: a deeper one lets each message smaller than it pass
    at memory speed once the bucket has refilled between exchanges, which made the links of
    small models free (a 10 ms bucket at 100 Mbit/s holds 125 kB, a whole fp32 gradient of
    the MNIST-1D CNN)."""
    rate_bytes = mbit * 1e6 / 8
    burst = max(2 * 1600, int(rate_bytes * 0.001))
    return ["rate", f"{mbit}mbit", "burst", str(burst), "latency", "100ms"]
