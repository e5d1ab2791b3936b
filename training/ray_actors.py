"""What every run on Ray shares, data parallel or pipelined: Ray started or joined, the
clusters' worker slots checked, a group of actors' results awaited, an actor ended."""

from __future__ import annotations

import os
import time
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
    refs: list[Any], grace_s: float, actors: list[Any] | None = None
) -> tuple[list[Outcome], float | None]:
    """Every call's outcome: all of them, or, once one failed, those that end within
    `grace_s` after it (the others are left unanswered). Also when the first failed.

    With `actors` (each call's actor, made with `PROBE_GROUP`), the ones still busy when the
    first call fails are asked `ping` on a thread of their own: one that answers within
    `PROBE_S` is slow, not lost, and is waited for; one that does not is unreachable (its
    node, or the link to it, is gone) and is not waited for: a cut link costs the grace
    window once (the survivors' own timeout), not twice."""
    import ray

    out = [Outcome() for _ in refs]
    index = {r: i for i, r in enumerate(refs)}
    pending = list(refs)
    deadline = time.monotonic() + SEGMENT_TIMEOUT_S
    failed_at: float | None = None
    pings: dict[Any, Any] = {}
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
        if failed_at is not None and actors is not None and pending:
            if not pings:
                pings = {r: ping(actors[index[r]]) for r in pending}
            elif time.monotonic() > failed_at + PROBE_S:
                answered, _ = ray.wait(list(pings.values()), num_returns=len(pings), timeout=0)
                heard = set(answered)
                pending = [r for r in pending if pings.get(r) in heard]  # the rest: silent
    if failed_at is None and pending:
        raise TimeoutError(f"workers made no progress for {SEGMENT_TIMEOUT_S:.0f} s")
    return out, failed_at


PROBE_GROUP = {"probe": 1}
"""The concurrency group a worker actor is made with, so `ping` answers while it trains."""
PROBE_S = 5.0
"""How long an actor that is still busy may take to answer `ping` before it counts as
unreachable: a Ray call's round trip over the WAN, with room for a loaded host."""


def ping(actor: Any) -> Any:
    """The ref of `actor.ping()` on its probe thread (answers while `run` is busy)."""
    return actor.ping.options(concurrency_group="probe").remote()
