"""Adaptive: every step, with the compression level picked at run time so that the WAN time
hides under compute (`training.adaptive.choose`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from grammar import Compression, Sync, parse_compression
from grammar.compression import message_bytes
from training.adaptive import choose
from training.exchange import Exchanged
from training.sync.base import SyncContext
from training.sync.every_step import EveryStepSync
from training.wan import Link


class AdaptiveSync(EveryStepSync):
    """Starts at the least compressed of `spec.adaptive_levels` and, after each exchange,
    picks the next step's level from what every leader reported (identical on all leaders,
    so all switch on the same step)."""

    def __init__(self, sync: Sync, ctx: SyncContext) -> None:
        super().__init__(sync, ctx)
        self.compression = ctx.spec.adaptive_levels[0]
        self.shapes = [tuple(p.shape) for p in ctx.params]
        self.measured: dict[str, int] = {}  # largest message seen per level (its name)
        self.exchange_s: dict[str, float] = {}  # slowest leader's exchange time per level
        self.last_level: str | None = None

    def _global_sum(self, flat: torch.Tensor, step: int) -> torch.Tensor:
        done = self.comm.wan_exchange(flat, step, self.compression)
        self._adapt(done, step)
        return done.total

    def _crossings(self, level: Compression) -> float:
        """Copies of one message's bytes the busiest link carries per exchange at `level`:
        2(n-1)/n in a ring all-reduce, n-1 in an all-gather."""
        n = len(self.comm.clusters)
        return 2.0 * (n - 1) / n if self.comm.uses_ring(level) else float(n - 1)

    def _adapt(self, done: Exchanged, step: int) -> None:
        """Pick the next level from what every leader reported.

        Without a link table the bandwidth is inferred from the exchanges themselves: each
        leader says how long its previous exchange took, at the level then in use, and the
        largest bandwidth any level's exchange implied is taken: latency and waiting
        on slower leaders only ever lower it (they weigh least on the level with the largest
        messages, which usually sets it). Inferring from the last exchange alone
        spiralled down: a small message's time is mostly latency, which reads as a slow link,
        which picks a smaller message still.
        """
        level = str(done.compression)
        self.measured[level] = done.edge_bytes  # bytes on the busiest link per exchange
        xs = max(i["xs"] for i in done.infos)
        if self.last_level is not None and xs > 0:
            self.exchange_s[self.last_level] = xs
        self.last_level = level
        compute = max(i["compute"] for i in done.infos)
        clusters = self.comm.clusters
        links = self.comm.links_now(step + 1)
        link = links.slowest(clusters) if links is not None else None
        if link is None and self.exchange_s:
            bps = max(self.measured[lv] * 8 / t for lv, t in self.exchange_s.items())
            link = Link(bps, 0.0)
        levels = self.spec.adaptive_levels
        per_link = {
            str(lv): self.measured.get(str(lv))
            or round(message_bytes(lv, self.shapes) * self._crossings(lv))
            for lv in levels
        }
        self.compression = choose(levels, per_link, self.shapes, compute, link, rounds=1)

    def state_dict(self) -> dict[str, Any]:
        return {"measured": dict(self.measured), "exchange_s": dict(self.exchange_s)}

    def load_state_dict(
        self, state: Mapping[str, Any] | None, cluster_state: Mapping[str, Any] | None
    ) -> None:
        if state is None:
            return
        self.measured = dict(state.get("measured", {}))
        self.exchange_s = dict(state.get("exchange_s", {}))
        self.compression = parse_compression(state.get("compression", self.compression))
