"""Whether a job should wait for faster GPUs instead of taking what is free now.

GPU models differ by an order of magnitude in speed (a T4 against an H100), so under load
the plan that starts a job soonest is not the one that finishes it soonest: a job placed on
slow GPUs now can finish long after one held until a running job hands back fast ones. Each
running job's expected end (`RunningJob.ends_at_s`) says when its GPUs come back; a job waits
when one cluster's GPUs, free by then, finish it sooner than its plan now by at least
`margin` (the ends are estimates). This is delay scheduling (Zaharia et al., EuroSys 2010)
with the expected completion time as its test, as heterogeneous schedulers'
minimum-completion-time rule has it. The queue order still decides who gets the GPUs when
they come back: a waiting job holds nothing meanwhile.

A job with a deadline waits only when waiting also costs no more than its plan now. It is
placed for the cheapest plan that meets its deadline (`controller.loop.placement.objective_for`):
held for faster GPUs that cost more, it was held again each time they came back, the planner
still choosing the cheaper ones, so it was planned over and over. Waiting only to run cheaper,
up to the deadline, staked the deadline on other jobs' estimated ends and missed more
deadlines; sooner and no dearer keeps the margin before the deadline, and the GPUs waited
for are the planner's choice too once back (measured: bench/results/sim-summary.md).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, replace

from scheduler.cost import CostModel
from scheduler.optimizer import plan
from scheduler.rules import Release
from scheduler.types import Assignment, Estimate, JobRequest, Objective, Plan, Snapshot

MARGIN = 0.2
"""A job waits only to finish at least this much sooner: the ends it counts on are estimates."""

ENDS_WEIGHED = 3
"""`bandwidth_wait` weighs the ends of this many runners holding the plan's ports, soonest
first (each a plan): later ones are further off and less likely to pay."""


@dataclass(frozen=True)
class Wait:
    """Waiting for `cluster`'s GPUs, expected free at `at_s`, finishes the job at `finish_s`
    (the caller's clock, seconds) at `cost`."""

    cluster: str
    gpus: int
    at_s: float
    finish_s: float
    cost: float
    frugal: bool
    """The job has a deadline (placed for cost within it): it waits only when that costs no
    more than the plan now too."""
    floor_s: float
    """No plan now runs the job faster: a wait that beats this beats every plan now, without
    planning one."""
    holders: tuple[str, ...] = ()
    """Waiting for WAN rate (`bandwidth_wait`): the runners whose end gives it back (`cluster`
    names the ports, `gpus` is 0)."""

    def pending(self, snapshot: Snapshot, now_s: float) -> bool:
        """Whether the job is still waiting, not to be weighed again: its GPUs (or the rates
        it waits for) are not due yet and still held (a runner that ended early hands them
        back before its end)."""
        if now_s >= self.at_s:
            return False
        if self.holders:
            return any(r.id in self.holders for r in snapshot.running)
        cluster = snapshot.by_name.get(self.cluster)
        return cluster is not None and cluster.gpus_free < self.gpus

    def sooner_s(self, now_s: float, plan: Estimate | None = None) -> float:
        """How much sooner waiting finishes the job than `plan` now (None: any plan now)."""
        run_now = self.floor_s if plan is None else plan.total_time_s
        return run_now - (self.finish_s - now_s)

    def beats(self, now_s: float, plan: Estimate | None = None, margin: float = MARGIN) -> bool:
        """Whether waiting finishes the job sooner than `plan` now (None: than any plan now)
        by `margin` of its run time, at no more cost when the job is `frugal` (never without
        planning: no bound on the cost now is kept)."""
        if plan is None:
            return not self.frugal and self.finish_s - now_s < (1.0 - margin) * self.floor_s
        sooner = self.finish_s - now_s < (1.0 - margin) * plan.total_time_s
        return sooner and (not self.frugal or self.cost <= plan.cost)


def soonest_wait(
    snapshot: Snapshot,
    request: JobRequest,
    now_s: float,
    efficiency: Mapping[str, float] | None = None,
) -> Wait | None:
    """The single-cluster placement, on GPUs busy now but expected back, that finishes the job
    soonest, within the job's deadline when it has one; None when there is none, or when too
    few GPUs are free now for the job (nothing to weigh the wait against).

    Only clusters that cannot take the job now are candidates (one that can is the planner's
    choice to make now). The job's own limits that the planner checks (regions, residency,
    cluster cap) are checked again when it is placed; a wait the job could not use costs it a
    pass, not a placement."""
    gpus = request.min_gpus
    allowed = None if request.qos.regions is None else set(request.qos.regions)
    data = None if request.data_clusters is None else set(request.data_clusters)
    model: CostModel | None = None
    frugal = request.qos.deadline_s is not None
    deadline = None if request.qos.deadline_s is None else now_s + request.qos.deadline_s
    runs: dict[tuple[float, float, float], Estimate] = {}  # (rate, intra Gbit/s, price) -> run
    best: Wait | None = None
    for name, releases in snapshot.releases.items():
        cluster = snapshot.by_name.get(name)
        if cluster is None or not cluster.schedulable or cluster.gpus_free >= gpus:
            continue
        if allowed is not None and cluster.region not in allowed:
            continue
        if data is not None and name not in data:
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
        key = (model.rate[name], cluster.intra_bandwidth_gbps, model.price[name])
        run = runs.get(key)
        if run is None:
            run = runs[key] = model.estimate((Assignment(name, gpus),), "none", "every-step")
        finish = at + run.total_time_s
        if deadline is not None and finish > deadline:
            continue
        if best is None or finish < best.finish_s:
            best = Wait(name, gpus, at, finish, run.cost, frugal, 0.0)
    if best is None or model is None:
        return None

    def usable(name: str) -> bool:
        return (allowed is None or snapshot.by_name[name].region in allowed) and (
            data is None or name in data
        )

    floor = _floor_s(model, usable, request.max_gpus, request.min_gpus)
    if floor is None:
        return None  # too few GPUs free now: the planner says why the job waits
    return replace(best, floor_s=floor)


def _floor_s(
    model: CostModel, usable: Callable[[str], bool], most: int, fewest: int
) -> float | None:
    """No plan now runs the job faster: its steps' work over the summed rate of the fastest
    `most` GPUs free where it may run, wherever they are (steps factors are at least 1;
    all-reduces, the WAN and waiting on a peer only add; running ahead gains at most that
    rate). None when fewer than `fewest` GPUs are free there.

    Read fastest first off the snapshot's `RankIndex` (a walk that stops at the `most`-th
    GPU): scanning and sorting every free cluster for it was a large part of a simulated
    job's time on the largest fleets (bench/results/sim-summary.md)."""
    snap = model.snapshot
    ix = model.rank_index()
    if ix is not None:
        groups: Iterable[tuple[float, Iterable[str]]] = ix.by_rate
    else:  # calibrated rates: the model's own
        by_rate: dict[float, list[str]] = {}
        for name in snap.open_clusters:
            by_rate.setdefault(model.rate[name], []).append(name)
        groups = sorted(by_rate.items(), reverse=True)
    summed, need = 0.0, most
    for rate, names in groups:
        for name in names:
            cluster = snap.by_name[name]
            if cluster.gpus_free < 1 or not cluster.schedulable or not usable(name):
                continue
            take = min(cluster.gpus_free, need)
            summed += rate * take
            need -= take
            if need == 0:
                return model.job.steps * model.work / summed
    if most - need < fewest:
        return None
    return model.job.steps * model.work / summed


def bandwidth_wait(
    snapshot: Snapshot,
    request: JobRequest,
    now: Plan,
    now_s: float,
    objective: Objective,
    release: Release,
    ports: Collection[str],
    efficiency: Mapping[str, float] | None = None,
) -> Wait | None:
    """Waiting for the runners that hold the declared `ports` `now` crosses (named as
    `RunningJob.wan_kbps` names them) to end, planned on what their end gives back
    (`release`: their GPUs and their WAN rates), when that finishes the job soonest; None when
    no runner holding them has a known end still to come.

    A plan across the WAN is priced and timed on the rate its ports have free now: beside a
    WAN-heavy runner due to end soon, a job ran all its steps on the small share left
    (bench/results/wan-share-burst.md). As `soonest_wait` does for GPUs, the caller holds it
    only where this beats `now` (`Wait.beats`); it holds nothing meanwhile."""
    if len(now.placement) < 2 or not ports:
        return None
    holding = sorted(
        (
            r
            for r in snapshot.running
            if r.ends_at_s is not None
            and r.ends_at_s > now_s
            and any(name in ports and kbps > 0 for name, kbps in r.wan_kbps)
        ),
        key=lambda r: r.ends_at_s or 0.0,
    )
    deadline = None if request.qos.deadline_s is None else now_s + request.qos.deadline_s
    frugal = deadline is not None
    best: Wait | None = None
    for i, last in enumerate(holding[:ENDS_WEIGHED]):
        at = last.ends_at_s or now_s
        if best is not None and at >= best.finish_s:
            break
        gone = holding[: i + 1]
        later = plan(
            release(snapshot, gone), request, objective, efficiency=efficiency, preempt=False
        )
        if not isinstance(later, Plan):
            continue
        finish = at + later.estimate.total_time_s
        if deadline is not None and finish > deadline:
            continue
        if best is None or finish < best.finish_s:
            held = sorted({n for r in gone for n, k in r.wan_kbps if n in ports and k > 0})
            ids = tuple(r.id for r in gone)
            best = Wait(", ".join(held), 0, at, finish, later.estimate.cost, frugal, 0.0, ids)
    return best
