"""One data-parallel worker: a Ray actor pinned to its cluster (see `training.runner`).

The Worker owns the loop: data, forward/backward, the local optimizer step, progress and
checkpoints. What crosses clusters, and when, is its sync strategy's (`training.sync`), built
from the run's sync value; the Worker never looks at which mode it runs. The global batch of
each step is sharded over all ranks, and each rank's loss is weighted by its shard's share of
what the strategy's `scope` says (the global batch, or its cluster's), so the reduced
gradient is that batch's mean gradient.
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import socket
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from grammar import Sync
from training.auto import runs_auto
from training.checkpoint import FORMAT, PARTS, check_identity, open_store
from training.collective import Collective, flatten, split
from training.data import batch_indices, rank_weights, shard, shard_sizes
from training.faults import Agreement, GroupBroken, Position, agree, is_collective_error
from training.logs import capture
from training.residency import local_samples
from training.results import BestModel, SegmentResult, at_least_as_good
from training.spec import TrainSpec
from training.sync import Scope, SyncContext, SyncStrategy, make_sync_strategy, regroups
from training.tasks import Evaluation, Task, as_tensors, evaluate, load_task
from training.wan import LinkTable

CHECKPOINT_VERSION = FORMAT
TRANSFER_FLOOR_BYTES_S = 250_000.0
"""The slowest a peer's state may cross the WAN (2 Mbit/s) before its transfer counts as
failed: a joining cluster's wait is bounded by the state's size, not by the grace window."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        port: int = s.getsockname()[1]
        return port


class Worker:
    """The training loop of one rank. Wrapped with `ray.remote` by the runner."""

    def __init__(
        self, spec: TrainSpec, rank: int, ranks_cluster: list[str], gloo_ifname: str | None
    ) -> None:
        self.spec = spec
        self.rank = rank
        self.world = len(ranks_cluster)
        self.ranks_cluster = ranks_cluster
        self.clusters = list(dict.fromkeys(ranks_cluster))
        self.cluster = ranks_cluster[rank]
        self.cluster_ranks = [r for r, c in enumerate(ranks_cluster) if c == self.cluster]
        self.leader_ranks = [ranks_cluster.index(c) for c in self.clusters]
        self.is_leader = rank == self.cluster_ranks[0]
        self.sync: Sync = spec.sync
        self.live = spec.fault_domains and regroups(self.sync)
        """This rank re-forms with the others when a cluster leaves or joins (`regroup`)."""
        self.pending = False
        """The current step's local steps are done but its outer round (`after_step`) is not."""
        self.held: dict[str, Any] | None = None
        """This rank's own state across a `regroup`, in memory (no checkpoint is read)."""
        if gloo_ifname:
            os.environ["GLOO_SOCKET_IFNAME"] = gloo_ifname
        torch.set_num_threads(1)
        self.capture = capture(f"{self.cluster}/{rank}")
        """What this process prints, for the job's log (taken with each report)."""

    def reinit(
        self, spec: TrainSpec, rank: int, ranks_cluster: list[str], gloo_ifname: str | None
    ) -> None:
        """Reuse this process for another run (a `WorkerPool` keeps it warm): nothing the
        last run printed is reported as this one's."""
        self.close()
        self.capture.take()
        self.__init__(spec, rank, ranks_cluster, gloo_ifname)  # type: ignore[misc]

    def regroup(
        self, spec: TrainSpec, rank: int, ranks_cluster: list[str], gloo_ifname: str | None
    ) -> None:
        """Keep this rank's state in memory and leave its process group, to `setup` again
        as `rank` of the run on `spec.clusters` (a cluster left or joined)."""
        held = self.held if self.held is not None else self._state(own=True)
        pending = self.pending
        self.close()
        self.__init__(spec, rank, ranks_cluster, gloo_ifname)  # type: ignore[misc]
        self.held, self.pending = held, pending

    # ------------------------------------------------------------------ setup

    def ping(self) -> bool:
        """Answered on the actor's probe thread while `run` is busy: the driver tells a slow
        cluster from an unreachable one by it (`training.ray_actors.outcomes`)."""
        return True

    def address(self) -> tuple[str, int]:
        """Where rank 0 hosts the rendezvous store."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, master: str, port: int, resume_step: int | None, peer: bool = False) -> int:
        """Join the process groups, build the model, restore a checkpoint (or, re-forming
        with `peer`, this rank's held state, or a peer's); return the start step."""
        spec = self.spec
        # under fault domains a silent peer fails a collective after the grace window
        timeout = timedelta(seconds=spec.fault_grace_s if self.live else 120)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{master}:{port}",
            rank=self.rank,
            world_size=self.world,
            timeout=timeout,
        )
        use_gpu = spec.gpus_per_worker > 0 and torch.cuda.is_available()
        self.device = torch.device("cuda" if use_gpu else "cpu")
        # every rank must create every group, in the same order
        intra: Any = None
        for c in self.clusters:
            ranks = [r for r, x in enumerate(self.ranks_cluster) if x == c]
            g = dist.new_group(ranks, backend="nccl" if use_gpu else "gloo", timeout=timeout)
            if c == self.cluster:
                intra = g
        self.intra = intra
        self.leaders: Any = dist.new_group(self.leader_ranks, backend="gloo", timeout=timeout)

        task: Task = load_task(spec.task)
        self.task = task
        if spec.data == "local":  # only this cluster's samples, never another's
            self.x, self.y = local_samples(task, self.cluster, self.clusters)
        else:
            self.x, self.y = as_tensors(task.train)
        self.labels_read: set[int] = set()
        self.slowdown = float(spec.slowdown.get(self.cluster, 1.0))
        self.xe, self.ye = as_tensors(task.eval)
        self.batch = min(spec.batch_size or task.batch_size, len(self.x))
        torch.manual_seed(spec.seed)
        self.model: nn.Module = task.model()
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        shapes = [p.shape for p in self.model.parameters() if p.requires_grad]

        self.comm = Collective(
            rank=self.rank,
            ranks_cluster=self.ranks_cluster,
            intra=intra,
            leaders=self.leaders,
            names=names,
            shapes=shapes,
            device=self.device,
            links=LinkTable.build(spec.links, spec.link_mbps, spec.rtt_ms),
            link_schedule=spec.link_schedule,
            reserved_kbps=spec.wan_kbps.get(self.cluster),
            paced=bool(spec.wan_kbps),
        )
        # same start everywhere, whatever the seeding; the model crosses the WAN only if needed
        if not peer:
            self.comm.align_start(self.model)
        self.model.to(self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.shapes = [p.shape for p in self.params]
        self.weights = rank_weights(spec.batch_shares, self.ranks_cluster)
        sizes = shard_sizes(self.batch, self.world, self.weights)
        # each cluster's share of the global batch, as this run splits it
        self.cluster_shares = {
            c: sum(sizes[r] for r, x in enumerate(self.ranks_cluster) if x == c) / self.batch
            for c in self.clusters
        }
        ctx = SyncContext(
            spec=spec,
            comm=self.comm,
            model=self.model,
            params=self.params,
            apply=self._apply,
            cluster_share=sum(sizes[r] for r in self.cluster_ranks) / self.batch,
            device_s=lambda: self.device_s,
            reset_local=lambda: self.opt.state.clear(),
            cluster_shares=self.cluster_shares,
        )
        # the runtime's policy picks the rest, or re-decides what the plan left to it
        auto = runs_auto(spec.sync, spec.compression, adapt=bool(spec.adapt))
        self.strategy: SyncStrategy = make_sync_strategy(auto or self.sync, ctx)
        comp = self.comm.compressor(self.strategy.compression)
        no_momentum = comp.momentum_correction and self.strategy.exchanges_gradients
        self.opt = task.optimizer.build(self.params, lr=spec.lr, no_momentum=no_momentum)
        self.step = 0
        self.local_step = 0
        self.device_s = 0.0
        self.compute_s = 0.0
        self.comm_s = 0.0
        self.loss_sum = 0.0
        self.loss_n = 0
        self.ckpt_due = False
        self.last_ckpt = -1
        self.best = self._best_kept() if self.rank == 0 else None
        had = self.held is not None
        if self.held is not None:
            self._load(self.held)
            self.held = None
        elif resume_step is not None and spec.checkpoint:
            store = open_store(spec.checkpoint)
            self._restore(store.load(resume_step), store.where(resume_step))
        else:
            self.strategy.load_state_dict(None, None)
        if peer:
            self._agree(Position(self.step, self.pending) if had else Position(-1))
        return self.step

    def _agree(self, mine: Position) -> None:
        """After re-forming: members that stopped at the same place keep their own state
        (and finish the outer round the loss broke, among themselves); a newcomer, or a
        member that missed the end of a round, takes the state of one furthest on."""
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, (mine.step, mine.pending))
        plan = agree([Position(int(a), bool(b)) for a, b in gathered])
        if plan.finish_round:
            self.strategy.after_step(self.step)
            self.step += 1
            self.pending = False
        if plan.source is not None:
            self._pass_state(plan)

    def _pass_state(self, plan: Agreement) -> None:
        """The source's state to every receiver: across the WAN once per cluster (to its
        first receiving rank, which passes it on inside the cluster); read as data only.
        The state is a few times the model: its transfer is timed by its size (at least
        `TRANSFER_FLOOR_BYTES_S`), not by the grace window that bounds a training exchange."""
        source = plan.source
        assert source is not None
        data: torch.Tensor | None = None
        if self.rank == source:
            state = self._state(own=True)
            if all(self.ranks_cluster[r] != self.cluster for r in plan.receivers):
                # another cluster's inner optimizer and compressors are its own (a newcomer's
                # fresh): the model and the sync state (anchors, outer optimizer) are what it
                # takes, about half of what this cluster holds
                part = state["clusters"][self.cluster]
                del part["optimizer"]
                part["compressors"] = {}
            buf = io.BytesIO()
            torch.save(state, buf)
            data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        size = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64)
        dist.broadcast(size, src=source)
        n = int(size.item())
        timeout = timedelta(seconds=self.spec.fault_grace_s + n / TRANSFER_FLOOR_BYTES_S)
        first: dict[str, int] = {}
        for r in plan.receivers:
            cluster = self.ranks_cluster[r]
            src = first.setdefault(cluster, source)
            if src == source:
                first[cluster] = r
            if self.rank == src:
                assert data is not None
                work = dist.isend(data, dst=r)
                assert work is not None  # this rank is in the group
                work.wait(timeout=timeout)
            elif self.rank == r:
                data = torch.empty(n, dtype=torch.uint8)
                work = dist.irecv(data, src=src)
                assert work is not None
                work.wait(timeout=timeout)
        home = self.ranks_cluster[source]
        wan = {(home, c): n for c in first if c != home}  # every rank counts it alike
        if self.comm.exchanger is not None and wan:
            self.comm.exchanger.count_setup(wan)
        if self.rank in plan.receivers:
            assert data is not None
            state = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)
            self._load(state)
            self.pending = False

    # ------------------------------------------------------------------ one step

    def _grad_flat(self) -> torch.Tensor:
        return flatten([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params])

    def _local_backward(self, scope: Scope) -> None:
        """Forward/backward on this rank's shard, weighted by its share of the `scope` batch."""
        t0 = time.perf_counter()
        cpu0 = time.thread_time()
        idx = batch_indices(len(self.x), self.batch, self.spec.seed, self.local_step)
        mine = shard(idx, self.rank, self.world, self.weights)
        x, y = self.x[mine].to(self.device), self.y[mine].to(self.device)
        if self.spec.data == "local" and y.dim() == 1:
            self.labels_read.update(int(v) for v in y.unique())
        self.model.train()
        self.opt.zero_grad(set_to_none=False)
        loss = self.task.loss(self.model(x), y)
        if scope is Scope.GLOBAL:
            denom = len(idx)
        else:  # the cluster's batch
            sizes = shard_sizes(len(idx), self.world, self.weights)
            denom = sum(sizes[r] for r in self.cluster_ranks)
        (loss * (len(mine) / denom)).backward()
        self.loss_sum += float(loss.detach())
        self.loss_n += 1
        self.device_s = (time.thread_time() - cpu0) * self.slowdown
        if self.slowdown > 1.0:  # an emulated slower cluster: wait out the extra compute
            time.sleep((self.slowdown - 1.0) * (time.perf_counter() - t0))

    def _apply(self, flat: torch.Tensor) -> None:
        """A local optimizer step with the flat gradient `flat`."""
        for p, g in zip(self.params, split(flat, self.shapes), strict=True):
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
        self.opt.step()

    def _train_step(self) -> None:
        """One step: `local_steps` local steps (several on a fast cluster in modes that let
        it run ahead), then the strategy's `after_step`."""
        strategy = self.strategy
        for _ in range(strategy.local_steps(self.step)):
            t0 = time.perf_counter()
            self._local_backward(strategy.scope)
            t1 = time.perf_counter()
            update = strategy.after_backward(self._grad_flat(), self.step, t1 - t0)
            t2 = time.perf_counter()
            self._apply(update)
            t3 = time.perf_counter()
            self.compute_s += (t1 - t0) + (t3 - t2)
            self.comm_s += t2 - t1
            self.local_step += 1
        t3 = time.perf_counter()
        self.pending = strategy.global_rounds  # a loss from here on leaves the round to finish
        strategy.after_step(self.step)
        self.comm_s += time.perf_counter() - t3
        self.step += 1
        self.pending = False

    # ------------------------------------------------------------------ driver calls

    def run(self, until: int, evaluate: bool) -> SegmentResult:
        """Train up to step `until`, checkpointing on the way; stats for the driver. Under
        fault domains a failed collective leaves the process group (so peers waiting on
        this rank fail at once, not after the grace window) and raises GroupBroken: the
        state stays, for `regroup`."""
        if not self.live:
            return self._run(until, evaluate)
        try:
            return self._run(until, evaluate)
        except Exception as exc:
            if not is_collective_error(exc):
                raise
            why = f"rank {self.rank} ({self.cluster}) at step {self.step}: {str(exc)[:200]}"
        # out of the handler: the traceback's frames (and the groups they hold) are gone
        self._leave()
        raise GroupBroken(why)

    def _leave(self) -> None:
        """Hold this rank's state in memory and drop every process group: once nothing
        refers to a group its sockets close, so a peer blocked on this rank fails now, not
        after the grace window (gloo's abort leaves them open)."""
        strategy: SyncStrategy | None = getattr(self, "strategy", None)
        if strategy is not None:
            strategy.abandon()
        self.held = self._state(own=True)
        if strategy is not None:
            strategy.close()
            del self.strategy
        self.comm = None  # type: ignore[assignment]
        self.leaders = self.intra = None
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        gc.collect()

    def _run(self, until: int, evaluate: bool) -> SegmentResult:
        spec = self.spec
        until = min(until, spec.steps)
        every = spec.checkpoint_every
        while self.step < until:
            self._train_step()
            if self.step == spec.steps:
                t0 = time.perf_counter()
                self.strategy.finish()
                self.comm_s += time.perf_counter() - t0
            if spec.checkpoint and every and self.step % every == 0:
                self.ckpt_due = True
            if self.ckpt_due and self.strategy.at_sync_point(self.step):
                self._checkpoint()
        if spec.checkpoint and self.step == spec.steps and self.last_ckpt != self.step:
            self._checkpoint()
        return self._stats(evaluate)

    def _stats(self, evaluate: bool) -> SegmentResult:
        ev = self.evaluate() if evaluate else None
        if ev is not None:
            self._keep_if_best(ev)
        loss = self.loss_sum / max(self.loss_n, 1)
        self.loss_sum, self.loss_n = 0.0, 0
        return SegmentResult(
            step=self.step,
            loss=loss,
            accuracy=ev.accuracy if ev is not None else None,
            eval_loss=ev.loss if ev is not None else None,
            compute_s=self.compute_s,
            comm_s=self.comm_s,
            intra_s=self.comm.intra_s,
            compression=str(self.strategy.compression),
            wan=self.comm.counters,
            local_steps=self.local_step,
            batch_shares=dict(self.cluster_shares),
            sync_stats=self.strategy.stats(),
            labels_read=tuple(sorted(self.labels_read)),
            auto_decisions=self.strategy.decisions(),
            logs=self.capture.take(),
            best=self.best,
        )

    def evaluate(self) -> Evaluation:
        return evaluate(self.task, self.model, self.xe, self.ye, self.device)

    # ------------------------------------------------------------------ checkpoints

    def _checkpoint(self) -> None:
        """Each cluster's leader writes its cluster's part from where it is (its optimizer and
        compressor state are as large as the model, twice: gathering them to rank 0 crossed the
        WAN with all of it at every checkpoint); after a barrier, rank 0 writes the checkpoint
        (the model, its own cluster's part, the sync state) naming the others' parts."""
        self.ckpt_due = False
        self.last_ckpt = self.step
        if not self.is_leader:
            return
        store = open_store(self.spec.checkpoint or "")
        mine = self._mine()
        if self.rank != 0:
            store.save_part(self.step, self.cluster, self.spec.epoch, mine)
        dist.barrier(group=self.leaders)  # every part is written before a checkpoint names it
        if self.rank != 0:
            return
        state = self._state(clusters={self.cluster: mine})
        state[PARTS] = [c for c in self.clusters if c != self.cluster]
        store.save(self.step, state)

    def _keeps_best(self) -> bool:
        return bool(self.spec.checkpoint) and self.spec.artefact == "best" and self.rank == 0

    def _best_kept(self) -> BestModel | None:
        """The best model an earlier attempt of this run kept (a restart goes on from it)."""
        if not self._keeps_best():
            return None
        kept = open_store(self.spec.checkpoint or "").best()
        if kept is None or kept.get("run_id") != self.spec.run_id:
            return None
        loss = kept.get("eval_loss")
        return BestModel(
            int(kept["step"]), float(kept["accuracy"]), None if loss is None else float(loss)
        )

    def _keep_if_best(self, ev: Evaluation) -> None:
        """Rank 0, after an evaluation: keep the model when it is the run's best so far (by
        the rule `quality_of` judges the run with)."""
        if not self._keeps_best():
            return
        best = self.best
        if not at_least_as_good(ev.accuracy, ev.loss, None if best is None else best.header()):
            return
        kept = BestModel(self.step, ev.accuracy, ev.loss)
        state = {
            "version": CHECKPOINT_VERSION,
            "run_id": self.spec.run_id,
            "epoch": self.spec.epoch,
            "task": self.spec.task,
            "model": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
            **kept.header(),
        }
        open_store(self.spec.checkpoint or "").save_best(state)
        self.best = kept

    def _mine(self) -> dict[str, Any]:
        """This rank's part of a checkpoint (a leader's is its cluster's)."""
        sync_part = self.strategy.cluster_state()  # first: no exchange left in flight
        return {
            "optimizer": self.opt.state_dict(),
            "rng": torch.get_rng_state(),
            "local_step": self.local_step,
            **sync_part,
            "compressors": {k: c.state_dict() for k, c in self.comm.compressors.items()},
        }

    def _state(
        self, *, clusters: dict[str, Any] | None = None, own: bool = False
    ) -> dict[str, Any]:
        """A checkpoint's contents: the model, each cluster's part (`clusters`, or with
        `own` only this rank's), the sync state."""
        return {
            "version": CHECKPOINT_VERSION,
            "run_id": self.spec.run_id,
            "epoch": self.spec.epoch,
            "step": self.step,
            "task": self.spec.task,
            "seed": self.spec.seed,
            "batch": self.batch,
            "model": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
            "clusters": {self.cluster: self._mine()} if own else dict(clusters or {}),
            "sync": {
                "kind": self.sync.kind.value,
                "compression": str(self.strategy.compression),
                "compute_ema": self.comm.compute_ema,
                **self.strategy.state_dict(),
            },
        }

    def _restore(self, state: dict[str, Any], where: str) -> None:
        # the driver checked it already (`training.runner`); a file swapped since is refused
        check_identity(state, self.spec.run_id or "", self.spec.epoch, where)
        self._load(state)

    def _load(self, state: dict[str, Any]) -> None:
        """Take `state` (a checkpoint, or a peer's or this rank's own held in memory)."""
        if state["task"] != self.spec.task:
            raise ValueError(f"checkpoint is for task {state['task']!r}, not {self.spec.task!r}")
        self.step = int(state["step"])
        self.local_step = self.step
        self.model.load_state_dict(state["model"])
        clusters: dict[str, Any] = state["clusters"]
        # elastic: a new cluster takes the first cluster's optimizer state and fresh compressors
        entry = clusters.get(self.cluster) or next(iter(clusters.values()))
        if entry.get("model") is not None:  # clusters' parameters differed: this one's own view
            self.model.load_state_dict(entry["model"])
        # an optimizer of another kind (e.g. momentum correction now on) starts fresh, and
        # a peer's state passed to another cluster carries none (`_pass_state`)
        with contextlib.suppress(ValueError):
            if "optimizer" in entry:
                self.opt.load_state_dict(entry["optimizer"])
        sync = state["sync"]
        if sync.get("kind") == self.sync.kind.value:
            self.comm.compute_ema = float(sync.get("compute_ema", 0.0))
            self.strategy.load_state_dict(sync, entry)
        else:  # written by another sync mode: its sync state means nothing here
            self.strategy.load_state_dict(None, None)
        if clusters.get(self.cluster) is not None:
            self.local_step = int(clusters[self.cluster].get("local_step", self.step))
            torch.set_rng_state(clusters[self.cluster]["rng"])
            for level, cstate in clusters[self.cluster]["compressors"].items():
                self.comm.compressor(level).load_state_dict(cstate)

    def close(self) -> None:
        strategy: SyncStrategy | None = getattr(self, "strategy", None)
        if strategy is not None:
            strategy.close()
            del self.strategy
        if dist.is_initialized():
            dist.destroy_process_group()
