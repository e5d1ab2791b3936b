"""What every run on Ray shares, data parallel or pipelined: Ray started or joined, the
clusters' worker slots checked, a group of actors' results awaited, an actor ended."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from training.placement import cluster_resource
from training.spec import TrainSpec

SEGMENT_TIMEOUT_S = 900.0


def kill(actor: Any) -> None:
    import ray

    ray.kill(actor, no_restart=True)


def local_resources(clusters: dict[str, int]) -> dict[str, float]:
    """Custom resources a local Ray needs so each cluster can hold its workers."""
    return {cluster_resource(c): float(n) for c, n in clusters.items()}


def ensure_ray(spec: TrainSpec) -> tuple[bool, bool]:
    """Connect or start Ray; (started_here, is_local)."""
    import ray

    if ray.is_initialized():
        return False, spec.ray_address is None
    address = spec.ray_address or os.environ.get("CPN_RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
        return True, False
    ray.init(
        num_cpus=spec.ray_num_cpus or os.cpu_count() or 1,
        resources=local_resources(spec.clusters),
        include_dashboard=False,
        log_to_driver=False,
    )
    return True, True


def check_capacity(spec: TrainSpec) -> None:
    import ray

    have = ray.cluster_resources()
    for c, n in spec.clusters.items():
        res = cluster_resource(c)
        if have.get(res, 0.0) < n:
            raise ValueError(
                f"clusters: cluster {c!r} needs {n} worker slot(s) but Ray offers "
                f"{have.get(res, 0.0):g} of resource {res!r}; start the node with "
                f"--resources '{{\"{res}\": {n}}}' or ask for fewer workers"
            )


def wait_all(refs: list[Any]) -> list[Any]:
    """Results of all refs; raises as soon as any fails (a dead worker blocks the others)."""
    import ray

    pending = list(refs)
    deadline = time.monotonic() + SEGMENT_TIMEOUT_S
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"workers made no progress for {SEGMENT_TIMEOUT_S:.0f} s")
        ready, pending = ray.wait(pending, num_returns=1, timeout=min(left, 5.0))
        for r in ready:
            ray.get(r)
    return list(ray.get(refs))


@dataclass
class Outcome:
    """How one actor's call ended: its value, the error it raised, or neither (no answer
    within the grace window after another call failed)."""

    value: Any = None
    error: BaseException | None = None
    done: bool = False


def outcomes(
    refs: list[Any],
    grace_s: float,
    actors: list[Any] | None = None,
    on_silent: Callable[[set[int]], bool] | None = None,
) -> tuple[list[Outcome], float | None]:
    """Every call's outcome: all of them, or, once one failed, those that end within
    `grace_s` after it (the others are left unanswered). Also when the first failed.

    With `actors` (each call's actor, made with `PROBE_GROUP`), the busy ones are asked
    `ping` on a thread of their own throughout: one that answers within `PROBE_S` is slow,
    not lost, and is waited for; one that does not is unreachable (its node, or the link to
    it, is gone) and, once a call failed, is not waited for. With `on_silent`, the first
    unreachable ones found while others are heard go to it, once: it ends the waits of peers
    blocked on them (it says whether it could: `training.connections`), which counts as a
    failure if none came yet, so a cut link costs a probe's time, not the grace window."""
    import ray

    out = [Outcome() for _ in refs]
    index = {r: i for i, r in enumerate(refs)}
    pending = list(refs)
    deadline = time.monotonic() + SEGMENT_TIMEOUT_S
    failed_at: float | None = None
    probe = _Probe(actors) if actors is not None else None
    told = False
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, pending = ray.wait(pending, num_returns=1, timeout=min(left, 1.0))
        for r in ready:
            o = out[index[r]]
            o.done = True
            try:
                o.value = ray.get(r)
            except Exception as exc:  # noqa: BLE001 - the caller classifies it
                o.error = exc
                if failed_at is None:
                    failed_at = time.monotonic()
                    deadline = min(deadline, failed_at + grace_s)
        if probe is None or not pending:
            continue
        silent = probe.silent([index[r] for r in pending])
        if not silent:
            continue
        # nobody else heard from is the driver's own trouble; without `on_silent`, or where
        # it cannot end the waits on them, the peers' grace window decides
        heard = probe.heard | {i for i, o in enumerate(out) if o.done}
        if not told and on_silent is not None and heard - silent and on_silent(silent):
            told = True
            if failed_at is None:
                failed_at = time.monotonic()
                deadline = min(deadline, failed_at + grace_s)
        if failed_at is not None:
            pending = [r for r in pending if index[r] not in silent]
    if failed_at is None and pending:
        raise TimeoutError(f"workers made no progress for {SEGMENT_TIMEOUT_S:.0f} s")
    return out, failed_at


class _Probe:
    """Each busy actor's last `ping`: answered ones are asked again, so a ping unanswered for
    `PROBE_S` means an actor unreachable now, not one slow earlier."""

    def __init__(self, actors: list[Any]) -> None:
        self.actors = actors
        self.sent: dict[int, tuple[Any, float]] = {}
        self.heard: set[int] = set()

    def silent(self, busy: list[int]) -> set[int]:
        """Which of the `busy` actors have not answered a ping for `PROBE_S`."""
        import ray

        now = time.monotonic()
        out: set[int] = set()
        for i in busy:
            last = self.sent.get(i)
            if last is not None and not ray.wait([last[0]], timeout=0)[0]:
                if now - last[1] > PROBE_S:
                    out.add(i)
                continue
            if last is not None:
                self.heard.add(i)
            self.sent[i] = (ping(self.actors[i]), now)
        return out


PROBE_GROUP = {"probe": 1}
"""The concurrency group a worker actor is made with, so `ping` answers while it trains."""
PROBE_S = 5.0
"""How long an actor that is still busy may take to answer `ping` before it counts as
unreachable: a Ray call's round trip over the WAN, with room for a loaded host."""


def ping(actor: Any) -> Any:
    """The ref of `actor.ping()` on its probe thread (answers while `run` is busy)."""
    return actor.ping.options(concurrency_group="probe").remote()
