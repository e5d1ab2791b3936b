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
import hashlib
import io
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map_only

from grammar import Sync
from training import connections
from training.auto import runs_auto
from training.checkpoint import FORMAT, PARTS, check_identity, open_store
from training.collective import Collective, flatten, split
from training.connections import Address
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


@dataclass(frozen=True)
class Loaded:
    """A task and the samples a rank trains and evaluates on, for the run that `key` names
    (task, data residency, cluster, clusters)."""

    key: tuple[Any, ...]
    task: Task
    x: torch.Tensor
    y: torch.Tensor
    xe: torch.Tensor
    ye: torch.Tensor

    def samples(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.x, self.y, self.xe, self.ye


class Receiving:
    """A peer's state on its way to this rank (`Worker._pass_state`), waited for on a
    thread of its own (gloo says a receive is done only to the one who waits on it), which
    passes it on to `mates` (this cluster's other receivers) once it is here."""

    def __init__(
        self, work: Any, data: torch.Tensor, timeout: timedelta, mates: list[int], group: Any
    ) -> None:
        self.work, self.data, self.timeout = work, data, timeout
        self.mates, self.group = mates, group
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._wait, name="cpn-peer-state", daemon=True)
        self.thread.start()

    def _wait(self) -> None:
        try:
            self.work.wait(timeout=self.timeout)
            for dst in self.mates:
                work = dist.isend(self.data, dst=dst, group=self.group)
                assert work is not None
                work.wait(timeout=self.timeout)
        except BaseException as exc:  # noqa: BLE001 - raised where the state is taken
            self.error = exc
        finally:
            self.done.set()

    def arrived(self) -> bool:
        return self.done.is_set()

    def result(self) -> torch.Tensor:
        """The state's bytes, once here (and passed on); the transfer's error if it failed."""
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.data


def _stored_once(state: dict[str, Any]) -> dict[str, Any]:
    """`state` with each tensor of its sync state that equals one of the model's replaced by
    that one, which `torch.save` then writes once: at the end of an outer round the anchors
    are the model, and a peer's state crosses the WAN a third smaller, exactly."""
    model: dict[tuple[Any, ...], list[torch.Tensor]] = {}
    for t in state["model"].values():
        model.setdefault((t.shape, t.dtype), []).append(t)

    def same(x: torch.Tensor) -> torch.Tensor:
        return next((m for m in model.get((x.shape, x.dtype), []) if torch.equal(m, x)), x)

    return {**state, "sync": tree_map_only(torch.Tensor, same, state["sync"])}


def _own_copies(state: dict[str, Any]) -> dict[str, Any]:
    """`state` (as read) with its sync state's tensors copied: after `_stored_once` some
    share storage with the model's or with each other, and an optimizer takes its state
    tensors as they come."""
    return {**state, "sync": tree_map_only(torch.Tensor, torch.clone, state["sync"])}


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
        self.listeners: frozenset[Address] = frozenset()
        """Where this rank's groups listen, once set up: the driver hands them to the others,
        to `sever`."""
        self.pending = False
        """The current step's local steps are done but its outer round (`after_step`) is not."""
        self.held: dict[str, Any] | None = None
        """This rank's own state across a `regroup`, in memory (no checkpoint is read)."""
        self.idle: frozenset[int] = frozenset()
        """Ranks that joined late (`_agree`): they train nothing and weigh nothing until the
        end of the first round by which every one of them has its peer's state (`_seat`)."""
        self.seated: list[tuple[str, int]] = []
        """Clusters seated late since the last report, with the step they train from."""
        self.receiving: Receiving | None = None
        self.sending: list[tuple[Any, torch.Tensor]] = []
        """A peer's state on its way from this rank: (work, buffer)."""
        self.transfer_timeout = timedelta(seconds=spec.fault_grace_s)
        if gloo_ifname:
            os.environ["GLOO_SOCKET_IFNAME"] = gloo_ifname
        torch.set_num_threads(1)
        self.capture = capture(f"{self.cluster}/{rank}")
        """What this process prints, for the job's log (taken with each report)."""
        self.loaded: Loaded | None = None
        """The task and its samples, kept across `regroup` and `reinit` (`prepare`)."""

    def reinit(
        self, spec: TrainSpec, rank: int, ranks_cluster: list[str], gloo_ifname: str | None
    ) -> None:
        """Reuse this process for another run (a `WorkerPool` keeps it warm): nothing the
        last run printed is reported as this one's."""
        self.close()
        self.capture.take()
        loaded = self.loaded
        self.__init__(spec, rank, ranks_cluster, gloo_ifname)  # type: ignore[misc]
        self.loaded = loaded

    def regroup(
        self, spec: TrainSpec, rank: int, ranks_cluster: list[str], gloo_ifname: str | None
    ) -> None:
        """Keep this rank's state in memory and leave its process group, to `setup` again
        as `rank` of the run on `spec.clusters` (a cluster left or joined)."""
        held = self.held
        if held is None and hasattr(self, "strategy") and not self._unseated():
            held = self._state(own=True)  # else a newcomer still: it holds no state of its own
        pending, loaded = self.pending, self.loaded
        trained = getattr(self, "trained", 0)
        self.close()
        self.__init__(spec, rank, ranks_cluster, gloo_ifname)  # type: ignore[misc]
        self.held, self.pending, self.loaded = held, pending, loaded
        self.trained_before = trained  # the same attempt goes on: `setup` keeps counting

    # ------------------------------------------------------------------ setup

    def ping(self) -> bool:
        """Answered on the actor's probe thread while `run` is busy: the driver tells a slow
        cluster from an unreachable one by it (`training.ray_actors.outcomes`)."""
        return True

    def addresses(self) -> frozenset[Address]:
        """Where this rank's process groups listen (for the others' `sever`)."""
        return self.listeners

    def sever(self, addresses: frozenset[Address]) -> int:
        """On the probe thread: end this rank's connections to and from the groups listening
        at `addresses` (every rank's), so a collective blocked on a peer the driver cannot
        reach fails now and this rank re-forms with the others (`training.connections`)."""
        n = connections.sever(addresses, self.addresses())
        print(f"a peer is unreachable: {n} group connections ended", flush=True)
        return n

    def prepare(self) -> None:
        """Load the task and this rank's samples: seconds that a cluster joining a running
        job spends while the others train on (`training.runner`), not while they wait."""
        spec = self.spec
        key = (spec.task, spec.data, self.cluster, tuple(self.clusters))
        if self.loaded is not None and self.loaded.key == key:
            return
        task: Task = load_task(spec.task)
        if spec.data == "local":  # only this cluster's samples, never another's
            x, y = local_samples(task, self.cluster, self.clusters)
        else:
            x, y = as_tensors(task.train)
        xe, ye = as_tensors(task.eval)
        self.loaded = Loaded(key, task, x, y, xe, ye)

    def node(self) -> tuple[str, int]:
        """The Ray node this worker runs on and that machine's cores: workers on one node
        start and compute on its cores, so a run's set-up and its steps grow with them there
        (`TrainReport.hosts`, `TrainReport.host_cores`)."""
        import ray

        return str(ray.get_runtime_context().get_node_id()), os.cpu_count() or 1

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
        before = connections.listening() if self.live else frozenset()
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
        # a peer's state crosses on a group of its own, beside the training's collectives
        self.transfer: Any = (
            dist.new_group(list(range(self.world)), backend="gloo", timeout=timeout)
            if self.live
            else None
        )
        self.listeners = connections.listening() - before if self.live else frozenset()

        self.prepare()
        assert self.loaded is not None
        task = self.task = self.loaded.task
        self.x, self.y, self.xe, self.ye = self.loaded.samples()
        self.labels_read: set[int] = set()
        self.slowdown = float(spec.slowdown.get(self.cluster, 1.0))
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
            tree=spec.tree,
        )
        # same start everywhere, whatever the seeding; the model crosses the WAN only if needed
        if not peer:
            self.comm.align_start(self.model)
        self.model.to(self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.shapes = [p.shape for p in self.params]
        self._split()
        self.ctx = ctx = SyncContext(
            spec=spec,
            comm=self.comm,
            model=self.model,
            params=self.params,
            apply=self._apply,
            cluster_share=self.cluster_shares[self.cluster],
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
        self.trained = getattr(self, "trained_before", 0)
        """Local optimizer steps this worker took in this attempt, across regroups
        (`local_step` is its data position: a newcomer starts at the others' and advances
        it while it sits out)."""
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
        member that missed the end of a round, takes the state of one furthest on. Where the
        mode seats a member late (`SyncStrategy.seats_at`) and the receivers are whole
        clusters, the others train on while the state crosses the WAN."""
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, (mine.step, mine.pending))
        positions = [Position(int(a), bool(b)) for a, b in gathered]
        plan = agree(positions)
        if plan.finish_round:
            self.strategy.after_step(self.step)
            self.step += 1
            self.pending = False
        if plan.source is None:
            return
        at = positions[plan.source].step
        seat = self.strategy.seats_at(at)
        receivers = set(plan.receivers)
        whole = all(
            r in receivers
            for r, c in enumerate(self.ranks_cluster)
            if c in {self.ranks_cluster[x] for x in receivers}
        )
        late = seat is not None and seat > at and whole
        self._pass_state(plan, late)
        if not late:
            self._catch_up()
            self._sent()
            return
        self.idle = frozenset(receivers)
        self.strategy.sitting_out(True)
        self._split(self.idle)
        if self.rank in receivers:
            self.step = self.local_step = at  # where the others stand
            self.strategy.defer()  # its rounds' outcomes, kept until its state is here

    def _pass_state(self, plan: Agreement, late: bool) -> None:
        """Start the source's state on its way to every receiver: across the WAN once per
        cluster (to its first receiving rank, which passes it on inside the cluster, once it
        has it: `_catch_up`); read as data only. The state is a few times the model: its
        transfer is timed by its size (at least `TRANSFER_FLOOR_BYTES_S`), not by the grace
        window that bounds a training exchange. Receivers seated `late` are sent no
        parameters: they train none before the outer step that sets them from the anchors."""
        source = plan.source
        assert source is not None
        data: torch.Tensor | None = None
        if self.rank == source:
            state = self._state(own=True)
            if all(self.ranks_cluster[r] != self.cluster for r in plan.receivers):
                # another cluster's inner optimizer and compressors are its own (a newcomer's
                # fresh): the model and the sync state (anchors, outer optimizer) are what it
                # takes
                part = state["clusters"][self.cluster]
                del part["optimizer"]
                part["compressors"] = {}
            if late:
                params = {n for n, _ in self.model.named_parameters(remove_duplicate=False)}
                state["model"] = {k: v for k, v in state["model"].items() if k not in params}
            buf = io.BytesIO()
            torch.save(_stored_once(state), buf)
            data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        size = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64)
        dist.broadcast(size, src=source)
        n = int(size.item())
        timeout = timedelta(seconds=self.spec.fault_grace_s + n / TRANSFER_FLOOR_BYTES_S)
        first: dict[str, int] = {}
        for r in plan.receivers:
            first.setdefault(self.ranks_cluster[r], r)
        if self.rank == source:
            assert data is not None
            for dst in first.values():
                work = dist.isend(data, dst=dst, group=self.transfer)
                assert work is not None  # this rank is in the group
                self.sending.append((work, data))
        elif self.rank in plan.receivers:
            lead = first[self.cluster]
            buf_in = torch.empty(n, dtype=torch.uint8)
            src = source if self.rank == lead else lead
            work = dist.irecv(buf_in, src=src, group=self.transfer)
            assert work is not None
            mates = [r for r in plan.receivers if self.ranks_cluster[r] == self.cluster]
            mates.remove(lead)
            self.receiving = Receiving(
                work, buf_in, timeout, mates if self.rank == lead else [], self.transfer
            )
        home = self.ranks_cluster[source]
        wan = {(home, c): n for c in first if c != home}  # every rank counts it alike
        if self.comm.exchanger is not None and wan:
            self.comm.exchanger.count_setup(wan)
        self.transfer_timeout = timeout

    def _catch_up(self) -> None:
        """A receiver: wait for the peer's state, pass it on to this cluster's other
        receivers (the first one's task), and take it."""
        got, self.receiving = self.receiving, None
        if got is None:
            return
        data = got.result()
        state = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)
        step, local_step = self.step, self.local_step
        self._load(_own_copies(state), params=self.rank not in self.idle)
        self.pending = False
        if self.rank in self.idle:  # joined late: the rounds since the state was taken
            self.strategy.replay()
            self.step, self.local_step = step, local_step

    def _seat(self) -> None:
        """At a round's end while ranks sit out: every rank says whether its state is still
        on its way; once none is, everyone takes it and takes part from the next step. No
        rank takes its state before the others have theirs: taking it replays the rounds in
        flight (`SyncStrategy.replay`), and a cluster's ranks that replayed at different
        round ends would apply different rounds at the same step (their broadcasts crossed)."""
        waiting = torch.tensor([int(self.receiving is not None and not self.receiving.arrived())])
        dist.all_reduce(waiting, op=dist.ReduceOp.MAX)
        if int(waiting.item()) == 0:
            self._seated()

    def _seated(self) -> None:
        """Everyone takes part from the next step (the late members' states are here, or
        waited for now)."""
        came = sorted({self.ranks_cluster[r] for r in self.idle})
        self.seated += [(c, self.step) for c in came]
        self._catch_up()
        self._sent()
        self.idle = frozenset()
        self.strategy.sitting_out(False)
        self._split()

    def _sent(self) -> None:
        """The source: wait until the state it sends has arrived (at once where the
        receivers wait for it; at their seat, where every receiver has it)."""
        sending, self.sending = self.sending, []
        for work, _ in sending:
            work.wait(timeout=self.transfer_timeout)

    def _unseated(self) -> bool:
        """Whether this rank joined and holds no state of its own yet (its peer's state has
        not arrived, or it sits out the round it joined in): re-forming again, it is a
        newcomer still."""
        return self.receiving is not None or self.rank in self.idle

    def _split(self, idle: frozenset[int] = frozenset()) -> None:
        """Each rank's part of the global batch (the plan's shares; nothing for the `idle`
        ranks), and each cluster's share of it, which the strategy weighs its exchange by."""
        weights = rank_weights(self.spec.batch_shares, self.ranks_cluster)
        if idle:
            weights = [0.0 if r in idle else w for r, w in enumerate(weights or [1.0] * self.world)]
        self.weights = weights
        sizes = shard_sizes(self.batch, self.world, weights)
        self.cluster_shares = {
            c: sum(sizes[r] for r, x in enumerate(self.ranks_cluster) if x == c) / self.batch
            for c in self.clusters
        }
        ctx: SyncContext | None = getattr(self, "ctx", None)
        if ctx is not None:
            ctx.cluster_shares = self.cluster_shares
            ctx.cluster_share = self.cluster_shares[self.cluster]

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
        if self.rank in self.idle:  # sitting out: its state is on its way, or here (`_seat`)
            self.local_step += strategy.local_steps(self.step)  # the batches the others draw
            todo = 0
        else:
            todo = strategy.local_steps(self.step)
        for _ in range(todo):
            t0 = time.perf_counter()
            self._local_backward(strategy.scope)
            t1 = time.perf_counter()
            update = strategy.after_backward(self._grad_flat(), self.step, t1 - t0)
            t2 = time.perf_counter()
            self._apply(update)
            strategy.after_local_step()
            t3 = time.perf_counter()
            self.compute_s += (t1 - t0) + (t3 - t2)
            self.comm_s += t2 - t1
            self.local_step += 1
            self.trained += 1
        t3 = time.perf_counter()
        self.pending = strategy.global_rounds  # a loss from here on leaves the round to finish
        strategy.after_step(self.step)
        self.comm_s += time.perf_counter() - t3
        self.step += 1
        self.pending = False
        if self.idle and self.strategy.seats_at(self.step - 1) == self.step:
            self._seat()  # a round's end

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
        self.held = None if self._unseated() else self._state(own=True)
        if strategy is not None:
            strategy.close()
            del self.strategy
        self.comm = None  # type: ignore[assignment]
        self.leaders = self.intra = self.transfer = None
        if hasattr(self, "ctx"):  # it holds the Collective, and with it the groups
            del self.ctx
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
            if self.step == spec.steps and 0 in self.idle:
                self._seated()  # rank 0 evaluates and writes the model: it waits for its state
            # others still sitting out end without theirs: they trained nothing, and hold
            # nothing anyone reads (the checkpoint leaves their clusters out)
            if self.ckpt_due and 0 not in self.idle and self.strategy.at_sync_point(self.step):
                self._checkpoint()
        if spec.checkpoint and self.step == spec.steps and self.last_ckpt != self.step:
            self._checkpoint()
        return self._stats(evaluate)

    def _stats(self, evaluate: bool) -> SegmentResult:
        sitting = self.rank in self.idle  # its model is a peer's, old, or a fresh one
        ev = self.evaluate() if evaluate and not sitting else None
        if ev is not None:
            self._keep_if_best(ev)
        loss = self.loss_sum / max(self.loss_n, 1)
        self.loss_sum, self.loss_n = 0.0, 0
        if self.is_leader and not sitting:  # one line per cluster and report: `cpn logs` reads it
            said = f"step {self.step}/{self.spec.steps} loss {loss:.4f}"
            if ev is not None:
                said += f" eval_loss {ev.loss:.4f} accuracy {ev.accuracy:.3f}"
            print(said, flush=True)
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
            local_steps=self.trained,
            batch_shares=dict(self.cluster_shares),
            sync_stats=self.strategy.stats(),
            labels_read=tuple(sorted(self.labels_read)),
            auto_decisions=self.strategy.decisions(),
            logs=self.capture.take(),
            best=self.best,
            seated=tuple(self._take_seated()),
        )

    def _take_seated(self) -> list[tuple[str, int]]:
        seated, self.seated = self.seated, []
        return seated

    def evaluate(self) -> Evaluation:
        return evaluate(self.task, self.model, self.xe, self.ye, self.device)

    def digest(self) -> str:
        """A hash of this rank's parameters: members that hold the same model agree on it
        (at the end of an outer round every member of a local-SGD run does)."""
        h = hashlib.sha256()
        for p in self.params:
            h.update(p.detach().cpu().numpy().tobytes())
        return h.hexdigest()

    # ------------------------------------------------------------------ checkpoints

    def _checkpoint(self) -> None:
        """Each cluster's leader writes its cluster's part from where it is (its optimizer and
        compressor state are as large as the model, twice: gathering them to rank 0 crossed the
        WAN with all of it at every checkpoint); after a barrier, rank 0 writes the checkpoint
        (the model, its own cluster's part, the sync state) naming the others' parts. A
        cluster sitting out (joined late, its peer's state not taken yet) writes none: on a
        resume it starts as a newcomer does."""
        self.ckpt_due = False
        self.last_ckpt = self.step
        if not self.is_leader:
            return
        store = open_store(self.spec.checkpoint or "")
        sitting = {self.ranks_cluster[r] for r in self.idle}
        mine = self._mine() if self.cluster not in sitting else None
        if self.rank != 0 and mine is not None:
            store.save_part(self.step, self.cluster, self.spec.epoch, mine)
        dist.barrier(group=self.leaders)  # every part is written before a checkpoint names it
        if self.rank != 0:
            return
        assert mine is not None  # rank 0 sits out of no checkpoint (`_run`)
        state = self._state(clusters={self.cluster: mine})
        state[PARTS] = [c for c in self.clusters if c != self.cluster and c not in sitting]
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

    def _load(self, state: dict[str, Any], params: bool = True) -> None:
        """Take `state` (a checkpoint, or a peer's or this rank's own held in memory); without
        `params`, a state sent to a member seated late, which holds the model's buffers only."""
        if state["task"] != self.spec.task:
            raise ValueError(f"checkpoint is for task {state['task']!r}, not {self.spec.task!r}")
        self.step = int(state["step"])
        self.local_step = self.step
        self.model.load_state_dict(state["model"], strict=params)
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
        self.receiving, self.sending = None, []
        if dist.is_initialized():
            dist.destroy_process_group()
