"""Whether a job should wait for faster GPUs instead of taking what is free now.

GPU models differ by up to 15x in speed (a T4 against an H100), so under load the plan that
starts a job soonest is not the one that finishes it soonest: a job placed on slow GPUs now
can finish long after one held until a running job hands back fast ones. Each running job's
expected end (`RunningJob.ends_at_s`) says when its GPUs come back; a job waits when one
cluster's GPUs, free by then, finish it sooner than its plan now by at least `margin` (the
ends are estimates). This is delay scheduling (Zaharia et al., EuroSys 2010) with the
expected completion time as its test, as heterogeneous schedulers' minimum-completion-time
rule has it. The queue order still decides who gets the GPUs when they come back: a waiting
job is tried again at every pass and holds nothing meanwhile.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from scheduler.cost import CostModel
from scheduler.types import Assignment, JobRequest, Snapshot

MARGIN = 0.2
"""A job waits only to finish at least this much sooner: the ends it counts on are estimates."""


@dataclass(frozen=True)
class Wait:
    """Waiting for `cluster`'s GPUs, expected free at `at_s`, finishes the job at `finish_s`
    (the caller's clock, seconds)."""

    cluster: str
    gpus: int
    at_s: float
    finish_s: float
    fastest_now_s: float
    """No plan now runs the job faster: the fastest GPUs free now, as many as it needs, at
    the speed of one cluster of the fastest model. Waiting that
    beats this beats every plan now, without planning one."""

    def pending(self, snapshot: Snapshot, now_s: float) -> bool:
        """Whether the job is still waiting, not to be weighed again: its GPUs are not due
        yet and still held (a runner that ended early hands them back before its end)."""
        cluster = snapshot.by_name.get(self.cluster)
        return now_s < self.at_s and cluster is not None and cluster.gpus_free < self.gpus

    def beats(self, now_s: float, run_now_s: float, margin: float = MARGIN) -> bool:
        """Whether waiting finishes sooner than a plan now taking `run_now_s`, by `margin`."""
        return self.finish_s - now_s < (1.0 - margin) * run_now_s


def soonest_wait(
    snapshot: Snapshot,
    request: JobRequest,
    now_s: float,
    efficiency: Mapping[str, float] | None = None,
) -> Wait | None:
    """The single-cluster placement, on GPUs busy now but expected back, that finishes the job
    soonest (within the job's deadline, when it has one); None when there is none, or when
    too few GPUs are free now for the job (nothing to weigh the wait against).

    Only clusters that cannot take the job now are candidates (one that can is the planner's
    choice to make now). The job's own limits that the planner checks (regions, residency,
    cluster cap) are checked again when it is placed; a wait the job could not use costs it a
    pass, not a placement."""
    gpus = request.min_gpus
    allowed = None if request.qos.regions is None else set(request.qos.regions)
    deadline = None if request.qos.deadline_s is None else now_s + request.qos.deadline_s
    model: CostModel | None = None
    runs: dict[tuple[float, float], float] = {}  # (GPU rate, intra-cluster Gbit/s) -> run time
    best: Wait | None = None
    for name, releases in snapshot.releases.items():
        cluster = snapshot.by_name.get(name)
        if cluster is None or not cluster.schedulable or cluster.gpus_free >= gpus:
            continue
        if allowed is not None and cluster.region not in allowed:
            continue
        if request.data_clusters is not None and name not in request.data_clusters:
            continue
        have, at = cluster.gpus_free, None
        for end, held in releases:
            # an end already past was a wrong estimate: nothing says when those GPUs come back
            if end > now_s:
                have += held
                if have >= gpus:
                    at = end
                    break
        if at is None or (best is not None and at >= best.finish_s):
            continue
        if model is None:
            model = CostModel(snapshot, request, efficiency)
        key = (model.rate[name], cluster.intra_bandwidth_gbps)
        if key not in runs:
            one = (Assignment(name, gpus),)
            runs[key] = model.estimate(one, "none", "every-step").total_time_s
        finish = at + runs[key]
        if deadline is not None and finish > deadline:
            continue
        if best is None or finish < best.finish_s:
            best = Wait(name, gpus, at, finish, 0.0)
    if best is None or model is None or not snapshot.open_clusters:
        return None  # nothing free: the planner says why the job waits
    free = [snapshot.by_name[name] for name in snapshot.open_clusters]
    rates = sorted(((model.rate[c.name], c.gpus_free) for c in free), reverse=True)
    top = rates[0][0]
    fastest = {c.intra_bandwidth_gbps: c.name for c in free if model.rate[c.name] == top}
    alone = min(
        model.estimate((Assignment(name, gpus),), "none", "every-step").total_time_s
        for name in fastest.values()
    )
    # a job's step is its work over its GPUs' summed rate: the fastest `gpus` GPUs free now,
    # wherever they are, are as fast as it can go (the WAN between them only adds)
    summed, need = 0.0, gpus
    for rate, n in rates:
        summed += rate * min(n, need)
        need -= min(n, need)
        if need == 0:
            break
    if need:
        return None  # too few GPUs free now: the planner says why the job waits
    return replace(best, fastest_now_s=alone * gpus * top / summed)
