"""One data-parallel worker: a Ray actor pinned to its cluster (see `training.runner`).

Ranks are grouped by cluster; the first rank of each cluster is its leader. Per exchange:
all-reduce inside the cluster (gloo, or NCCL on GPUs), compressed exchange between leaders
(`training.exchange`), broadcast inside the cluster. The global batch of each step is sharded
over all ranks, and every gradient is weighted by its shard's share of the global batch, so the
reduced gradient is the full-batch mean gradient.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from training.adaptive import choose
from training.checkpoint import open_store
from training.compression import Compressor, make_compressor
from training.data import batch_indices, shard, shard_sizes
from training.exchange import LeaderExchange, Message
from training.spec import SyncMode, TrainSpec, parse_sync
from training.tasks import Task, accuracy, as_tensors, load_task
from training.wan import LinkTable

CHECKPOINT_VERSION = 1


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
        self.sync: SyncMode = parse_sync(spec.sync)
        if gloo_ifname:
            os.environ["GLOO_SOCKET_IFNAME"] = gloo_ifname
        torch.set_num_threads(1)

    def reinit(
        self, spec: TrainSpec, rank: int, ranks_cluster: list[str], gloo_ifname: str | None
    ) -> None:
        """Reuse this process for another run (a `WorkerPool` keeps it warm)."""
        self.close()
        self.__init__(spec, rank, ranks_cluster, gloo_ifname)  # type: ignore[misc]

    # ------------------------------------------------------------------ setup

    def address(self) -> tuple[str, int]:
        """Where rank 0 hosts the rendezvous store."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, master: str, port: int, resume_step: int | None) -> int:
        """Join the process groups, build the model, restore a checkpoint; return the start step."""
        spec = self.spec
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{master}:{port}",
            rank=self.rank,
            world_size=self.world,
            timeout=timedelta(seconds=120),
        )
        use_gpu = spec.gpus_per_worker > 0 and torch.cuda.is_available()
        self.device = torch.device("cuda" if use_gpu else "cpu")
        # every rank must create every group, in the same order
        self.intra: Any = None
        for c in self.clusters:
            ranks = [r for r, x in enumerate(self.ranks_cluster) if x == c]
            g = dist.new_group(ranks, backend="nccl" if use_gpu else "gloo")
            if c == self.cluster:
                self.intra = g
        self.leaders: Any = dist.new_group(self.leader_ranks, backend="gloo")

        task: Task = load_task(spec.task)
        self.task = task
        self.x, self.y = as_tensors(task.train)
        self.xe, self.ye = as_tensors(task.eval)
        self.batch = min(spec.batch_size or task.batch_size, len(self.x))
        torch.manual_seed(spec.seed)
        self.model: nn.Module = task.model()
        for t in self.model.state_dict().values():  # same start everywhere, whatever the seeding
            dist.broadcast(t, src=0)
        self.model.to(self.device)
        self.names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.shapes = [tuple(p.shape) for p in self.params]

        self.links = LinkTable.build(spec.links, spec.link_mbps, spec.rtt_ms)
        adaptive = self.sync.kind == "adaptive"
        self.compression = spec.adaptive_levels[0] if adaptive else spec.compression
        self.compressors: dict[str, Compressor] = {}
        comp = self._compressor(self.compression)
        no_momentum = comp.momentum_correction and self.sync.kind != "local-sgd"
        self.opt = task.optimizer.build(self.params, lr=spec.lr, no_momentum=no_momentum)
        self.exchanger = (
            LeaderExchange(self.clusters, self.cluster, self.leaders) if self.is_leader else None
        )
        self.pool = ThreadPoolExecutor(max_workers=1) if self.is_leader else None
        self.pending: deque[Future[torch.Tensor] | torch.Tensor] = deque()
        self.own: deque[torch.Tensor] = deque()
        self.anchor: list[torch.Tensor] = []
        self.outer: Any = None
        if self.sync.kind == "local-sgd":
            self.anchor = [p.detach().clone() for p in self.params]
            self.outer = torch.optim.SGD(
                self.anchor,
                lr=spec.outer_lr,
                momentum=spec.outer_momentum,
                nesterov=spec.outer_momentum > 0,
            )
        self.measured: dict[str, int] = {}
        self.exchange_s: dict[str, float] = {}  # adaptive: slowest leader's time per level
        self.last_level: str | None = None
        self.compute_ema = 0.0
        self.last_exchange_s = 0.0
        self.step = 0
        self.compute_s = 0.0
        self.comm_s = 0.0
        self.loss_sum = 0.0
        self.loss_n = 0
        self.ckpt_due = False
        self.last_ckpt = -1
        if resume_step is not None and spec.checkpoint:
            self._restore(open_store(spec.checkpoint).load(resume_step))
        return self.step

    def _compressor(self, level: str) -> Compressor:
        if level not in self.compressors:
            self.compressors[level] = make_compressor(level)
        return self.compressors[level]

    # ------------------------------------------------------------------ one step

    def _grad_flat(self) -> torch.Tensor:
        return torch.cat(
            [
                (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                for p in self.params
            ]
        )

    def _split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        out, pos = [], 0
        for p in self.params:
            out.append(flat[pos : pos + p.numel()].view_as(p))
            pos += p.numel()
        return out

    def _local_backward(self, weight_of: str) -> None:
        """Forward/backward on this rank's shard, weighted by its share of the batch."""
        idx = batch_indices(len(self.x), self.batch, self.spec.seed, self.step)
        mine = shard(idx, self.rank, self.world)
        x, y = self.x[mine].to(self.device), self.y[mine].to(self.device)
        self.model.train()
        self.opt.zero_grad(set_to_none=False)
        loss = self.task.loss(self.model(x), y)
        if weight_of == "global":
            denom = len(idx)
        else:  # the cluster's batch (local SGD trains each cluster on its own)
            sizes = shard_sizes(len(idx), self.world)
            denom = sum(sizes[r] for r in self.cluster_ranks)
        (loss * (len(mine) / denom)).backward()
        self.loss_sum += float(loss.detach())
        self.loss_n += 1

    def _intra_reduce(self, flat: torch.Tensor) -> None:
        if len(self.cluster_ranks) > 1:
            dist.all_reduce(flat, group=self.intra)

    def _intra_broadcast(self, flat: torch.Tensor) -> None:
        if len(self.cluster_ranks) > 1:
            dist.broadcast(flat, src=self.cluster_ranks[0], group=self.intra)

    def _links_now(self, step: int) -> LinkTable | None:
        links = self.links
        for from_step, mbps, rtt in self.spec.link_schedule:
            if step >= from_step:
                links = LinkTable.build([], mbps, rtt)
        return links

    def _wan_sum(self, flat: torch.Tensor, step: int, level: str) -> torch.Tensor:
        """Leader only: exchange this cluster's tensor, return the sum over clusters."""
        assert self.exchanger is not None
        cpu = flat.detach().to("cpu", copy=True)
        info = {"compute": self.compute_ema, "xs": self.last_exchange_s}
        start = time.perf_counter()
        msgs = self.exchanger.exchange(
            level,
            self._compressor(level),
            self.compressors,
            self.names,
            self._split(cpu),
            info,
            self._links_now(step),
        )
        self.last_exchange_s = time.perf_counter() - start
        if self.sync.kind == "adaptive":
            self._adapt(msgs, step)
        total = torch.zeros_like(cpu)
        for m in msgs:  # cluster order: the same sum, bit for bit, on every leader
            total += torch.cat([t.reshape(-1).float() for t in m.tensors])
        return total.to(self.device)

    def _adapt(self, msgs: list[Message], step: int) -> None:
        """Pick the next level from what every leader reported (identical on all leaders).

        Without a link table the bandwidth is inferred from the exchanges themselves: each
        message says how long its sender's previous exchange took, at the level then in use,
        and the largest bandwidth any level's exchange implied is taken: latency and waiting
        on slower leaders only ever lower it (they weigh least on the level with the largest
        messages, which usually sets it). Inferring from the last exchange alone
        spiralled down: a small message's time is mostly latency, which reads as a slow link,
        which picks a smaller message still.
        """
        level = msgs[0].compression
        self.measured[level] = max(m.nbytes for m in msgs)
        xs = max(m.info["xs"] for m in msgs)
        if self.last_level is not None and xs > 0:
            self.exchange_s[self.last_level] = xs
        self.last_level = level
        compute = max(m.info["compute"] for m in msgs)
        rounds = len(self.clusters) - 1  # gloo's ring all-gather: n-1 blocks per edge
        links = self._links_now(step + 1)
        link = links.slowest(self.clusters) if links is not None else None
        if link is None and self.exchange_s:
            from training.wan import Link

            bps = max(self.measured[lv] * 8 * rounds / t for lv, t in self.exchange_s.items())
            link = Link(bps, 0.0)
        self.compression = choose(
            self.spec.adaptive_levels, self.measured, self.shapes, compute, link, rounds
        )

    def _apply(self, flat: torch.Tensor) -> None:
        for p, g in zip(self.params, self._split(flat), strict=True):
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
        self.opt.step()

    def _train_step(self) -> None:
        spec, kind = self.spec, self.sync.kind
        t0 = time.perf_counter()
        if kind == "local-sgd":
            self._local_backward("cluster")
            t1 = time.perf_counter()
            flat = self._grad_flat()
            self._intra_reduce(flat)
            self.opt.zero_grad(set_to_none=False)
            t2 = time.perf_counter()
            self._apply(flat)
            t3 = time.perf_counter()
            self.compute_s += (t1 - t0) + (t3 - t2)
            self.comm_s += t2 - t1
            if (self.step + 1) % self.sync.period == 0 or self.step + 1 == spec.steps:
                t4 = time.perf_counter()
                self._outer_step()
                self.comm_s += time.perf_counter() - t4
            self.step += 1
            return
        stale = kind == "stale" and self.sync.staleness > 0 and len(self.clusters) > 1
        self._local_backward("cluster" if stale else "global")
        t1 = time.perf_counter()
        dt = t1 - t0
        self.compute_ema = dt if self.compute_ema == 0 else 0.8 * self.compute_ema + 0.2 * dt
        flat = self._grad_flat()
        self._intra_reduce(flat)
        update: torch.Tensor | None
        if len(self.clusters) == 1:
            update = flat
        elif stale:
            update = self._stale_exchange(flat)
        else:
            if self.is_leader:
                flat = self._wan_sum(flat, self.step, self.compression)
            self._intra_broadcast(flat)
            update = flat
        t2 = time.perf_counter()
        if update is not None:
            self._apply(update)
        t3 = time.perf_counter()
        self.compute_s += (t1 - t0) + (t3 - t2)
        self.comm_s += t2 - t1
        self.step += 1

    def _cluster_share(self) -> float:
        sizes = shard_sizes(self.batch, self.world)
        return sum(sizes[r] for r in self.cluster_ranks) / self.batch

    def _stale_exchange(self, flat: torch.Tensor) -> torch.Tensor:
        """Bounded staleness: the own cluster's gradient now, the other clusters' s steps late.

        The leader runs exchanges on one background thread in step order, so up to s exchanges
        overlap compute and a cluster never runs more than s steps ahead of the slowest one.
        Each step applies the cluster's fresh gradient plus, for step t-s, the correction
        (global mean gradient - own gradient), so every cluster applies the same total update;
        only its timing differs (clusters' parameters differ by the updates in flight).
        """
        s = self.sync.staleness
        self.own.append(flat.clone())
        if self.is_leader:
            assert self.pool is not None
            self.pending.append(
                self.pool.submit(
                    self._wan_sum, flat * self._cluster_share(), self.step, self.compression
                )
            )
        if len(self.own) <= s:
            return flat
        return flat + self._correction()

    def _correction(self) -> torch.Tensor:
        """The oldest in-flight step: global mean gradient minus what this cluster applied."""
        own = self.own.popleft()
        glob = torch.zeros_like(own)
        if self.is_leader:
            item = self.pending.popleft()
            got = item.result() if isinstance(item, Future) else item
            assert got is not None
            glob = got
        self._intra_broadcast(glob)
        return glob - own

    def _stale_flush(self) -> None:
        """At the end of training, apply the corrections still in flight (same on all clusters)."""
        while self.own:
            self.opt.zero_grad(set_to_none=False)
            self._apply(self._correction())

    def _outer_step(self) -> None:
        """DiLoCo: average the pseudo-gradients over clusters, take a Nesterov outer step."""
        cur = torch.cat([p.detach().reshape(-1) for p in self.params])
        anchor = torch.cat([a.reshape(-1) for a in self.anchor])
        delta = anchor - cur  # cluster copies are identical after the intra all-reduce
        if len(self.clusters) > 1:
            if self.is_leader:
                sizes = shard_sizes(self.batch, self.world)
                share = sum(sizes[r] for r in self.cluster_ranks) / self.batch
                delta = self._wan_sum(delta * share, self.step, self.compression)
            self._intra_broadcast(delta)
        for a, g in zip(self.anchor, self._split(delta), strict=True):
            a.grad = g.clone()
        self.outer.step()
        with torch.no_grad():
            for p, a in zip(self.params, self.anchor, strict=True):
                p.copy_(a)

    # ------------------------------------------------------------------ driver calls

    def run(self, until: int, evaluate: bool) -> dict[str, Any]:
        """Train up to step `until`, checkpointing on the way; stats for the driver."""
        spec = self.spec
        until = min(until, spec.steps)
        every = spec.checkpoint_every
        while self.step < until:
            self._train_step()
            if self.step == spec.steps and self.own:
                t0 = time.perf_counter()
                self._stale_flush()
                self.comm_s += time.perf_counter() - t0
            if spec.checkpoint and every and self.step % every == 0:
                self.ckpt_due = True
            if self.ckpt_due and self._synced():
                self._checkpoint()
        if spec.checkpoint and self.step == spec.steps and self.last_ckpt != self.step:
            self._checkpoint()
        return self._stats(evaluate)

    def _synced(self) -> bool:
        if self.sync.kind == "local-sgd":
            return self.step % self.sync.period == 0 or self.step == self.spec.steps
        return True

    def _stats(self, evaluate: bool) -> dict[str, Any]:
        acc = self.evaluate() if evaluate else None
        loss = self.loss_sum / max(self.loss_n, 1)
        self.loss_sum, self.loss_n = 0.0, 0
        out: dict[str, Any] = {
            "step": self.step,
            "loss": loss,
            "accuracy": acc,
            "compute_s": self.compute_s,
            "comm_s": self.comm_s,
            "compression": self.compression,
        }
        if self.exchanger is not None:
            out["wan"] = self.exchanger.counters.state_dict()
        return out

    def evaluate(self) -> float:
        self.model.eval()
        with torch.no_grad():
            hits, n = 0.0, 0
            for i in range(0, len(self.xe), 512):
                xb, yb = self.xe[i : i + 512].to(self.device), self.ye[i : i + 512].to(self.device)
                hits += accuracy(self.model(xb), yb) * len(xb)
                n += len(xb)
        return hits / max(n, 1)

    # ------------------------------------------------------------------ checkpoints

    def _drain(self) -> list[torch.Tensor]:
        out = [item.result() if isinstance(item, Future) else item for item in self.pending]
        self.pending = deque(out)
        return [t.cpu() for t in out]

    def _checkpoint(self) -> None:
        self.ckpt_due = False
        self.last_ckpt = self.step
        pending = self._drain() if self.is_leader else []
        mine = None
        if self.is_leader:
            mine = {
                "optimizer": self.opt.state_dict(),
                "rng": torch.get_rng_state(),
                "own": [t.cpu() for t in self.own],
                "model": (
                    {k: v.cpu() for k, v in self.model.state_dict().items()} if self.own else None
                ),
                "compressors": {k: c.state_dict() for k, c in self.compressors.items()},
            }
            gathered: list[Any] = [None] * len(self.clusters)
            dist.all_gather_object(gathered, (self.cluster, mine), group=self.leaders)
        if self.rank != 0:
            return
        assert self.exchanger is not None
        state = {
            "version": CHECKPOINT_VERSION,
            "step": self.step,
            "task": self.spec.task,
            "seed": self.spec.seed,
            "batch": self.batch,
            "model": {k: v.cpu() for k, v in self.model.state_dict().items()},
            "clusters": dict(gathered),
            "sync": {
                "kind": self.sync.kind,
                "pending": pending,
                "outer": self.outer.state_dict() if self.outer is not None else None,
                "anchor": [a.cpu() for a in self.anchor],
                "compression": self.compression,
                "measured": self.measured,
                "exchange_s": self.exchange_s,
                "compute_ema": self.compute_ema,
            },
        }
        open_store(self.spec.checkpoint or "").save(self.step, state)

    def _restore(self, state: dict[str, Any]) -> None:
        if state.get("version") != CHECKPOINT_VERSION:
            raise ValueError(f"checkpoint version {state.get('version')} is not supported")
        if state["task"] != self.spec.task:
            raise ValueError(f"checkpoint is for task {state['task']!r}, not {self.spec.task!r}")
        self.step = int(state["step"])
        self.model.load_state_dict(state["model"])
        clusters: dict[str, Any] = state["clusters"]
        # elastic: a new cluster takes the first cluster's optimizer state and fresh compressors
        entry = clusters.get(self.cluster) or next(iter(clusters.values()))
        if entry.get("model") is not None:  # stale mode: this cluster's own view
            self.model.load_state_dict(entry["model"])
        # an optimizer of another kind (e.g. momentum correction now on) starts fresh
        with contextlib.suppress(ValueError):
            self.opt.load_state_dict(entry["optimizer"])
        sync = state["sync"]
        if self.sync.kind == sync["kind"]:
            self.measured = dict(sync["measured"])
            self.exchange_s = dict(sync.get("exchange_s", {}))
            self.compute_ema = float(sync["compute_ema"])
            if self.sync.kind == "adaptive":
                self.compression = sync["compression"]
            if self.outer is not None and sync["outer"] is not None:
                with torch.no_grad():
                    for a, saved in zip(self.anchor, sync["anchor"], strict=True):
                        a.copy_(saved)
                self.outer.load_state_dict(sync["outer"])
            if self.sync.kind == "stale":
                self.own = deque(t.to(self.device) for t in entry.get("own", []))
                if self.is_leader:
                    self.pending = deque(t.to(self.device) for t in sync["pending"])
        if self.outer is not None and self.sync.kind != sync["kind"]:
            with torch.no_grad():
                for a, p in zip(self.anchor, self.params, strict=True):
                    a.copy_(p.detach())
        if clusters.get(self.cluster) is not None:
            torch.set_rng_state(clusters[self.cluster]["rng"])
            for level, cstate in clusters[self.cluster]["compressors"].items():
                self._compressor(level).load_state_dict(cstate)

    def close(self) -> None:
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
            self.pool = None
        if dist.is_initialized():
            dist.destroy_process_group()
