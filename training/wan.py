"""The WAN as a link table, and how long moving bytes over it takes.

Pure code: the exchange (`training/exchange.py`) measures real serialized bytes, asks
`allgather_time` (an all-gather) or `rounds_time` (a ring all-reduce's rounds) how long the
links would have needed, and waits out the difference. The model
is what gloo does on real links (checked against the namespace testbed, `bench/wan.py
--validate`): its all-gather is a ring, n-1 rounds in which every cluster sends one block to
the next, each round as slow as its slowest ring edge; a message on an edge costs half the
round trip (one-way latency) plus its bytes at the link bandwidth, links are full duplex.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from training.spec import LinkSpec


@dataclass(frozen=True)
class Link:
    bandwidth_bps: float
    rtt_s: float

    def transfer_s(self, nbytes: int) -> float:
        """Seconds to deliver one message of `nbytes` over this link."""
        return self.rtt_s / 2.0 + nbytes * 8.0 / self.bandwidth_bps


class Pacer:
    """Holds one leader's WAN sends to an average rate, the share its job reserved of the
    uplink, with a burst of one exchange: a token bucket in virtual-time form (GCRA, as HTB
    and ATM shape traffic). A job whose plan holds never waits; one that runs ahead of its
    plan (faster compute, a share that grew) waits instead of taking other jobs' bandwidth.
    """

    def __init__(self, rate_bps: float) -> None:
        if not rate_bps > 0:
            raise ValueError(f"pacer rate must be > 0 bit/s, got {rate_bps}")
        self.rate_bps = rate_bps
        self._due = 0.0
        """When the sends so far would have ended, sent at the rate."""

    def wait_s(self, now: float) -> float:
        """Seconds to wait before an exchange may begin at `now`: until the sends so far
        would have ended at the rate (the one about to begin is the burst)."""
        return max(self._due - now, 0.0)

    def sent(self, start: float, bits: float) -> None:
        """Count an exchange that began at `start` and sent `bits`; time idle before it is
        not saved up (no burst beyond one exchange)."""
        self._due = max(self._due, start) + bits / self.rate_bps


class LinkTable:
    """Links per unordered cluster pair, with an optional default for pairs not listed."""

    def __init__(self, links: dict[frozenset[str], Link], default: Link | None = None) -> None:
        self._links = dict(links)
        self.default = default

    @classmethod
    def build(
        cls, links: list[LinkSpec], mbps: float | None = None, rtt_ms: float | None = None
    ) -> LinkTable | None:
        """None when nothing is shaped (no links, no default)."""
        if not links and mbps is None:
            return None
        default = Link(mbps * 1e6, (rtt_ms or 0.0) / 1e3) if mbps is not None else None
        table = {frozenset((x.a, x.b)): Link(x.mbps * 1e6, x.rtt_ms / 1e3) for x in links}
        return cls(table, default)

    def get(self, a: str, b: str) -> Link | None:
        return self._links.get(frozenset((a, b)), self.default)

    def allgather_time(self, clusters: list[str], block: int) -> float:
        """Seconds gloo's ring all-gather of one `block`-byte block per cluster needs: n-1
        rounds over the ring edges `ring_edges(clusters)`. The all-gather of block sizes
        before it (8 bytes a cluster, latency only) is not charged. Unlisted edges without a
        default cost nothing."""
        links = [self.get(a, b) for a, b in ring_edges(clusters)]
        shaped = [x for x in links if x is not None]
        if not shaped:
            return 0.0
        rounds = len(clusters) - 1
        latency = max(x.rtt_s / 2.0 for x in shaped)
        return rounds * (latency + max(x.transfer_s(block) for x in shaped))

    def rounds_time(self, rounds: Sequence[Mapping[tuple[str, str], int]]) -> float:
        """Seconds a sequence of rounds needs, each round's messages (bytes per directed
        link) sent at once and the round as slow as its slowest message (one-way latency plus
        bytes at the link's bandwidth): a ring all-reduce's 2(n-1) rounds. Messages on links
        not in the table cost nothing."""
        total = 0.0
        for messages in rounds:
            times = [
                link.transfer_s(nbytes)
                for (a, b), nbytes in messages.items()
                if (link := self.get(a, b)) is not None
            ]
            total += max(times, default=0.0)
        return total

    def slowest(self, clusters: list[str]) -> Link | None:
        """The link with the least bandwidth among `clusters` (what bounds a full exchange)."""
        found = [
            link
            for i, a in enumerate(clusters)
            for b in clusters[i + 1 :]
            if (link := self.get(a, b)) is not None
        ]
        return min(found, key=lambda x: (x.bandwidth_bps, -x.rtt_s)) if found else None


def ring_edges(clusters: list[str]) -> list[tuple[str, str]]:
    """The directed edges of gloo's ring over `clusters` (rank i sends to rank i+1): the only
    links an all-gather among them puts bytes on."""
    if len(clusters) < 2:
        return []
    return list(zip(clusters, clusters[1:] + clusters[:1], strict=True))


def _read_table(path: str | Path) -> object:
    """A link table file's content (JSON, or YAML by suffix); ValueError says why not."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ValueError(f"links file {str(p)!r} cannot be read: {exc.strerror}") from None
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as exc:
        raise ValueError(f"links file {str(p)!r} is not valid JSON/YAML: {exc}") from None
    return data


def load_links_file(path: str | Path) -> list[LinkSpec]:
    """Read a link table: JSON (or YAML) `{"links": [{"a", "b", "mbps", "rtt_ms"}, ...]}`.

    ValueError names the entry and the field that is wrong.
    """
    p = Path(path)
    data = _read_table(p)
    items = data.get("links") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise ValueError(f'links file {str(p)!r}: expected {{"links": [...]}} or a list')
    out: list[LinkSpec] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ValueError(f"links[{i}]: expected an object with a, b, mbps, rtt_ms")
        try:
            a, b = str(item["a"]), str(item["b"])
            mbps, rtt = float(item["mbps"]), float(item.get("rtt_ms", 0.0))
        except KeyError as exc:
            raise ValueError(f"links[{i}]: missing field {exc.args[0]!r}") from None
        except (TypeError, ValueError):
            raise ValueError(f"links[{i}]: mbps and rtt_ms must be numbers") from None
        if mbps <= 0 or rtt < 0:
            raise ValueError(f"links[{i}]: mbps must be > 0 and rtt_ms >= 0")
        out.append(LinkSpec(a, b, mbps, rtt))
    return out


def load_regions_file(path: str | Path) -> dict[str, str]:
    """The link table's optional `"regions": {cluster: region}` (empty when it has none, or
    is a bare list of links): where the emulated clusters are, so `async-ps` can run a server
    per region as it does for placed clusters. ValueError when it is not such a mapping."""
    data = _read_table(path)
    regions = data.get("regions") if isinstance(data, dict) else None
    if regions is None:
        return {}
    if not isinstance(regions, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v for k, v in regions.items()
    ):
        raise ValueError('regions: expected {"CLUSTER": "REGION", ...} with non-empty names')
    return dict(regions)
