"""The simulated clock and the policies it compares.

Event-driven: at each arrival or completion the policy gets one scheduling instant over the
pending jobs and the world as it is. The world is `controller.network.snapshot.World`: placements
are applied with `World.after` and completions with `scheduler.rules.release`, the code the
reconcile loop and the preemption planner use. A job's run time, cost and WAN bytes on the
placement it got come from the scheduler's cost model (`scheduler.estimate`) on the real
links, for every policy alike.

`cpn` is the reconcile loop's decision path: `scheduler.order_queue` (fair share between
tenants, response ratio inside each, with the size submission stores), then per job
in that order the loop's hold for faster GPUs (`scheduler.soonest_wait`: a job without a
deadline waits, and is not weighed again until they are due, when GPUs a running job hands
back finish it at least 20 % sooner than its plan now) and `scheduler.plan` with the loop's
objective (`controller.loop.placement.objective_for`),
at most `place_pending`'s limit per pass (the loop lets a pass run past it only while its
database read outweighs its placing, which costs nothing here), passes repeated at one instant
while a pass fills its limit. Two shortcuts keep it fast without changing a decision: a job
needing more GPUs than are free, or at least as many as one that just failed for capacity in
this pass, is not planned (the planner would answer "capacity"; the loop skips the latter
too, `controller.loop.placement._place_one`'s `blocked`). One difference from the
loop: a job whose deadline can no longer be met is planned for time and counted as a miss (the
loop fails it at its deadline), so that every policy runs every job.
"""

from __future__ import annotations

import heapq
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import scheduler
from bench.sim.network import Network
from bench.sim.trace import REF_GPU, TraceJob
from controller.loop.placement import objective_for, place_pending
from controller.network.snapshot import World
from scheduler.rules import release

PASS_LIMIT: int = inspect.signature(place_pending).parameters["limit"].default


@dataclass(frozen=True)
class Decision:
    job: TraceJob
    placement: scheduler.Placement
    estimate: scheduler.Estimate

    def applied(self, world: World, now: float) -> World:
        """The world with this job running, expected to end when its estimate says."""
        end = now + self.estimate.total_time_s
        return world.after(self.job.id, self.job.tenant, 0, False, self.placement, end)


def request_of(job: TraceJob, now: float, with_deadline: bool = True) -> scheduler.JobRequest:
    """What the controller's `job_request` builds for this job at `now` (deadline relative)."""
    left = None if job.deadline_s is None else job.deadline_s - now
    return scheduler.JobRequest(
        id=job.id,
        params=job.params,
        steps=job.steps,
        min_gpus=job.gpus,
        max_gpus=job.gpus,
        step_time_s_ref=job.step_time_s_ref,
        ref_gpu=REF_GPU,
        tenant=job.tenant,
        qos=scheduler.QoS(deadline_s=left if with_deadline and left and left > 0 else None),
    )


class Policy:
    name = "policy"

    def schedule(self, now: float, pending: Sequence[TraceJob], world: World) -> list[Decision]:
        raise NotImplementedError


class Cpn(Policy):
    """cpn's reconcile decisions; `blind`: plan on a copy of the network whose WAN is free;
    `slack`: a cost-aware objective through the planner's own knobs instead of the loop's
    "time" for jobs without a deadline — plan for time, then for "cost-within-deadline" with
    the deadline `(1 + slack)` x that fastest plan's run time (the cheapest plan at most
    `slack` slower than the fastest)."""

    def __init__(self, network: Network, blind: bool = False, slack: float | None = None) -> None:
        self.name = "cpn-no-bw" if blind else "cpn" if slack is None else "cpn-cost"
        # the blind network's link tables are built once; each plan swaps in the GPUs free now
        self.blind = network.bandwidth_blind() if blind else None
        self.slack = slack
        self.sizes: dict[str, float] = {}
        self.waits: dict[str, scheduler.Wait] = {}  # the loop's (`place_pending`'s `waits`)

    def _size(self, job: TraceJob) -> float:
        """What `controller.jobs.service.submit` stores as the job's size."""
        if job.id not in self.sizes:
            self.sizes[job.id] = scheduler.reference_run_s(request_of(job, job.arrival_s))
        return self.sizes[job.id]

    def schedule(self, now: float, pending: Sequence[TraceJob], world: World) -> list[Decision]:
        by_id = {j.id: j for j in pending}
        queue = [
            scheduler.QueuedJob(
                id=j.id, tenant=j.tenant, gpus=j.gpus, submitted_at=j.arrival_s, run_s=self._size(j)
            )
            for j in pending
        ]
        out: list[Decision] = []
        while True:
            usage = scheduler.tenant_usage(world.snapshot.running)
            order = scheduler.order_queue(queue, usage=usage, now=now)
            placed_now = self._pass(now, [by_id[q.id] for q in order.order], world)
            for d in placed_now:
                world = d.applied(world, now)
            out += placed_now
            if len(placed_now) < PASS_LIMIT:
                return out
            gone = {d.job.id for d in placed_now}
            queue = [q for q in queue if q.id not in gone]

    def _pass(self, now: float, order: list[TraceJob], world: World) -> list[Decision]:
        out: list[Decision] = []
        free = world.snapshot.free_gpus
        too_big = math.inf
        for job in order:
            if len(out) >= PASS_LIMIT:
                break
            if job.gpus > free or job.gpus >= too_big:
                continue
            wait = self.waits.get(job.id)
            if wait is not None and wait.pending(world.snapshot, now):
                continue  # as the loop's `place_pending` skips it
            view = world.snapshot
            if self.blind is not None:
                view = self.blind.reallocated(view.clusters, view.running)
            request = request_of(job, now)
            # the loop's hold for faster GPUs (`controller.loop.placement._place_one`)
            wait = scheduler.soonest_wait(view, request, now)
            if wait is not None and wait.beats(now):
                self.waits[job.id] = wait
                continue
            result = scheduler.plan(view, request, objective_for(request))
            if isinstance(result, scheduler.Infeasible) and result.constraint == "deadline":
                request = request_of(job, now, with_deadline=False)
                result = scheduler.plan(view, request, objective_for(request))
            if (
                self.slack is not None
                and isinstance(result, scheduler.Plan)
                and request.qos.deadline_s is None
            ):
                if wait is not None and wait.beats(now, result.estimate):
                    # beats the fastest plan, so the cheaper one (no faster) too
                    self.waits[job.id] = wait
                    continue
                bound = (1 + self.slack) * result.estimate.total_time_s
                within = replace(request, qos=replace(request.qos, deadline_s=bound))
                cheaper = scheduler.plan(view, within, "cost-within-deadline")
                if isinstance(cheaper, scheduler.Plan):
                    result = cheaper
            if isinstance(result, scheduler.Infeasible) or result.victims:
                if isinstance(result, scheduler.Infeasible) and result.constraint == "capacity":
                    too_big = min(too_big, job.gpus)
                continue
            if wait is not None and wait.beats(now, result.estimate):
                self.waits[job.id] = wait
                continue
            est = result.estimate
            if self.blind is not None:  # what it really costs on the real links
                est = scheduler.estimate(
                    world.snapshot, request, result.placement, result.compression, result.sync
                )
            decision = Decision(job, result.placement, est)
            out.append(decision)
            world = decision.applied(world, now)
            free -= job.gpus
        return out


class SingleCluster(Policy):
    """Whole jobs on one cluster, first come first served, skipping jobs that do not fit now
    (Kueue's BestEffortFIFO); `pick` chooses among the clusters with room."""

    def __init__(
        self, name: str, pick: Callable[[list[scheduler.Cluster]], scheduler.Cluster]
    ) -> None:
        self.name = name
        self.pick = pick

    def schedule(self, now: float, pending: Sequence[TraceJob], world: World) -> list[Decision]:
        free = {c.name: c.gpus_free for c in world.snapshot.clusters if c.schedulable}
        by_name = world.snapshot.by_name
        out: list[Decision] = []
        most = max(free.values(), default=0)
        for job in pending:
            if job.gpus > most:
                continue
            fits = [by_name[n] for n, f in free.items() if f >= job.gpus]
            c = self.pick(fits)
            placement = (scheduler.Assignment(c.name, job.gpus),)
            alone = scheduler.Snapshot(clusters=(c,))
            est = scheduler.estimate(alone, request_of(job, now), placement)
            out.append(Decision(job, placement, est))
            free[c.name] -= job.gpus
            most = max(free.values())
        return out


def kueue() -> Policy:
    """Kueue / MultiKueue: the first cluster (in their configured order) that fits."""
    return SingleCluster("kueue-first-fit", lambda cs: cs[0])


def skypilot() -> Policy:
    """SkyPilot: the cheapest region (GPU-hour list price) with room for the whole job."""
    return SingleCluster(
        "skypilot-cheapest", lambda cs: min(cs, key=lambda c: (c.price_per_gpu_hour, c.name))
    )


def gavel_like() -> Policy:
    """Heterogeneity-aware, not splitting (Gavel-like): the fastest GPUs with room."""
    return SingleCluster(
        "gavel-fastest",
        lambda cs: min(cs, key=lambda c: (-c.peak_tflops, c.price_per_gpu_hour, c.name)),
    )


@dataclass
class Run:
    job: TraceJob
    start_s: float
    finish_s: float
    cost: float
    wan_bytes: int
    clusters: int
    placement: scheduler.Placement = ()
    prices: tuple[float, ...] = ()  # each assignment's GPU-hour price when it was placed


@dataclass
class Outcome:
    policy: str
    runs: list[Run]
    unfinished: int
    fleet_gpus: int
    busy: list[tuple[float, int]] = field(default_factory=list)  # (time, GPUs busy) steps
    cpu_s: float = 0.0  # process CPU time: robust on a shared machine


Reprice = Callable[[float, scheduler.Snapshot], scheduler.Snapshot]
"""The prices in force at a time: the snapshot with its clusters' prices as offered then."""


def simulate(
    policy: Policy, network: Network, trace: Sequence[TraceJob], reprice: Reprice | None = None
) -> Outcome:
    """Run the trace; `reprice`: prices that change over time (offers), applied at every
    scheduling instant before the policy decides (a job pays the prices it was placed at)."""
    import time

    # Set-up, not simulation: the network's both-ways link table and neighbour index (1.1M
    # entries at 10,000 clusters, about 1.6 CPU-seconds) are built once per network, as a
    # controller keeps them between passes; built here they stay out of `cpu_s`.
    _ = network.snapshot.directed_links, network.snapshot.neighbours
    t0 = time.process_time()
    world = World(network.snapshot, {})
    finishing: list[tuple[float, str]] = []
    running: dict[str, scheduler.RunningJob] = {}
    pending: list[TraceJob] = []
    runs: list[Run] = []
    busy, busy_now = [(0.0, 0)], 0
    i, n = 0, len(trace)
    while i < n or finishing:
        now = min(
            trace[i].arrival_s if i < n else math.inf, finishing[0][0] if finishing else math.inf
        )
        done = []
        while finishing and finishing[0][0] <= now:
            done.append(running.pop(heapq.heappop(finishing)[1]))
        if done:
            world = World(release(world.snapshot, done), world.origins)
            busy_now -= sum(r.gpus for r in done)
        while i < n and trace[i].arrival_s <= now:
            pending.append(trace[i])
            i += 1
        if reprice is not None and pending:
            world = World(reprice(now, world.snapshot), world.origins)
        decisions = policy.schedule(now, pending, world) if pending else []
        for d in decisions:
            priced = world.snapshot.by_name
            world = d.applied(world, now)
            running[d.job.id] = world.snapshot.running[-1]
            end = now + d.estimate.total_time_s
            heapq.heappush(finishing, (end, d.job.id))
            prices = tuple(priced[a.cluster].price_per_gpu_hour for a in d.placement)
            runs.append(
                Run(
                    d.job,
                    now,
                    end,
                    d.estimate.cost,
                    d.estimate.wan_bytes,
                    len(d.placement),
                    d.placement,
                    prices,
                )
            )
            busy_now += d.job.gpus
        if decisions:
            gone = {d.job.id for d in decisions}
            pending = [j for j in pending if j.id not in gone]
        busy.append((now, busy_now))
    return Outcome(policy.name, runs, len(pending), network.gpus, busy, time.process_time() - t0)
