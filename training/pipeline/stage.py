"""One stage replica of a pipeline: a Ray actor pinned to its stage's cluster.

Rank `(stage * R + replica) * T + t` (`Placement`). Each step shards the global batch over the
R replicas (as data-parallel workers do), cuts the shard into micro-batches and runs the
schedule's ops:
a forward receives its input from the previous stage (stage 0 reads the data), a backward
receives the output's gradient from the next stage (the last stage starts from the loss,
weighted by the micro-batch's share of the global batch). Sends are non-blocking, receives
blocking. Messages between clusters are compressed (`codec`), counted per directed link, and
with a link table held back until the emulated link would have delivered them. After the
ops, a stage with replicas all-reduces its gradients (inside its cluster, or across the
clusters of whole pipeline replicas: counted and emulated as the WAN ring it is), then steps
its own optimizer over its own parameters: the same update the whole model's optimizer would
make.

With T > 1 a stage replica is T ranks of one cluster that split each block's layers between
them (`training.tensor_parallel`): they compute every micro-batch together, and only the
first of them sends to and receives from the neighbouring stages, sharing what it receives
with the others inside the cluster (a stage's output and its input's gradient are the same
on every one of them). The replicas' all-reduce pairs ranks holding the same part. Shards
are saved whole (gathered from the T ranks), so any split can resume from them.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from training.checkpoint import FORMAT, CheckpointStore, check_identity, open_store
from training.collective import flatten, split
from training.data import batch_indices, shard
from training.pipeline.checkpoint import SHARD, check_shard, shard_due, stage_uri
from training.pipeline.codec import HEADER_LEN, Codec, Header, codec_for, decode, encode
from training.pipeline.schedule import stage_ops
from training.pipeline.spec import PipelineSpec, StageResult
from training.pipeline.split import balance, check_cuts
from training.results import WanBytes
from training.stages import group, piece_costs, pieces
from training.tasks import accuracy, as_tensors, load_task
from training.tensor_parallel import (
    check_split,
    full_optimizer_state,
    full_state,
    local,
    split_optimizer_state,
    tensor_parallel,
)
from training.wan import LinkTable
from training.worker import free_port


class StageWorker:
    """The loop of one stage replica. Wrapped with `ray.remote` by the driver."""

    def __init__(self, spec: PipelineSpec, rank: int, gloo_ifname: str | None) -> None:
        self.spec = spec
        self.rank = rank
        p = spec.placement
        self.stage = p.stage_of(rank)
        self.replica = p.replica_of(rank)
        self.cluster = p.cluster_of(rank)
        self.first = self.stage == 0
        self.last = self.stage == p.stages - 1
        # neighbours' ranks (-1: none, and never used as such)
        self.prev = -1 if self.first else p.rank(self.stage - 1, self.replica)
        self.next = -1 if self.last else p.rank(self.stage + 1, self.replica)
        self.head = p.rank(self.stage, self.replica)  # the replica's rank that talks to others
        if gloo_ifname:
            os.environ["GLOO_SOCKET_IFNAME"] = gloo_ifname
        torch.set_num_threads(1)

    def reinit(self, spec: PipelineSpec, rank: int, gloo_ifname: str | None) -> None:
        """Serve another run (a `StagePool` keeps this process, and its imported torch, warm)."""
        self.close()
        self.__init__(spec, rank, gloo_ifname)  # type: ignore[misc]

    def address(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, master: str, port: int, resume_step: int | None = None) -> tuple[int, ...]:
        """Join the group, build this stage from the seeded model (restored from its shard
        of step `resume_step` when given); return the cut points."""
        spec, p = self.spec, self.spec.placement
        t = spec.train
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{master}:{port}",
            rank=self.rank,
            world_size=p.world,
            timeout=timedelta(seconds=120),
        )
        self.dp: Any = None
        self.tp: Any = None  # the replica's tensor-parallel group (T > 1)
        mesh: Any = None
        if p.tensor > 1:
            from torch.distributed.device_mesh import init_device_mesh

            full = init_device_mesh(
                "cpu", (p.stages, p.replicas, p.tensor), mesh_dim_names=("pp", "dp", "tp")
            )
            mesh = full["tp"]
            self.tp = mesh.get_group()
            self.dp = full["dp"].get_group() if p.replicas > 1 else None
        else:
            for s in range(p.stages if p.replicas > 1 else 0):  # every rank, every group, in order
                g = dist.new_group([p.rank(s, r) for r in range(p.replicas)], backend="gloo")
                if s == self.stage:
                    self.dp = g
        task = load_task(t.task)
        self.task = task
        self.x, self.y = as_tensors(task.train)
        self.xe, self.ye = as_tensors(task.eval)
        self.batch = min(t.batch_size or task.batch_size, len(self.x))
        torch.manual_seed(t.seed)
        model = task.model()
        check_split(model, p.tensor)
        parts = pieces(model)
        if spec.cuts is not None:
            check_cuts(spec.cuts, len(parts))
            cuts = tuple(spec.cuts)
        else:
            cuts = balance(piece_costs(parts), p.stages)
        self.cuts = cuts
        self.module: nn.Module = group(parts, cuts)[self.stage]
        if mesh is not None:
            tensor_parallel(self.module, mesh)
        self.params = [q for q in self.module.parameters() if q.requires_grad]
        self.opt = task.optimizer.build(self.params, lr=t.lr)
        self.codec = codec_for(spec.activations)
        self.links = LinkTable.build(t.links, t.link_mbps, t.rtt_ms)
        self.busy_until: dict[int, float] = {}  # per incoming link: when it is free again
        self.step = 0
        self.compute_s = self.wait_s = self.steps_s = 0.0
        self.wan = WanBytes()
        self.raw_bytes = 0
        self.loss: float | None = None
        self.pending: list[Any] = []
        if resume_step is not None and t.checkpoint:
            self._restore(resume_step)
        return cuts

    # ------------------------------------------------------------------ messages

    def _pass(self, x: torch.Tensor, dst: int) -> None:
        """Send `x` to stage rank `dst` (its replica's head): the head's job alone."""
        if self.rank == self.head:
            self._send(x, dst)

    def _take(self, src: int, alone: bool = False) -> torch.Tensor:
        """Receive from stage rank `src`: the head receives, then shares it with the replica's
        other tensor-parallel ranks (inside the cluster). `alone`: no other replica sends
        at the same time (the evaluation's)."""
        if self.tp is None:
            return self._recv(src, alone)
        x = self._recv(src, alone) if self.rank == self.head else None
        meta: list[Any] = [tuple(x.shape), x.dtype] if x is not None else [None, None]
        dist.broadcast_object_list(meta, src=self.head, group=self.tp)
        if x is None:
            x = torch.empty(meta[0], dtype=meta[1])
        dist.broadcast(x, self.head, group=self.tp)
        return x

    def _send(self, x: torch.Tensor, dst: int) -> None:
        there = self.spec.placement.cluster_of(dst)
        codec = self.codec if there != self.cluster else Codec.NONE  # compress only the WAN
        msg = encode(x, codec, time.time())
        self.pending += [
            (dist.isend(msg.header, dst), msg.header),
            (dist.isend(msg.payload, dst), msg.payload),
        ]
        if there != self.cluster:
            self.wan = self.wan + WanBytes({(self.cluster, there): msg.wire_bytes})
            self.raw_bytes += HEADER_LEN * 8 + x.numel() * x.element_size()

    def _recv(self, src: int, alone: bool = False) -> torch.Tensor:
        start = time.perf_counter()
        header = torch.empty(HEADER_LEN, dtype=torch.float64)
        dist.recv(header, src)
        head = Header.read(header)
        payload = head.payload_buffer()
        dist.recv(payload, src)
        there = self.spec.placement.cluster_of(src)
        link = self.links.get(there, self.cluster) if self.links and there != self.cluster else None
        # the emulated WAN: serialise on the link, then one-way latency; the replicas whose
        # training messages cross it in the same slot share its bandwidth
        if link is not None:
            nbytes = HEADER_LEN * 8 + payload.numel() * payload.element_size()
            begin = max(head.sent_at, self.busy_until.get(src, 0.0))
            p = self.spec.placement
            crossing = 1 if alone else p.sharing(p.stage_of(src), self.stage, (there, self.cluster))
            share = link.bandwidth_bps / max(1, crossing)
            self.busy_until[src] = begin + nbytes * 8.0 / share
            wait = self.busy_until[src] + link.rtt_s / 2.0 - time.time()
            if wait > 0:
                time.sleep(wait)
        self.wait_s += time.perf_counter() - start
        return decode(head, payload)

    def _across(self, start: float, nbytes: int) -> None:
        """The replicas' all-reduce of `nbytes` that began at `start`, where they are whole
        pipelines on different clusters: gloo's ring (replica r sends to r + 1), 2(R - 1)
        rounds of 1/R of the bytes; this rank counts its own sends over the WAN and, with a
        link table, waits until the emulated links would have carried every round."""
        p = self.spec.placement
        ring = p.replica_clusters(self.stage)
        if len(set(ring)) < 2:
            return
        r_count = p.replicas
        chunk = nbytes // r_count
        edges = [(ring[r], ring[(r + 1) % r_count]) for r in range(r_count)]
        wan = {e: chunk for e in edges if e[0] != e[1]}
        there = edges[self.replica]
        if there[0] != there[1]:
            self.wan = self.wan + WanBytes({there: 2 * (r_count - 1) * chunk})
            self.raw_bytes += 2 * (r_count - 1) * chunk
        rounds = [wan] * (2 * (r_count - 1))
        need = self.links.rounds_time(rounds) if self.links is not None else 0.0
        wait = start + need - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        self.wait_s += time.perf_counter() - start

    def _flush(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()

    # ------------------------------------------------------------------ training

    def _micro(self, step: int) -> list[torch.Tensor]:
        idx = batch_indices(len(self.x), self.batch, self.spec.train.seed, step)
        mine = shard(idx, self.replica, self.spec.placement.replicas)
        m = max(1, min(self.spec.micro_batches, len(mine)))
        return [c for c in torch.tensor_split(mine, m) if len(c)]

    def _train_step(self, step: int) -> None:
        p = self.spec.placement
        micro = self._micro(step)
        held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        losses: dict[int, torch.Tensor] = {}
        total = torch.zeros(())
        for op in stage_ops(self.spec.schedule, self.stage, p.stages, len(micro)):
            m = op.micro
            if op.forward:
                inp = self.x[micro[m]] if self.first else self._take(self.prev).requires_grad_()
                t0 = time.perf_counter()
                out = self.module(inp)
                if self.last:
                    share = len(micro[m]) / self.batch
                    losses[m] = self.task.loss(out, self.y[micro[m]]) * share
                    total += losses[m].detach()
                self.compute_s += time.perf_counter() - t0
                held[m] = (inp, out)
                if not self.last:
                    self._pass(out.detach(), self.next)
            else:
                inp, out = held.pop(m)
                grad = None if self.last else self._take(self.next)
                t0 = time.perf_counter()
                if self.last:
                    losses.pop(m).backward()
                else:
                    out.backward(grad)
                self.compute_s += time.perf_counter() - t0
                if not self.first:
                    assert inp.grad is not None
                    self._pass(inp.grad, self.prev)
        self._flush()
        if p.replicas > 1:  # data parallel over the stage's replicas: exact sum of shards
            for q in self.params:
                if q.grad is None:
                    q.grad = torch.zeros_like(q)
            grads = [local(q.grad) for q in self.params if q.grad is not None]
            flat = flatten(grads)
            nbytes = flat.numel() * flat.element_size()
            if self.last:  # the step's loss rides along: one all-reduce, not two
                flat = torch.cat([flat, total.reshape(1).to(flat.dtype)])
            start = time.perf_counter()
            dist.all_reduce(flat, group=self.dp)
            self._across(start, nbytes)
            if self.last:
                total, flat = flat[-1].to(total.dtype), flat[:-1]
            with torch.no_grad():
                for g, new in zip(grads, split(flat, [g.shape for g in grads]), strict=True):
                    g.copy_(new)
        t0 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad()
        self.compute_s += time.perf_counter() - t0
        if self.last:
            self.loss = float(total)

    def run(self, until: int) -> StageResult:
        """Train to step `until`, saving this stage's shard when due; its totals so far."""
        t = self.spec.train
        while self.step < until:
            t0 = time.perf_counter()
            self._train_step(self.step)
            self.steps_s += time.perf_counter() - t0
            self.step += 1
            if t.checkpoint and shard_due(self.step, t.steps, t.checkpoint_every):
                self._save()
        return self.result()

    # ------------------------------------------------------------------ checkpoints

    def _store(self) -> CheckpointStore:
        return open_store(stage_uri(self.spec.train.checkpoint or "", self.stage))

    def _save(self) -> None:
        """Replica 0 writes this stage's shard (the replicas' parameters are equal after the
        all-reduce), whole: its tensor-parallel ranks gather it first; the store refuses it
        (StaleRun) when a later attempt has started."""
        if self.replica != 0:
            return
        if self.tp is not None:
            module = full_state(self.module)
            optimizer = full_optimizer_state(self.opt.state_dict())
            if self.rank != self.head:
                return
        else:
            module = {k: v.detach().cpu() for k, v in self.module.state_dict().items()}
            optimizer = self.opt.state_dict()
        t = self.spec.train
        state = {
            "version": FORMAT,
            "kind": SHARD,
            "run_id": t.run_id,
            "epoch": t.epoch,
            "step": self.step,
            "task": t.task,
            "stage": self.stage,
            "stages": self.spec.placement.stages,
            "cuts": list(self.cuts),
            "module": module,
            "optimizer": optimizer,
            "rng": torch.get_rng_state(),
        }
        self._store().save(self.step, state)

    def _restore(self, step: int) -> None:
        """This stage's shard of `step` (every replica reads replica 0's)."""
        store = self._store()
        where = store.where(step)
        state = store.load(step)
        t = self.spec.train
        check_identity(state, t.run_id or "", t.epoch, where)
        check_shard(
            state,
            task=t.task,
            stage=self.stage,
            stages=self.spec.placement.stages,
            cuts=self.cuts,
            where=where,
        )
        if self.tp is not None:  # whole tensors into this rank's parts
            from torch.distributed.tensor import DTensor, distribute_tensor

            with torch.no_grad():
                for name, q in self.module.named_parameters():
                    whole = state["module"][name]
                    if isinstance(q, DTensor):
                        whole = distribute_tensor(whole, q.device_mesh, q.placements)
                    q.copy_(whole)
            self.opt.load_state_dict(state["optimizer"])
            split_optimizer_state(self.opt)
        else:
            self.module.load_state_dict(state["module"])
            self.opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        self.step = int(state["step"])

    def result(self) -> StageResult:
        return StageResult(
            rank=self.rank,
            stage=self.stage,
            cluster=self.cluster,
            step=self.step,
            loss=self.loss if self.last and self.rank == self.head and self.replica == 0 else None,
            compute_s=self.compute_s,
            wait_s=self.wait_s,
            steps_s=self.steps_s,
            wan=self.wan,
            raw_bytes=self.raw_bytes,
            params=sum(local(q).numel() for q in self.params),
        )

    @torch.no_grad()
    def evaluate(self, limit: int = 2048) -> tuple[float, float] | None:
        """Replica 0's pipeline runs the first `limit` eval samples forward; the last stage
        returns (mean loss, accuracy), the others None."""
        if self.replica != 0:
            return None
        n = min(limit, len(self.xe))
        chunks = torch.arange(n).split(self.batch)
        loss = correct = 0.0
        for idx in chunks:
            inp = self.xe[idx] if self.first else self._take(self.prev, alone=True)
            out = self.module(inp)
            if self.last:
                loss += float(self.task.loss(out, self.ye[idx])) * len(idx)
                correct += accuracy(out, self.ye[idx]) * len(idx)
            else:
                self._pass(out, self.next)
        self._flush()
        return (loss / n, correct / n) if self.last and self.rank == self.head else None

    def parameters(self) -> list[torch.Tensor]:
        """This stage's parameters whole, in the model's order (tests compare them); every
        tensor-parallel rank of the replica must be asked at once."""
        if self.tp is not None:
            return list(full_state(self.module).values())
        return [q.detach().clone() for q in self.params]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
