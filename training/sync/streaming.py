"""Streaming DiLoCo: local SGD whose outer exchange hides under the inner steps.

The flat parameters are cut into `fragments` contiguous slices of equal size. Each fragment is
synced once every `period` (H) steps, the fragments at staggered steps (fragment p after the
steps s with s + 1 = (p + 1) H / F mod H), so the WAN carries 1/F of the model at a time. When
a fragment is due, every rank takes its pseudo-gradient (anchor - parameters) and its cluster
leader hands it, weighted by the cluster's batch share, to a background thread that
all-reduces it over the leaders (`Collective.wan_sum`: the compressed ring) while the inner
steps go on. `delay` (D) steps later, after that step's local update, the outer SGD step is
applied to the fragment's anchor and the fragment's parameters become the new anchor, the
local progress made during the delay dropped (torchft's default, `fragment_update_alpha` 0;
keeping it on top of the new anchor ended the language model at a higher loss, measured:
bench/results/streaming-merge.md). With F = 1 and D = 0 it is local SGD, bit for bit.

Checkpoints may fall anywhere: a cluster leader first waits for the exchanges in flight and
keeps their sums (run-wide, the same on every leader) and their schedule, with each cluster's
own parameters, so a resumed run applies them at the same steps as an uninterrupted
one. After the last step, what is in flight is applied and every fragment not synced at the
last step is averaged over the clusters once more (as local SGD's last, partial period), so
all clusters end with the same model; `drain` does the same mid-run, where auto leaves
streaming.

With `spec.drift_correction` each fragment's local steps are corrected by the clusters' drift
apart (`training.sync.drift`), its rates taken from the fragment's own exchange: its
pseudo-gradient over the steps since it last became the anchor, and the sum that comes back.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from grammar import Sync
from training.collective import flatten
from training.exchange import chunk_bounds
from training.sync.base import Scope, SyncContext, SyncStrategy
from training.sync.drift import DriftCorrection, move
from training.sync.outer import make_outer


def fragment_offsets(period: int, fragments: int) -> list[int]:
    """Fragment p is sent after the steps s with (s + 1 - offset_p) a multiple of `period`;
    offsets spread the fragments evenly over a period, the last one at H (local SGD's)."""
    return [(p + 1) * period // fragments for p in range(fragments)]


def fragments_due(step: int, period: int, fragments: int) -> list[int]:
    """The fragments whose pseudo-gradients leave after (0-based) `step`."""
    return [
        p
        for p, off in enumerate(fragment_offsets(period, fragments))
        if step + 1 >= off and (step + 1 - off) % period == 0
    ]


@dataclass
class InFlight:
    """A fragment's pseudo-gradient on its way: sent after step `sent`, applied after step
    `apply_at`; `final`: averaged, not an outer step (a sync of less than a period, by
    `drain`)."""

    fragment: int
    sent: int
    apply_at: int
    result: Future[torch.Tensor] | torch.Tensor | None
    """The sum over clusters (a future until it arrives); None on ranks that are not leaders,
    which receive it from theirs when it is applied."""
    final: bool = False
    own: torch.Tensor | None = None
    """This cluster's pseudo-gradient sent, and `steps`, the local steps it spans: the drift
    correction's round (None: no correction, or not kept across a checkpoint)."""
    steps: int = 0


class StreamingSync(SyncStrategy):
    """See the module docstring.

    It shrinks and grows in place: when a cluster is lost, every survivor drops the
    fragments in flight (`abandon`), applied or not on another survivor alike, so the anchors
    stay the same everywhere; each dropped fragment's pseudo-gradient stays in the clusters'
    parameters and goes at that fragment's next turn, spanning two periods."""

    regroups = True
    exchanges_gradients = False

    def __init__(self, sync: Sync, ctx: SyncContext) -> None:
        super().__init__(sync, ctx)
        self.period = sync.period
        self.fragments = sync.fragments
        self.delay = sync.delay
        self.sizes = [p.numel() for p in ctx.params]
        self.bounds = chunk_bounds(sum(self.sizes), self.fragments)
        flat = flatten([p.detach() for p in ctx.params])
        self.anchor = [flat[lo:hi].clone() for lo, hi in self.bounds]
        self.outer = make_outer(self.anchor, ctx.spec)
        self.multi = len(self.comm.clusters) > 1
        leader = self.comm.is_leader and self.multi
        self.pool = ThreadPoolExecutor(max_workers=1) if leader else None
        self.inflight: deque[InFlight] = deque()
        self.finished = False
        self.drift: list[DriftCorrection] | None = None
        if ctx.spec.drift_correction and self.multi:
            self.drift = [DriftCorrection(a.numel(), a.device) for a in self.anchor]
        self.late = 0
        self.late_wait_s = 0.0
        self.drain_s = 0.0
        self.kept: list[tuple[int, torch.Tensor, bool]] | None = None
        """Joining late (`defer`): each applied fragment's (fragment, sum, final), in order,
        applied to the state once it is here (`replay`)."""
        self.joined: list[InFlight] = []
        """Joining late: the fragments the state had in flight (`load_state_dict`)."""
        self.applied_upto = -1.0
        """The step through which fragments due were applied (every one after a drain)."""

    @property
    def scope(self) -> Scope:
        return Scope.CLUSTER

    # ------------------------------------------------------------------ the fragments

    def _spans(self, p: int) -> list[tuple[torch.Tensor, int, int, int]]:
        """(parameter, start in it, end in it, start in the fragment) of fragment p."""
        lo, hi = self.bounds[p]
        out, pos = [], 0
        for param, size in zip(self.ctx.params, self.sizes, strict=True):
            a, b = max(lo, pos), min(hi, pos + size)
            if a < b:
                out.append((param, a - pos, b - pos, a - lo))
            pos += size
        return out

    def _read(self, p: int) -> torch.Tensor:
        """Fragment p of this rank's parameters, as a new flat tensor."""
        parts = [param.detach().reshape(-1)[a:b] for param, a, b, _ in self._spans(p)]
        return torch.cat(parts) if parts else self.anchor[p].new_zeros(0)

    def _write(self, p: int, values: torch.Tensor) -> None:
        with torch.no_grad():
            for param, a, b, at in self._spans(p):
                param.data.view(-1)[a:b].copy_(values[at : at + b - a])

    def _send(self, p: int, step: int, *, final: bool = False) -> None:
        """Take fragment p's pseudo-gradient and start its exchange."""
        delta = self.anchor[p] - self._read(p)
        result: Future[torch.Tensor] | torch.Tensor | None = None
        if not self.multi:
            result = delta
        elif self.pool is not None:
            shared = delta * self.ctx.cluster_share
            lo = self.bounds[p][0]
            result = self.pool.submit(self.comm.wan_sum, shared, step, self.compression, lo)
        own, steps = None, 0
        if self.drift is not None and not final:
            own, steps = delta, self.drift[p].steps
        self.inflight.append(InFlight(p, step, step + self.delay, result, final, own, steps))

    def _apply(self, item: InFlight, *, due: bool = True) -> None:
        """The outer step of `item`'s fragment (or, `final`, the average), then its
        parameters: the new anchor. `due`: at its apply step, where a wait for it is the
        part of its exchange the inner steps did not hide (else `drain` applies it early)."""
        p = item.fragment
        if self.multi:
            total = torch.zeros_like(self.anchor[p])
            t0 = time.perf_counter()
            if self.comm.is_leader:
                got = item.result
                assert got is not None
                if due and isinstance(got, Future) and not got.done():
                    self.late += 1
                total = got.result() if isinstance(got, Future) else got
            self.comm.broadcast(total)  # the cluster's other ranks wait here for the leader
            if due:
                self.late_wait_s += time.perf_counter() - t0
        else:
            assert isinstance(item.result, torch.Tensor)
            total = item.result
        if self.drift is not None:
            if item.own is not None:
                self.drift[p].round(item.own, total, item.steps)
            else:  # the fragment becomes the anchor all the same: its progress is dropped
                self.drift[p].reset_steps()
        self._move(p, total, final=item.final)

    def _move(self, p: int, total: torch.Tensor, *, final: bool) -> None:
        """Fragment p's outer step on the clusters' sum `total` (or, `final`, the average),
        then its parameters: the new anchor. Joining late, the sum is kept instead."""
        if self.kept is not None:
            self.kept.append((p, total.clone(), final))
            return
        if final:
            with torch.no_grad():
                self.anchor[p].sub_(total)
        else:
            for i, a in enumerate(self.anchor):
                a.grad = total.clone() if i == p else None
            self.outer.step()
        self._write(p, self.anchor[p])

    # ------------------------------------------------------------------ joining late

    def seats_at(self, step: int) -> int | None:
        """The period's end, as local SGD's: the sums of the fragments applied meanwhile are
        kept and applied in the same order once the state is here. None with the drift
        correction, whose rates a member sitting out has none of."""
        if self.drift is not None:
            return None
        return min((step // self.period + 1) * self.period, self.spec.steps)

    def defer(self) -> None:
        self.kept = []

    def replay(self) -> None:
        """After `load_state_dict` took the peer's state: its fragments in flight that the
        others have applied since, then the kept sums, in the order the others applied
        them (their deque's: the state's first); its others stay in flight, ahead of this
        member's own. Every parameter is then its anchor: a newcomer's own progress is none."""
        kept, self.kept = self.kept or [], None
        joined, self.joined = self.joined, []
        due = [i for i in joined if i.apply_at <= self.applied_upto]
        for item in due:
            assert isinstance(item.result, torch.Tensor)  # taken from the state
            self._move(item.fragment, item.result, final=item.final)
        for p, total, final in kept:
            self._move(p, total, final=final)
        ahead = [i for i in joined if i.apply_at > self.applied_upto]
        for item in reversed(ahead):
            if not self.comm.is_leader:
                item.result = None  # the leader's comes by broadcast, as for its own
            self.inflight.appendleft(item)
        for p in range(self.fragments):
            self._write(p, self.anchor[p])

    # ------------------------------------------------------------------ the loop

    def after_backward(self, grad: torch.Tensor, step: int, compute_s: float) -> torch.Tensor:
        self.comm.reduce(grad)
        return grad

    def after_local_step(self) -> None:
        if self.drift is not None:
            move(self.ctx.params, torch.cat([d.correction for d in self.drift]))
            for d in self.drift:
                d.step()

    def after_step(self, step: int) -> None:
        for p in fragments_due(step, self.period, self.fragments):
            self._send(p, step)
        while self.inflight and self.inflight[0].apply_at <= step:
            self._apply(self.inflight.popleft())
        self.applied_upto = max(self.applied_upto, float(step))

    def drain(self, step: int) -> None:
        """After `after_step(step)`: apply what is in flight (early), then average once more
        every fragment not sent after `step`, so every cluster holds the same parameters,
        equal to the anchor. Safe mid-run (auto leaves streaming this way): nothing is left in
        flight, the pool stays usable, and the fragments' schedule goes on from the step
        after."""
        t0 = time.perf_counter()
        while self.inflight:
            self._apply(self.inflight.popleft(), due=False)
        synced = set(fragments_due(step, self.period, self.fragments))
        for p in range(self.fragments):
            if p not in synced:
                self._send(p, step, final=True)
        while self.inflight:
            self._apply(self.inflight.popleft(), due=False)
        self.applied_upto = float("inf")  # a state's fragments in flight: applied too
        self.drain_s += time.perf_counter() - t0

    def stats(self) -> dict[str, float]:
        """What of the WAN the inner steps did not hide: `late_fragments` (fragments still on
        the WAN at their apply step, as the leader saw them), `late_wait_s` (this rank's time
        at apply steps: its waits for them, and the cluster's broadcast of every fragment) and
        `drain_s` (the blocking exchange at the end, or where auto left streaming)."""
        return {
            "late_fragments": float(self.late),
            "late_wait_s": self.late_wait_s,
            "drain_s": self.drain_s,
        }

    def finish(self) -> None:
        """`drain` after the last step, so every cluster ends with the same parameters."""
        self.drain(self.spec.steps - 1)
        self.finished = True

    # ------------------------------------------------------------------ checkpoints

    def _await_results(self) -> None:
        """Wait for the exchanges in flight (the leaders' group must be idle for a
        checkpoint's gather) and keep their sums."""
        for item in self.inflight:
            if isinstance(item.result, Future):
                item.result = item.result.result()

    def cluster_state(self) -> dict[str, Any]:
        self._await_results()
        model = self.ctx.model
        drift = None
        if self.drift is not None:
            drift = {"cluster": self.comm.cluster, "parts": [d.state() for d in self.drift]}
        return {
            "drift": drift,
            "inflight": [(i.fragment, i.sent, i.apply_at) for i in self.inflight],
            # clusters' parameters differ until the run's final sync
            "model": None if self.finished else {k: v.cpu() for k, v in model.state_dict().items()},
        }

    def _layout(self) -> list[int]:
        return [self.period, self.fragments, self.delay, sum(self.sizes)]

    def state_dict(self) -> dict[str, Any]:
        self._await_results()
        results = [
            i.result.cpu() if isinstance(i.result, torch.Tensor) else None for i in self.inflight
        ]
        return {
            "layout": self._layout(),
            "anchor": [a.detach().cpu() for a in self.anchor],
            "outer": self.outer.state_dict(),
            "results": results,
            "finished": self.finished,
        }

    def load_state_dict(
        self, state: Mapping[str, Any] | None, cluster_state: Mapping[str, Any] | None
    ) -> None:
        fresh = state is None or list(state.get("layout", [])) != self._layout()
        with torch.no_grad():
            if fresh or state is None:  # a fresh start, or another layout: from the parameters
                for p, a in enumerate(self.anchor):
                    a.copy_(self._read(p))
                self.inflight.clear()
                return
            for a, saved in zip(self.anchor, state["anchor"], strict=True):
                a.copy_(saved)
        self.outer.load_state_dict(state["outer"])
        device = self.comm.device
        saved_inflight = list((cluster_state or {}).get("inflight", []))
        results = list(state.get("results", []))
        if self.kept is not None:  # joining late: its own rounds are in flight meanwhile
            self.joined = [
                InFlight(entry[0], entry[1], entry[2], None if r is None else r.to(device))
                for entry, r in zip(saved_inflight, results, strict=True)
            ]
            return
        self.finished = bool(state.get("finished", False))
        self.inflight.clear()
        for entry, result in zip(saved_inflight, results, strict=True):
            p, sent, apply_at = entry[:3]  # checkpoints before 2026-11-28 add a snapshot
            mine = result.to(device) if result is not None and self.comm.is_leader else None
            if not self.multi and result is not None:
                mine = result.to(device)
            self.inflight.append(InFlight(p, sent, apply_at, mine))
        saved = (cluster_state or {}).get("drift")
        if self.drift is not None and saved is not None:
            own = saved.get("cluster") == self.comm.cluster
            for d, part in zip(self.drift, saved["parts"], strict=True):
                d.load(part, own=own)

    def abandon(self) -> None:
        """Drop every fragment in flight, finished or not, without waiting for its exchange
        (a peer of it is gone; its thread fails on the closed group)."""
        self.inflight.clear()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
