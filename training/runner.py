"""The driver of a data-parallel run, in the shape of Ray Train v2's controller: a
`WorkerGroup` (one Ray actor per worker, pinned to its cluster) is created, set up, stepped a
segment at a time and shut down; `run` wraps it in a short restart loop that, on a lost
worker, starts a new group from the newest checkpoint (possibly on other clusters when the
caller resumes elastically).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from training.connections import Address
from training.faults import GroupBroken, Lost, Membership, Recovery, recover, ring_ordered
from training.logs import LogLine
from training.placement import cluster_resource
from training.ray_actors import (
    PROBE_GROUP,
    check_capacity,
    ensure_ray,
    kill,
    local_resources,
    outcomes,
    wait_all,
)
from training.results import AutoChoice, ExchangeCounters, SegmentResult, quality_of
from training.spec import Progress, TrainReport, TrainSpec

if TYPE_CHECKING:
    from training.checkpoint import CheckpointStore

__all__ = ["WorkerGroup", "WorkerPool", "local_resources", "run"]

SEATED_WHY = "its state crossed the WAN while it sat out the round it joined in"
"""A "seated" membership change: a cluster joined late trains from that step on."""


class WorkerPool:
    """Keeps worker actors alive between runs with the same placement.

    Starting a worker process (Python, torch, the task's data) costs seconds; benchmarks that
    run many jobs on one placement pass a pool to `run` and close it at the end.
    """

    def __init__(self) -> None:
        self._idle: dict[tuple[Any, ...], list[Any]] = {}

    def take(self, key: tuple[Any, ...]) -> list[Any] | None:
        return self._idle.pop(key, None)

    def give(self, key: tuple[Any, ...], actors: list[Any]) -> None:
        old = self._idle.pop(key, None)
        for a in old or []:
            kill(a)
        self._idle[key] = actors

    def close(self) -> None:
        for actors in self._idle.values():
            for a in actors:
                kill(a)
        self._idle.clear()


class SegmentBroken(Exception):
    """A segment some workers did not finish: which clusters are lost, and why."""

    def __init__(self, lost: dict[str, Lost], at: float, error: BaseException | None) -> None:
        super().__init__(f"lost {dict(lost)}: {error}")
        self.lost, self.at, self.error = lost, at, error


class WorkerGroup:
    """The workers of one attempt of a run: created (or taken from a pool), set up (the
    process group formed, the model built or restored), stepped a segment at a time, and shut
    down (closed and given back to the pool, or killed)."""

    def __init__(self, spec: TrainSpec, ifname: str | None, actors: list[Any], reused: bool):
        self.spec, self.ifname = spec, ifname
        self.actors = actors
        self.reused = reused
        self.ranks = ranks_of(spec)
        self.nodes: frozenset[str] = frozenset()
        """The Ray nodes its workers run on, once set up."""
        self.cores = 0
        """The fewest cores of a machine its workers run on, once set up."""
        self.addresses: frozenset[Address] = frozenset()
        """Where its workers' process groups listen, once set up (under fault domains)."""

    @classmethod
    def create(
        cls, spec: TrainSpec, ifname: str | None, name: str, pool: WorkerPool | None = None
    ) -> WorkerGroup:
        """One actor per worker on its cluster's resource, or a pool's idle ones for the
        same placement. `name` prefixes the actors' names (unique per attempt)."""

        ranks = ranks_of(spec)
        reused = pool.take(pool_key(spec, ifname)) if pool is not None else None
        if reused:
            return cls(spec, ifname, reused, True)
        actors = [_start(spec, rank, ranks, ifname, name) for rank in range(len(ranks))]
        return cls(spec, ifname, actors, False)

    def setup(self, resume_step: int | None) -> int:
        """Form the process group and build (or restore) the model; the step it starts at."""
        import ray

        if self.reused:
            wait_all(
                [
                    a.reinit.remote(self.spec, rank, self.ranks, self.ifname)
                    for rank, a in enumerate(self.actors)
                ]
            )
        master, port = ray.get(self.actors[0].address.remote(), timeout=300)
        step: int = wait_all([a.setup.remote(master, port, resume_step) for a in self.actors])[0]
        placed = ray.get([a.node.remote() for a in self.actors], timeout=300)
        self.nodes = frozenset(node for node, _ in placed)
        self.cores = min(cores for _, cores in placed)
        self._listen()
        return step

    def _listen(self) -> None:
        """Learn where the workers' groups listen: the addresses `_sever` hands out."""
        import ray

        if self.spec.fault_domains:
            got = ray.get([a.addresses.remote() for a in self.actors], timeout=300)
            self.addresses = frozenset().union(*got)

    def _sever(self, silent: set[int]) -> bool:
        """Every worker the driver still hears ends its connections to the process groups
        (all of them: the group re-forms anyway), so a collective blocked on the silent ones
        fails now. False where the groups' addresses are unknown (a mode that does not
        re-form: the grace window decides)."""
        if not self.addresses:
            return False
        for rank, a in enumerate(self.actors):
            if rank not in silent:
                a.sever.options(concurrency_group="probe").remote(self.addresses)
        return True

    def run_segment(self, until: int) -> list[SegmentResult]:
        """Train every worker to step `until`; rank 0 evaluates. The results in rank order.

        Under fault domains a segment some workers did not finish raises `SegmentBroken`,
        naming the clusters lost (a worker died, or did not answer within the grace window
        after another failed); any other error is raised as it came."""
        refs = [a.run.remote(until, rank == 0) for rank, a in enumerate(self.actors)]
        if not self.spec.fault_domains:
            return wait_all(refs)
        import ray

        # a peer blocked on a silent one fails within the grace window: wait that out
        done, failed_at = outcomes(
            refs, self.spec.fault_grace_s + 10.0, self.actors, on_silent=self._sever
        )
        if failed_at is None:
            return [o.value for o in done]
        lost: dict[str, Lost] = {}
        first: BaseException | None = None
        for cluster, o in zip(self.ranks, done, strict=True):
            err = o.error
            if not o.done:
                lost.setdefault(cluster, Lost.SILENT)
            elif isinstance(err, ray.exceptions.RayTaskError) and isinstance(
                err.cause, GroupBroken
            ):
                first = first or err
            elif isinstance(err, ray.exceptions.RayActorError):
                lost[cluster] = Lost.GONE
                first = first or err
            elif err is not None:
                raise err
        raise SegmentBroken(lost, failed_at, first)

    def resize(
        self, spec: TrainSpec, name: str, started: dict[str, list[Any]] | None = None
    ) -> tuple[WorkerGroup, int]:
        """The group on `spec.clusters` (clusters left or joined): the workers of clusters
        gone are ended, clusters joining bring theirs (`started`, already loaded) or new ones
        start; every member re-forms, keeping its own state, and a newcomer takes a peer's
        (`Worker._agree`). The new group and the step it stands at."""
        import ray

        ranks = ranks_of(spec)
        mine: dict[str, list[Any]] = {c: list(a) for c, a in (started or {}).items()}
        for c, a in zip(self.ranks, self.actors, strict=True):
            if c in spec.clusters:
                mine.setdefault(c, []).append(a)
            else:
                kill(a)
        actors: list[Any] = []
        fresh: list[Any] = []
        for rank, c in enumerate(ranks):
            kept = mine.get(c, [])
            if kept:
                a = kept.pop(0)
                a.regroup.remote(spec, rank, ranks, self.ifname)
            else:
                a = _start(spec, rank, ranks, self.ifname, name)
                fresh.append(a)
            actors.append(a)
        group = WorkerGroup(spec, self.ifname, actors, False)
        try:
            if fresh:  # started before anyone waits on them at the rendezvous
                ray.get([a.address.remote() for a in fresh], timeout=300)
            master, port = ray.get(actors[0].address.remote(), timeout=300)
            steps = wait_all([a.setup.remote(master, port, None, True) for a in actors])
            group._listen()
        except BaseException:
            group.kill()  # the caller restarts from a checkpoint
            raise
        return group, int(steps[0])

    def evaluate(self, last: SegmentResult) -> SegmentResult:
        """`last` with the model's quality now (a run stopped between evaluations)."""
        import ray

        ev = ray.get(self.actors[0].evaluate.remote())
        return replace(last, accuracy=ev.accuracy, eval_loss=ev.loss)

    def shutdown(self, pool: WorkerPool | None = None) -> None:
        """Close every worker; into `pool` for the next run on this placement, else ended."""
        import ray

        ray.get([a.close.remote() for a in self.actors], timeout=60)
        if pool is not None:
            pool.give(pool_key(self.spec, self.ifname), self.actors)
        else:
            self.kill()

    def kill(self) -> None:
        for a in self.actors:
            kill(a)


@dataclass
class Joining:
    """Clusters a running job is taking in: their workers started and loading the task
    (`Worker.prepare`) while the others train on; the run re-forms with them once every one
    is ready, at the end of a segment."""

    want: Membership
    """The caller's membership that asked for them."""
    actors: dict[str, list[Any]]
    prepared: list[Any]
    """The refs of their `prepare` calls."""
    began: float

    @classmethod
    def start(
        cls, spec: TrainSpec, clusters: list[str], ifname: str | None, name: str, want: Membership
    ) -> Joining:
        """The workers of `clusters` as ranks of `spec` (each takes its final rank when the
        group re-forms), each loading the task."""
        ranks = ranks_of(spec)
        actors: dict[str, list[Any]] = {}
        for rank, c in enumerate(ranks):
            if c in clusters:
                actors.setdefault(c, []).append(_start(spec, rank, ranks, ifname, name))
        prepared = [a.prepare.remote() for group in actors.values() for a in group]
        return cls(want, actors, prepared, time.perf_counter())

    def ready(self) -> bool:
        """Whether every newcomer finished loading (or failed to: `ray.get` says which)."""
        import ray

        done, _ = ray.wait(self.prepared, num_returns=len(self.prepared), timeout=0)
        return len(done) == len(self.prepared)

    def kill(self) -> None:
        for group in self.actors.values():
            for a in group:
                kill(a)


def _start(spec: TrainSpec, rank: int, ranks: list[str], ifname: str | None, name: str) -> Any:
    """The worker actor of `rank`, pinned to its cluster; `name` prefixes its actor name."""
    import ray

    from training.worker import Worker

    make: Any = ray.remote  # its stubs lack `concurrency_groups`
    remote: Any = make(concurrency_groups=PROBE_GROUP)(Worker)
    return remote.options(
        name=f"{name}-w{rank}",
        num_cpus=0,
        num_gpus=spec.gpus_per_worker,
        resources={cluster_resource(ranks[rank]): 1.0},
        max_restarts=0,
    ).remote(spec, rank, ranks, ifname)


def ranks_of(spec: TrainSpec) -> list[str]:
    """Each rank's cluster: the clusters' workers in order."""
    return [c for c, n in spec.clusters.items() for _ in range(n)]


def pool_key(spec: TrainSpec, ifname: str | None) -> tuple[Any, ...]:
    return (tuple(ranks_of(spec)), spec.gpus_per_worker, ifname)


def _validate(spec: TrainSpec) -> None:
    from training.tasks import check_entry

    spec.validate()  # sync and compression values through the shared grammar
    check_entry(spec.task)


def run(
    spec: TrainSpec,
    on_progress: Callable[[Progress], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    pool: WorkerPool | None = None,
    membership: Callable[[], Membership | None] | None = None,
) -> TrainReport:
    """Train `spec` to the end (or until `should_stop()`), return the report.

    Connects to `spec.ray_address` (or CPN_RAY_ADDRESS), reuses an initialised Ray, or starts
    a local one with one custom resource per cluster. ValueError for bad specs. With a `pool`,
    workers of an earlier run on the same placement are reused and kept for the next. Under
    fault domains a lost cluster leaves and the others go on; `membership()` (read between
    segments) takes clusters away or adds them (`training.faults`).
    """
    import ray

    from training.checkpoint import check_identity, open_store
    from training.sync import regroups

    _validate(spec)
    store = open_store(spec.checkpoint) if spec.checkpoint else None
    resume_step: int | None = None
    if store is not None:
        found = store.steps()
        if found and not spec.resume:
            raise ValueError(
                f"checkpoint: {spec.checkpoint!r} already holds checkpoints; "
                "pass resume (--resume) or use an empty directory"
            )
        spec = replace(spec, run_id=store.claim(spec.run_id))
        store.fence(spec.epoch)  # a stale attempt of this run may no longer write here
        resume_step = found[-1] if (found and spec.resume) else None

    def check_resume(step: int | None) -> None:
        """Read the checkpoint to resume from here, as data, before any worker does: another
        run's file, an old format or a pickled object is refused (ValueError) at once."""
        if store is not None and step is not None:
            check_identity(store.load(step), spec.run_id or "", spec.epoch, store.where(step))

    check_resume(resume_step)
    resumed_from = resume_step
    started, local = ensure_ray(spec)
    ifname = spec.gloo_ifname or os.environ.get("CPN_GLOO_IFNAME") or ("lo" if local else None)
    run_id = uuid.uuid4().hex[:8]
    live = spec.fault_domains and regroups(spec.sync)
    wanted = membership() if membership is not None else None
    seen_version = wanted.version if wanted is not None else 0
    seg = spec.eval_every or max(1, spec.steps // 20)
    base_compute, base_comm, base_intra = 0.0, 0.0, 0.0
    base_wan = ExchangeCounters()  # earlier groups' totals (a new group zeroes the workers')
    last: SegmentResult | None = None
    last_all: list[SegmentResult] = []
    history: list[dict[str, float]] = []
    changes: list[dict[str, Any]] = []
    decided: list[AutoChoice] = []
    """The auto policy's decisions so far, across restarts and regroups (each attempt's
    worker reports its own)."""
    restarts = 0
    regrouped = 0
    stopped = False
    t0: float | None = None

    def bank() -> None:
        """Fold the group's counters into the run's before a new group zeroes them."""
        nonlocal base_compute, base_comm, base_intra, base_wan
        if last is not None:
            base_compute += last.compute_s
            base_comm += last.comm_s
            base_intra += last.intra_s
            base_wan = base_wan + last.wan

    said: list[LogLine] = []

    def say(text: str) -> None:
        """A line of the driver's in the job's log (sent with the next report)."""
        now = time.time()
        said.extend(LogLine(now, "driver", "stderr", line) for line in text.splitlines())

    def note(
        step: int,
        cluster: str,
        change: str,
        why: str,
        workers: int,
        took: float,
        ready_s: float | None = None,
    ) -> None:
        """A membership change: `took`, what the run stood still for; `ready_s`, how long a
        newcomer started and loaded while the others trained on."""
        say(f"step {step}: cluster {cluster} {change} ({why}), {workers} worker(s)")
        changes.append(
            {
                "step": step,
                "cluster": cluster,
                "change": change,
                "why": why,
                "workers": workers,
                "recovery_s": round(took, 3),
                "wall_s": round(time.perf_counter() - (t0 or time.perf_counter()), 3),
                **({} if ready_s is None else {"ready_s": round(ready_s, 3)}),
            }
        )

    def change_to(
        group: WorkerGroup,
        step: int,
        new_spec: TrainSpec,
        started: dict[str, list[Any]],
        ready_s: float,
    ) -> tuple[WorkerGroup, int]:
        """Re-form `group` on `new_spec` (the caller's change; `started`: newcomers' workers,
        ready) and note who left and joined; a change that moves no cluster (a new plan on
        the same ones) re-forms too: its rates and shares are what the ports now hold."""
        nonlocal spec, last, regrouped
        if new_spec == spec:  # the same clusters, in the same order, on the same plan
            return group, step
        began = time.perf_counter()
        bank()
        last = None
        regrouped += 1
        group, step = group.resize(new_spec, f"cpn-{run_id}-g{regrouped}", started)
        took = time.perf_counter() - began
        for c in spec.clusters:
            if c not in new_spec.clusters:
                note(step, c, "left", Lost.REMOVED, spec.clusters[c], took)
        for c in new_spec.clusters:
            if c not in spec.clusters:
                note(step, c, "joined", "added", new_spec.clusters[c], took, ready_s)
        spec = new_spec
        return group, step

    joining: Joining | None = None
    nodes: set[str] = set()
    cores = 0  # of the machine where every worker ran, while they all ran on one
    try:
        check_capacity(spec)
        while True:  # one attempt a pass: a restart ends it, the next resumes
            group = WorkerGroup.create(
                spec, ifname, f"cpn-{run_id}-{restarts}", pool if restarts == 0 else None
            )
            last = None
            ended = False
            try:
                step = group.setup(resume_step)
                nodes |= group.nodes
                cores = group.cores if len(nodes) == 1 else 0
                if t0 is None:
                    t0 = time.perf_counter()
                broke_at: int | None = None
                while step < spec.steps:
                    if should_stop is not None and should_stop():
                        stopped = True
                        break
                    want = membership() if (membership is not None and live) else None
                    if want is not None and want.version > seen_version:
                        seen_version = want.version
                        if joining is not None:  # the caller changed its mind again
                            joining.kill()
                            joining = None
                        target = _follow(spec.clusters, want.clusters)
                        new_spec = _planned(spec, target, want)
                        newcomers = [c for c in target if c not in spec.clusters]
                        try:
                            check_capacity(new_spec)
                        except ValueError as exc:  # no worker slot there: stay as we are
                            for c in newcomers:
                                note(step, c, "refused", str(exc), target[c], 0.0)
                            continue
                        if newcomers:  # they start and load while the others train on
                            joining = Joining.start(
                                new_spec, newcomers, ifname, f"cpn-{run_id}-j{want.version}", want
                            )
                            say(f"step {step}: cluster(s) {', '.join(newcomers)} starting")
                        else:
                            group, step = change_to(group, step, new_spec, {}, 0.0)
                    if joining is not None and joining.ready():
                        came, joining = joining, None
                        try:
                            ray.get(came.prepared, timeout=60)
                        except ray.exceptions.RayError as exc:  # lost again while starting
                            came.kill()
                            for c, actors in came.actors.items():
                                note(step, c, "refused", str(exc)[:200], len(actors), 0.0)
                        else:
                            # the run's clusters now (one may have left meanwhile) and the
                            # newcomers, as the caller asked
                            target = _follow(
                                spec.clusters,
                                {
                                    c: n
                                    for c, n in came.want.clusters.items()
                                    if c in spec.clusters or c in came.actors
                                },
                            )
                            new_spec = _planned(spec, target, came.want)
                            group, step = change_to(
                                group, step, new_spec, came.actors, time.perf_counter() - came.began
                            )
                    try:
                        results = group.run_segment(min(step + seg, spec.steps))
                    except SegmentBroken as broken:
                        what = recover(
                            live=live,
                            clusters=list(spec.clusters),
                            lost=set(broken.lost),
                            restarts=restarts,
                            max_restarts=spec.max_restarts,
                            stuck=broke_at == step,
                        )
                        if what is Recovery.RESTART or what is Recovery.FAIL:
                            raise TimeoutError(str(broken)) from broken.error
                        broke_at = step
                        bank()
                        last = None
                        target = {c: n for c, n in spec.clusters.items() if c not in broken.lost}
                        new_spec = spec.with_clusters(target)
                        regrouped += 1
                        group, step = group.resize(new_spec, f"cpn-{run_id}-g{regrouped}")
                        took = time.monotonic() - broken.at
                        for c, why in broken.lost.items():
                            note(step, c, "left", why, spec.clusters[c], took)
                        spec = new_spec
                        continue
                    last, last_all = results[0], results
                    for c, at in last.seated:
                        note(at, c, "seated", SEATED_WHY, spec.clusters.get(c, 0), 0.0)
                    step = last.step
                    decided += [d for d in last.auto_decisions if d not in decided]
                    wall = time.perf_counter() - t0
                    wan = base_wan + last.wan
                    history.append(
                        {
                            "wall_s": wall,
                            "step": step,
                            "loss": last.loss,
                            "accuracy": last.accuracy,  # type: ignore[dict-item]
                            **({} if last.eval_loss is None else {"eval_loss": last.eval_loss}),
                        }
                    )
                    by_cluster: dict[str, float] = {}
                    for c, r in zip(group.ranks, results, strict=True):
                        by_cluster[c] = max(by_cluster.get(c, 0.0), r.compute_s)
                    if on_progress is not None:
                        printed = sorted((x for r in results for x in r.logs), key=attrgetter("at"))
                        on_progress(
                            Progress(
                                step=step,
                                total_steps=spec.steps,
                                loss=last.loss,
                                accuracy=last.accuracy,
                                wall_s=wall,
                                compute_s=base_compute + last.compute_s,
                                comm_s=base_comm + last.comm_s,
                                wan_bytes=wan.wan_bytes,
                                wan_bytes_total=wan.sent_bytes,
                                compression_ratio=wan.compression_ratio,
                                compression=last.compression,
                                restarts=restarts,
                                compute_by_cluster=by_cluster,
                                exchange_s=wan.wall_s,
                                clusters=dict(spec.clusters),
                                membership=list(changes),
                                auto_decisions=list(decided),
                                logs=[*said, *printed],
                            )
                        )
                        said.clear()
                if stopped and last is not None and last.accuracy is None:
                    last = group.evaluate(last)
                group.shutdown(pool if regrouped == 0 else None)
                ended = True
                break
            except (ray.exceptions.RayError, TimeoutError) as exc:
                if store is not None:  # a later attempt took over: stop, don't restart
                    store.check_fence(spec.epoch)
                if restarts >= spec.max_restarts:
                    raise RuntimeError(
                        f"training failed after {restarts} restart(s): {exc}"
                    ) from exc
                restarts += 1
                bank()
                found = store.steps() if store is not None else []
                resume_step = found[-1] if found else None
                say(f"restart {restarts} from step {resume_step or 0}: {exc}")
                check_resume(resume_step)
            finally:
                if not ended:
                    group.kill()
    finally:
        if joining is not None:
            joining.kill()
        if started:
            ray.shutdown()
    wall = time.perf_counter() - (t0 or time.perf_counter())
    wan = base_wan + last.wan if last is not None else base_wan
    links: list[dict[str, Any]] = [
        {"a": x.a, "b": x.b, "mbps": x.mbps, "rtt_ms": x.rtt_ms} for x in spec.links
    ]
    if spec.link_mbps is not None:
        links.append({"a": "*", "b": "*", "mbps": spec.link_mbps, "rtt_ms": spec.rtt_ms})
    final_acc = last.accuracy if last is not None else None
    quality = quality_of(history)
    artefact = _artefact(spec, store, last)
    warning = quality.warning
    if warning and artefact.get("which") == "best":
        warning += f"; the job keeps its best model (step {artefact['step']}): {artefact['where']}"
    steps_by_cluster: dict[str, int] = {}
    labels_by_cluster: dict[str, list[int]] = {}
    for c, r in zip(ranks_of(spec), last_all, strict=False):  # none: no segment ran
        steps_by_cluster[c] = max(steps_by_cluster.get(c, 0), r.local_steps)
        labels_by_cluster[c] = sorted(set(labels_by_cluster.get(c, [])) | set(r.labels_read))
    return TrainReport(
        task=spec.task,
        clusters=dict(spec.clusters),
        compression=str(spec.compression),
        sync=str(spec.sync),
        steps=last.step if last is not None else (resumed_from or 0),
        final_loss=last.loss if last is not None else float("nan"),
        final_accuracy=float(final_acc) if final_acc is not None else float("nan"),
        wall_s=wall,
        compute_s=base_compute + (last.compute_s if last is not None else 0.0),
        comm_s=base_comm + (last.comm_s if last is not None else 0.0),
        intra_s=base_intra + (last.intra_s if last is not None else 0.0),
        wan_wait_s=min((max(0.0, r.comm_s - r.intra_s) for r in last_all), default=None),
        wan_s=wan.wall_s,
        wan_bytes=wan.wan_bytes,
        wan_bytes_total=wan.sent_bytes,
        compression_ratio=wan.compression_ratio,
        wan_setup_bytes=wan.setup_bytes,
        wan_emulated=spec.emulated,
        hosts=len(nodes),
        host_cores=cores,
        links=links,
        restarts=restarts,
        resumed_from_step=resumed_from,
        stopped=stopped,
        history=history,
        steps_by_cluster=steps_by_cluster,
        data=spec.data,
        batch_shares=dict(last.batch_shares) if last is not None else {},
        sync_stats=dict(last.sync_stats) if last is not None else {},
        labels_by_cluster=labels_by_cluster if spec.data == "local" else {},
        auto_decisions=decided,
        final_eval_loss=(
            last.eval_loss if last is not None and last.eval_loss is not None else float("nan")
        ),
        best_step=quality.best_step,
        best_accuracy=quality.best_accuracy,
        best_eval_loss=quality.best_eval_loss,
        warning=warning,
        membership=changes,
        artefact=artefact,
    )


def _artefact(
    spec: TrainSpec, store: CheckpointStore | None, last: SegmentResult | None
) -> dict[str, Any]:
    """The model the run leaves: its best evaluation's where the spec keeps the best and one
    was kept, else the newest step checkpoint; {} where nothing was written."""
    if store is None:
        return {}
    best = last.best if last is not None else None
    if spec.artefact == "best" and best is not None:
        return {"which": "best", "where": store.where_best(), **best.header()}
    found = store.steps()
    if not found:
        return {}
    return {"which": "last", "step": found[-1], "where": store.where(found[-1])}


def _planned(spec: TrainSpec, target: dict[str, int], want: Membership) -> TrainSpec:
    """`spec` on the clusters `target`, in the caller's ring order, with the caller's plan
    for them (links, reserved rates, batch shares)."""
    return spec.with_clusters(
        ring_ordered(target, list(want.clusters)),
        links=want.links,
        wan_kbps=want.wan_kbps,
        batch_shares=want.batch_shares,
    )


def _follow(now: dict[str, int], wanted: dict[str, int]) -> dict[str, int]:
    """The clusters a run goes on with when the caller wants `wanted`: those of `now` it still
    wants (their worker counts kept: a running cluster is not resized), then its new ones."""
    kept = {c: n for c, n in now.items() if c in wanted}
    return {**kept, **{c: n for c, n in wanted.items() if c not in now}} if kept else dict(now)
