"""cpn against the peers a user would pick instead, side by side on the namespace WAN testbed
(package `testbed`), in the WAN-bound regime (issue 16, items 2 and 4).

3 datacenters x 2 workers, every uplink shaped with tc tbf (both directions); the same task,
seed and global batches everywhere (rank r of 6 reads shard r of `training.data`'s batch of
each step). Rows:

  (a) DDP over one flat gloo group, no hook (what Ray Train's TorchTrainer sets up)
  (b) DDP + PowerSGD hook
  (c) torchft DiLoCo, and its streaming variant: one replica group per datacenter (its two
      workers DDP over a local gloo group), the Rust lighthouse in the hub namespace, the same
      outer SGD as cpn's, init_sync=False; `manager.current_step()` is checked, so a silently
      dropped sync shows in the table
  (d) hivemind Optimizer with use_local_updates=True: one peer per datacenter (its second
      worker follows by DDP and a local broadcast); parameter averaging about every H steps,
      i.e. local SGD / model averaging, NOT DiLoCo (no outer Nesterov step)
  (e) cpn local-sgd (DiLoCo) fp32 and int8, streaming fp32 and int8, 2-bit top-k (DiLoCo),
      and auto

torchft's two ranks of a group each all-reduce their full replica across the groups (its
design: a group's ranks are meant to hold shards), so it sends twice a leader-only exchange.

Per row: time to the target quality, final quality (eval accuracy; next-character accuracy
for the language model), bytes on the uplinks from the interface counters, the regime (fp32
exchange time / compute time per step, `training.auto.wan_bound_ratio`) and the WAN-hidden
ratio (wall time on an unshaped testbed / wall time shaped, same mode; `--no-hidden` skips the
unshaped pass). A DDP row whose shaped run would exceed `--budget-s` runs `--probe-steps`
steps only: its step time is measured there, its steps-to-target and final quality come from
the same run on the unshaped testbed (synchronous DP is the same computation with or without
a WAN), and the row says "extrapolated".

Peers run from their own venv (`--peers-python`, default .venv/peers/bin/python; install with
`python3 -m venv .venv/peers && .venv/peers/bin/pip install -c constraints.txt torch==2.13.0
'torchft==0.2.0' 'hivemind==1.1.12' mnist1d`); cpn runs on the testbed's Ray from this one.

    sudo CPN_TESTBED_PREFIX=cpnpb .venv/bin/python -m bench.peers --mbit 25 100
    sudo CPN_TESTBED_PREFIX=cpnpb .venv/bin/python -m bench.peers --mbit 100 --quick --no-hidden

Results: bench/results/peers-<mbit>mbit.{md,json,png}, each headed by the command.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
DCS = ["a", "b", "c"]
WORKERS = 2
UNSHAPED_MBIT = 10_000.0  # a tbf far above what the host moves: "no WAN"
PORTS = itertools.count(29700 + 40 * (os.getpid() % 50))  # fresh ports per run: no stale store
LIGHTHOUSE_PORT = 29510
TARGET_FRACTION = 0.97  # of synchronous DP's final quality: a target late in the run
POWERSGD_START = 2  # exact steps before PowerSGD: torch's minimum (10 exact fp32 steps at
# 25 Mbit/s would take minutes)


@dataclass(frozen=True)
class Peer:
    name: str
    kind: str  # ddp | torchft | hivemind | cpn
    hook: str = "none"  # ddp: none | powersgd:R
    sync: str = "local-sgd:{H}"  # cpn; {H} is the period
    compression: str = "none"  # cpn
    fragments: int = 1  # torchft: 1 = DiLoCo, >1 = streaming
    note: str = ""
    period: int | None = None  # H of this row when not the run's `--period`

    def h(self, setup: Setup) -> int:
        return self.period or setup.period


PEERS: tuple[Peer, ...] = (
    Peer("(a) DDP flat gloo fp32", "ddp"),
    Peer("(b) DDP + PowerSGD r4", "ddp", hook="powersgd:4"),
    Peer("(c) torchft DiLoCo fp32", "torchft"),
    Peer("(c) torchft streaming DiLoCo fp32", "torchft", fragments=4),
    Peer("(c) torchft streaming DiLoCo fp32 H=16", "torchft", fragments=4, period=16),
    Peer("(c) torchft streaming DiLoCo fp32 H=64", "torchft", fragments=4, period=64),
    Peer(
        "(d) hivemind local updates (model averaging, not DiLoCo)",
        "hivemind",
        note="local SGD: parameter averaging about every H steps, no outer optimizer; its "
        "outer syncs are the epochs it reached (averaging rounds)",
    ),
    Peer("(e) cpn DiLoCo fp32", "cpn"),
    Peer("(e) cpn DiLoCo int8", "cpn", compression="int8"),
    Peer("(e) cpn streaming fp32", "cpn", sync="streaming:{H}"),
    Peer("(e) cpn streaming int8", "cpn", sync="streaming:{H}", compression="int8"),
    Peer("(e) cpn streaming fp32 H=16", "cpn", sync="streaming:{H}", period=16),
    Peer("(e) cpn streaming int8 H=16", "cpn", sync="streaming:{H}", compression="int8", period=16),
    Peer("(e) cpn DiLoCo int8 H=16", "cpn", compression="int8", period=16),
    Peer("(e) cpn streaming fp32 H=64", "cpn", sync="streaming:{H}", period=64),
    Peer("(e) cpn DiLoCo int8 H=64", "cpn", compression="int8", period=64),
    Peer("(e) cpn DiLoCo int4", "cpn", compression="int4"),
    Peer("(e) cpn DiLoCo int4 H=64", "cpn", compression="int4", period=64),
    Peer("(e) cpn DiLoCo int2", "cpn", compression="int2"),
    Peer("(e) cpn DiLoCo top-k 2-bit", "cpn", compression="topk:0.02:m0:c4096:int2"),
    Peer("(e) cpn auto", "cpn", sync="auto", compression="auto"),
)


# ----------------------------------------------------------------------------- pure parts


def regime(params: int, compute_s_per_step: float, mbit: float) -> float:
    """fp32 exchange time / compute time of one step (>= 10: WAN-bound)."""
    return 4.0 * params * 8.0 / (mbit * 1e6) / max(compute_s_per_step, 1e-9)


def time_to(history: list[dict[str, Any]], target: float) -> float | None:
    for h in history:
        if h.get("accuracy") is not None and h["accuracy"] >= target:
            return float(h["wall_s"])
    return None


def steps_to(history: list[dict[str, Any]], target: float) -> int | None:
    for h in history:
        if h.get("accuracy") is not None and h["accuracy"] >= target:
            return int(h["step"])
    return None


def extrapolate(
    probe: dict[str, Any], unshaped: dict[str, Any], steps: int, target: float
) -> dict[str, Any]:
    """A row for a peer too slow to run in full on the shaped links: its shaped step time
    (from `probe`, a few steps) times the steps the unshaped run took."""
    per_step = probe["wall_s"] / probe["steps"]
    bytes_per_step = probe["uplink_bytes_total"] / probe["steps"]
    stt = steps_to(unshaped["history"], target)
    history = [{**h, "wall_s": h["step"] * per_step} for h in unshaped["history"]]
    return {
        **probe,
        "extrapolated": True,
        "probe_steps": probe["steps"],
        "steps": steps,
        "step_s": per_step,
        "wall_s": per_step * steps,
        "ttt": None if stt is None else stt * per_step,
        "steps_to_target": stt,
        "final_accuracy": unshaped["final_accuracy"],
        "uplink_bytes_total": int(bytes_per_step * steps),
        "compute_s": probe["compute_s"] / probe["steps"] * steps,
        "history": history,
    }


def final_eval_loss(row: dict[str, Any]) -> float | None:
    """The last evaluation's loss (rows measured before it was recorded have none)."""
    hist = row.get("history") or []
    loss = hist[-1].get("eval_loss") if hist else None
    return None if loss is None else float(loss)


def hidden_ratio(unshaped: dict[str, Any] | None, shaped: dict[str, Any]) -> float | None:
    """Wall time unshaped / wall time shaped, per step (a probe row has fewer steps)."""
    if unshaped is None:
        return None
    per_u = unshaped["wall_s"] / unshaped["steps"]
    per_s = shaped.get("step_s") or shaped["wall_s"] / shaped["steps"]
    return per_u / per_s if per_s > 0 else None


def _fmt(x: float | None, spec: str = ".1f", none: str = "-") -> str:
    return none if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(rows: list[dict[str, Any]], mbit: float, target: float, command: str, meta: str) -> str:
    """The markdown report for one rate, headed by the command."""
    base = next((r for r in rows if r["peer"].startswith("(a)")), rows[0])
    tf = [r["ttt"] for r in rows if r["kind"] == "torchft" and r.get("ttt")]
    best_tf = min(tf) if tf else None
    base_loss = final_eval_loss(base)
    out = [
        f"# cpn vs peers on the testbed, {mbit:g} Mbit/s uplinks",
        "",
        f"`{command}`",
        "",
        meta + f" Target: eval accuracy {target:.3f}.",
        "",
        "| peer | how | regime (fp32 exch / compute) | time to target (s) | final acc "
        "| final eval loss (vs (a)) | wall (s) | uplink MB | bytes vs (a) | vs (a): time "
        "| vs best torchft: time | WAN-hidden | outer syncs |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        how = (
            f"extrapolated ({r['probe_steps']} shaped steps; steps-to-target unshaped)"
            if r.get("extrapolated")
            else "measured"
        )
        if r.get("measured_on"):  # merged tables hold rows of several sessions
            how += f" {r['measured_on']}"
        if r.get("error"):
            how = f"FAILED: {r['error'][:80]}"
        ttt = r.get("ttt")
        syncs = r.get("outer_syncs")
        syncs_s = "-" if syncs is None else f"{syncs[0]}/{syncs[1]}"
        if syncs and syncs[0] < syncs[1]:
            syncs_s += " (dropped!)"

        def ratio(x: float | None, y: float | None) -> str:
            return f"{x / y:.1f}x" if x and y else "-"

        loss = final_eval_loss(r)
        loss_s = _fmt(loss, ".4f")
        if loss is not None and base_loss and r is not base:
            loss_s += f" ({100 * (loss / base_loss - 1):+.1f} %)"

        out.append(
            f"| {r['peer']} | {how} | {_fmt(r.get('regime'), '.3g')} | "
            f"{_fmt(ttt, '.1f', 'not reached')} | {_fmt(100 * r.get('final_accuracy', math.nan))}"
            f" % | {loss_s} | {_fmt(r.get('wall_s'))} | "
            f"{r.get('uplink_bytes_total', 0) / 1e6:,.1f} | "
            f"{ratio(base.get('uplink_bytes_total'), r.get('uplink_bytes_total'))} | "
            f"{ratio(base.get('ttt'), ttt)} | {ratio(best_tf, ttt)} | "
            f"{_fmt(r.get('hidden'), '.2f')} | {syncs_s} |"
        )
    notes = sorted({f"- {r['peer']}: {r['note']}" for r in rows if r.get("note")})
    return "\n".join([*out, *([""] if notes else []), *notes]) + "\n"


# ----------------------------------------------------------------------------- worker helpers


def _task_setup(task_entry: str, seed: int, timeout: float) -> tuple[Any, ...]:
    import faulthandler

    import torch

    faulthandler.dump_traceback_later(0.7 * timeout)  # a hang shows where

    from training.tasks import as_tensors, load_task

    torch.set_num_threads(1)
    task = load_task(task_entry)
    x, y = as_tensors(task.train)
    xe, ye = as_tensors(task.eval)
    torch.manual_seed(seed)  # every rank builds the same initial model from the seed
    return task, x, y, xe, ye, task.model()


def _evaluate(task: Any, model: Any, xe: Any, ye: Any) -> dict[str, float]:
    """History fields of one evaluation, as cpn's runner writes them (accuracy, eval_loss)."""
    from training.tasks import evaluate

    ev = evaluate(task, model, xe, ye)
    return {"accuracy": ev.accuracy, "eval_loss": ev.loss}


def _local_group(a: argparse.Namespace) -> None:
    """The datacenter's own gloo group (its two workers, inside one namespace)."""
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = a.ifname
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{a.dc_ip}:{a.local_port}",
        rank=a.group_rank,
        world_size=a.group_world,
    )


def _barrier_files(path: Path, me: int, n: int, timeout: float = 300.0) -> None:
    """All peers start together (hivemind: a late peer downloads state instead of training)."""
    (path / f"ready-{me}").touch()
    deadline = time.monotonic() + timeout
    while len(list(path.glob("ready-*"))) < n:
        if time.monotonic() > deadline:
            raise TimeoutError("peers did not all start")
        time.sleep(0.05)


def _train_loop(
    a: argparse.Namespace,
    task: Any,
    model: Any,
    step_model: Any,
    opt: Any,
    x: Any,
    y: Any,
    xe: Any,
    ye: Any,
    after_step: Any = None,
    until: Any = None,
    max_steps: int | None = None,
) -> dict[str, Any]:
    """Inner steps on this rank's shard of each global batch (the DC's gradient is the mean
    over its workers by DDP); rank 0 evaluates every `eval_every` steps and at the end.
    The run ends after `max_steps` (default `a.steps`) or once `until(step)` holds (hivemind:
    the collaboration reached its last epoch); every rank of a group must decide alike."""
    from training.data import batch_indices, shard

    rank = a.group * a.group_world + a.group_rank
    world = a.groups * a.group_world
    history: list[dict[str, float]] = []
    compute = 0.0
    n = a.steps if max_steps is None else max_steps
    step = -1
    start = time.perf_counter()
    for step in range(n):
        t0 = time.perf_counter()
        mine = shard(batch_indices(len(x), task.batch_size, a.seed, step), rank, world)
        opt.zero_grad()
        task.loss(step_model(x[mine]), y[mine]).backward()
        opt.step()
        compute += time.perf_counter() - t0
        if after_step is not None:
            after_step(step)
        last = step + 1 == n or (until is not None and until(step))
        if rank == 0 and ((step + 1) % a.eval_every == 0 or last):
            history.append(
                {
                    "wall_s": time.perf_counter() - start,
                    "step": step + 1,
                    **_evaluate(task, model, xe, ye),
                }
            )
        if last:
            break
    return {"start": start, "compute_s": compute, "history": history, "steps": step + 1}


def torchft_worker(a: argparse.Namespace) -> None:
    """One rank of a torchft replica group (one group per datacenter)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    task, x, y, xe, ye, model = _task_setup(a.task, a.seed, a.timeout)
    _local_group(a)
    ddp = DDP(model)
    store = dist.TCPStore(
        a.dc_ip, a.store_port, a.group_world, is_master=a.group_rank == 0, wait_for_workers=False
    )
    # the Manager connects to it by address; rank 0 hosts it as long as `store` lives
    timeout = timedelta(seconds=a.timeout)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=lambda sd: model.load_state_dict(sd["model"]),
        state_dict=lambda: {"model": model.state_dict()},
        min_replica_size=a.groups,
        use_async_quorum=False,
        replica_id=f"dc{a.group}",
        store_addr=a.dc_ip,
        store_port=a.store_port,
        rank=a.group_rank,
        world_size=a.group_world,
        lighthouse_addr=a.lighthouse,
        hostname=a.dc_ip,
        port=a.manager_port,
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
        init_sync=False,
    )
    params = [p for p in model.parameters() if p.requires_grad]
    frags = _fragments(params, a.fragments)
    inner = task.optimizer.build(ddp.parameters())
    outer = [
        torch.optim.SGD(
            f.parameters(),
            lr=a.outer_lr,
            momentum=a.outer_momentum,
            nesterov=a.nesterov and a.outer_momentum > 0,
        )
        for f in frags
    ]
    kw: dict[str, Any] = {}
    if a.fragments > 1:
        kw["fragment_sync_delay"] = a.delay
    dist.barrier()
    with DiLoCo(
        manager,
        frags,
        inner,
        outer if a.fragments > 1 else outer[0],
        sync_every=a.period,
        **kw,
    ):
        res = _train_loop(a, task, model, ddp, inner, x, y, xe, ye)
    dist.barrier()
    wall = time.perf_counter() - res["start"]
    expected = (a.steps // a.period) * a.fragments
    _write_out(a, wall, res, outer_syncs=[int(manager.current_step()), expected])
    manager.shutdown(wait=False)
    del store
    dist.destroy_process_group()


def _fragments(params: list[Any], n: int) -> list[Any]:
    """`n` modules holding contiguous runs of the parameters, about equal in size."""
    from torch import nn

    total = sum(p.numel() for p in params)
    out: list[list[Any]] = [[] for _ in range(n)]
    seen = 0
    for p in params:
        out[min(n - 1, seen * n // total)].append(p)
        seen += p.numel()
    mods = []
    for group in out:
        m = nn.Module()
        m.params = nn.ParameterList(group)
        mods.append(m)
    return mods


def hivemind_averaging_timeout(
    params: int, mbit: float | None, peers: int, matchmaking: float
) -> float:
    """How long one hivemind averaging round may wait: matchmaking, then 4x the butterfly
    all-reduce of the fp32 model at the uplink rate (each peer sends and receives 2(n-1)/n of
    it), plus 30 s for a loaded host. A peer left out of a group (a straggler, or the last one
    while the others have finished) retries matchmaking alone until this runs out, so it
    bounds the stall; it was the whole run's timeout (900 s), which left datacenter a's peer
    waiting for partners that had already exited."""
    if mbit is None:
        return 60.0  # hivemind's default
    exchange = 2 * (peers - 1) / peers * 4 * params * 8 / (mbit * 1e6)
    return matchmaking + 4 * exchange + 30.0


def hivemind_finished(epoch: int, period: int, steps: int) -> bool:
    """A hivemind run ends when its collaboration reached the epoch that `steps` global
    batches make (one epoch = `period` global batches): every peer stops after the same
    averaging round, whatever its own step count (a slow peer, e.g. the one that evaluates,
    makes fewer local steps), instead of the fast ones exiting and leaving the slow one to
    trigger a last round nobody joins."""
    return epoch >= steps // period


def _finish_together(path: Path, me: int, n: int, timeout: float) -> bool:
    """Keep this peer's DHT and averager up until every peer is done (a straggler may still
    download state or average with it), at most `timeout`; False if someone never came."""
    (path / f"done-{me}").touch()
    deadline = time.monotonic() + timeout
    while len(list(path.glob("done-*"))) < n:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def hivemind_worker(a: argparse.Namespace) -> None:
    """One worker; the datacenter's rank 0 is its hivemind peer, rank 1 follows it."""
    import hivemind
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    task, x, y, xe, ye, model = _task_setup(a.task, a.seed, a.timeout)
    _local_group(a)
    ddp = DDP(model)
    rundir = Path(a.rundir)
    lead = a.group_rank == 0
    inner = task.optimizer.build(ddp.parameters())
    opt: Any = inner
    dht = None
    params = sum(q.numel() for q in model.parameters() if q.requires_grad)
    averaging_timeout = hivemind_averaging_timeout(params, a.mbit, a.groups, a.matchmaking)
    if lead:
        port = a.store_port
        kw: dict[str, Any] = {
            "host_maddrs": [f"/ip4/{a.dc_ip}/tcp/{port}"],
            "nat_port_map": False,
            "auto_nat": False,
            "start": True,
        }
        if a.group > 0:
            while not (rundir / "maddrs").exists():
                time.sleep(0.05)
            kw["initial_peers"] = json.loads((rundir / "maddrs").read_text())
        dht = hivemind.DHT(**kw)
        if a.group == 0:
            tmp = rundir / "maddrs.tmp"
            tmp.write_text(json.dumps([str(m) for m in dht.get_visible_maddrs()]))
            tmp.rename(rundir / "maddrs")
        dc_batch = task.batch_size * a.group_world // (a.groups * a.group_world)
        opt = hivemind.Optimizer(
            dht=dht,
            run_id=f"cpn-peers-{a.rundir.rsplit('/', 1)[-1]}",
            params=ddp.parameters(),
            optimizer=lambda ps: task.optimizer.build(ps),
            batch_size_per_step=dc_batch,
            target_batch_size=task.batch_size * a.period,
            use_local_updates=True,
            matchmaking_time=a.matchmaking,
            averaging_timeout=averaging_timeout,
            # hivemind warns that a request_timeout (3 s) above min_matchmaking_time can deadlock
            averager_opts={"request_timeout": min(3.0, a.matchmaking / 2)},
            verbose=False,
        )
    flag = torch.zeros(1)
    last = [0]

    def follow(step: int) -> None:
        """After the leader's step: if it averaged (a new epoch), rank 1 copies its model."""
        flag[0] = float(opt.local_epoch) if lead else 0.0
        dist.broadcast(flag, 0)
        if int(flag[0]) != last[0]:
            last[0] = int(flag[0])
            for p in model.parameters():
                dist.broadcast(p.data, 0)

    dist.barrier()
    if lead:
        _barrier_files(rundir, a.group, a.groups)
    dist.barrier()
    res = _train_loop(
        a,
        task,
        model,
        ddp,
        opt,
        x,
        y,
        xe,
        ye,
        after_step=follow,
        until=lambda step: hivemind_finished(last[0], a.period, a.steps),
        max_steps=2 * a.steps,  # bound: a collaboration that stops advancing still ends
    )
    if lead:  # the last round averages in the background: apply it before the last eval
        opt.state_averager.step(wait_for_delayed_updates=True, apply_delayed_updates=True)
        if res["history"]:
            res["history"][-1].update(_evaluate(task, model, xe, ye))
            res["history"][-1]["wall_s"] = time.perf_counter() - res["start"]
    dist.barrier()
    wall = time.perf_counter() - res["start"]
    expected = a.steps // a.period
    _write_out(a, wall, res, outer_syncs=[last[0], expected], local_steps=res["steps"])
    if lead:
        if not _finish_together(rundir, a.group, a.groups, 2 * averaging_timeout + 30):
            print("hivemind: some peer never finished; shutting down anyway", file=sys.stderr)
        opt.shutdown()
        assert dht is not None
        dht.shutdown()
    dist.destroy_process_group()


def _write_out(a: argparse.Namespace, wall: float, res: dict[str, Any], **extra: Any) -> None:
    if a.group == 0 and a.group_rank == 0:
        hist = res["history"]
        Path(a.out).write_text(
            json.dumps(
                {
                    "wall_s": wall,
                    "compute_s": res["compute_s"],
                    "final_accuracy": hist[-1]["accuracy"],
                    "history": hist,
                    **extra,
                }
            )
        )


def cpn_driver(a: argparse.Namespace) -> None:
    """One cpn run through `training.run` (in the hub namespace: a Ray driver)."""
    from training import TrainSpec, run

    spec = TrainSpec(
        task=a.task,
        clusters=dict.fromkeys(a.dcs.split(","), WORKERS),
        compression=a.compression,
        sync=a.sync,
        steps=a.steps,
        seed=a.seed,
        eval_every=a.eval_every,
        ray_address=a.ray_address,
        outer_lr=a.outer_lr,
        outer_momentum=a.outer_momentum,
        outer_nesterov=a.nesterov,
        link_mbps=a.emulate_mbps,
        rtt_ms=0.0 if a.emulate_mbps else None,
    )
    rep = run(spec).to_dict()
    keep = (
        "wall_s",
        "compute_s",
        "final_accuracy",
        "history",
        "auto_decisions",
        "wan_bytes",
        "sync_stats",  # streaming's late fragments and drain: what the WAN did not hide
    )
    print(json.dumps({k: rep.get(k) for k in keep}, default=str))


# ----------------------------------------------------------------------------- orchestration


@dataclass
class Setup:
    task: str
    steps: int
    period: int
    evals: int
    seed: int
    outer_lr: float
    outer_momentum: float
    nesterov: bool
    peers_python: str
    timeout_s: float
    matchmaking_s: float


def _spawn(
    argvs: list[list[str]], timeout: float, logs: Path, env: dict[str, str] | None = None
) -> None:
    """Run the ranks together; on a failure or timeout, kill them all and raise with the
    stderr tail of the first rank that failed (every rank's stderr stays in `logs`)."""
    files = [open(logs / f"rank{i}.err", "wb") for i in range(len(argvs))]  # noqa: SIM115
    procs = [
        subprocess.Popen(a, stdout=subprocess.DEVNULL, stderr=f, env=env, start_new_session=True)
        for a, f in zip(argvs, files, strict=True)
    ]
    deadline = time.monotonic() + timeout
    failed: tuple[int, str] | None = None
    try:
        while failed is None and any(p.poll() is None for p in procs):
            for i, p in enumerate(procs):
                if p.poll() not in (None, 0):
                    failed = (i, f"exit {p.returncode}")
                    break
            if failed is None and time.monotonic() > deadline:
                failed = (0, f"timeout after {timeout:.0f} s")
            time.sleep(0.2)
        if failed is None:
            bad = [i for i, p in enumerate(procs) if p.returncode != 0]
            failed = (bad[0], f"exit {procs[bad[0]].returncode}") if bad else None
    finally:
        for p in procs:  # each rank with its children (hivemind's DHT, averager and p2pd)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for f in files:
            f.close()
    if failed is not None:
        i, why = failed
        tail = (logs / f"rank{i}.err").read_text(errors="replace")[-700:]
        raise RuntimeError(f"rank {i}: {why}: {tail}")


def _group_argv(
    bed: Any, setup: Setup, peer: Peer, steps: int, sub: str, out: Path, rundir: Path
) -> list[list[str]]:
    from testbed.layout import HUB_IP, UPLINK_IF

    ports = {dc["name"]: (next(PORTS), next(PORTS), next(PORTS)) for dc in bed.datacenters}
    argvs = []
    for g, dc in enumerate(bed.datacenters):
        local, store, mgr = ports[dc["name"]]
        for k in range(WORKERS):
            argv = ["ip", "netns", "exec", dc["netns"], setup.peers_python, "-m", "bench.peers"]
            argv += [sub, "--group", str(g), "--groups", str(len(bed.datacenters))]
            argv += ["--group-rank", str(k), "--group-world", str(WORKERS)]
            argv += ["--dc-ip", dc["ip"], "--local-port", str(local), "--store-port", str(store)]
            argv += ["--manager-port", str(mgr), "--ifname", UPLINK_IF]
            argv += ["--lighthouse", f"http://{HUB_IP}:{LIGHTHOUSE_PORT}"]
            argv += ["--task", setup.task, "--steps", str(steps), "--seed", str(setup.seed)]
            argv += ["--eval-every", str(max(1, steps // setup.evals)), "--out", str(out)]
            argv += ["--period", str(peer.h(setup)), "--fragments", str(peer.fragments)]
            argv += ["--delay", str(max(0, peer.h(setup) // peer.fragments - 1))]
            argv += ["--outer-lr", str(setup.outer_lr), "--outer-momentum"]
            argv += [str(setup.outer_momentum), "--timeout", str(setup.timeout_s)]
            argv += ["--matchmaking", str(setup.matchmaking_s), "--rundir", str(rundir)]
            argv += ["--nesterov" if setup.nesterov else "--no-nesterov"]
            argv += ["--mbit", str(min(d["mbit"] for d in bed.datacenters))]
            argvs.append(argv)
    return argvs


def run_peer(bed: Any, setup: Setup, peer: Peer, steps: int) -> dict[str, Any]:
    """One run of `peer` for `steps` steps on the testbed as it is now shaped."""
    from testbed.layout import HUB_IP, HUB_NS, UPLINK_IF

    eval_every = max(1, steps // setup.evals)
    rundir = Path(f"/tmp/cpn-peers-{os.getpid()}-{next(PORTS)}")
    rundir.mkdir(parents=True)
    out = rundir / "out.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    before = bed.uplink_bytes()
    lighthouse = None
    try:
        if peer.kind == "ddp":
            master, port = bed.datacenters[0]["ip"], next(PORTS)
            argvs = []
            for rank in range(len(bed.datacenters) * WORKERS):
                dc = bed.datacenters[rank // WORKERS]
                argv = ["ip", "netns", "exec", dc["netns"], setup.peers_python, "-m"]
                argv += ["bench.wan", "ddp-worker", "--rank", str(rank)]
                argv += ["--world", str(len(bed.datacenters) * WORKERS), "--master", master]
                argv += ["--port", str(port), "--task", setup.task, "--steps", str(steps)]
                argv += ["--eval-every", str(eval_every), "--seed", str(setup.seed)]
                argv += ["--hook", peer.hook, "--ifname", UPLINK_IF, "--out", str(out)]
                argv += ["--powersgd-start", str(POWERSGD_START)]
                argvs.append(argv)
            _spawn(argvs, setup.timeout_s, rundir, env)
        elif peer.kind in ("torchft", "hivemind"):
            if peer.kind == "torchft":
                lh = Path(setup.peers_python).parent / "torchft_lighthouse"
                lighthouse = subprocess.Popen(
                    [
                        *("ip", "netns", "exec", HUB_NS, str(lh)),
                        *("--min_replicas", str(len(bed.datacenters))),
                        *("--bind", f"{HUB_IP}:{LIGHTHOUSE_PORT}", "--join_timeout_ms", "1000"),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                time.sleep(0.5)
            argvs = _group_argv(bed, setup, peer, steps, f"{peer.kind}-worker", out, rundir)
            env["TORCHFT_QUORUM_TIMEOUT_SEC"] = str(int(setup.timeout_s))
            env["TORCHFT_TIMEOUT_SEC"] = str(int(setup.timeout_s))
            _spawn(argvs, setup.timeout_s, rundir, env)
        else:
            sync = peer.sync.format(H=peer.h(setup))
            argv = [sys.executable, "-m", "bench.peers", "cpn-driver", "--task", setup.task]
            argv += ["--steps", str(steps), "--seed", str(setup.seed)]
            argv += ["--eval-every", str(eval_every), "--compression", peer.compression]
            argv += ["--sync", sync, "--dcs", ",".join(d["name"] for d in bed.datacenters)]
            argv += ["--ray-address", bed.ray_address, "--outer-lr", str(setup.outer_lr)]
            argv += ["--outer-momentum", str(setup.outer_momentum)]
            argv += ["--nesterov" if setup.nesterov else "--no-nesterov"]
            res = bed.run_in_hub(argv, timeout=setup.timeout_s)
            if res.returncode != 0:
                raise RuntimeError(res.stderr[-800:])
            out.write_text(res.stdout.strip().splitlines()[-1])
        rep = json.loads(out.read_text())
    finally:
        if lighthouse is not None:
            lighthouse.kill()
            lighthouse.wait()
        if os.environ.get("CPN_PEERS_KEEP_LOGS") != "1":
            subprocess.run(["rm", "-rf", str(rundir)], check=False)
    after = bed.uplink_bytes()
    up = {dc: after[dc][0] - before[dc][0] for dc in after}
    return {
        "peer": peer.name,
        "kind": peer.kind,
        "note": peer.note,
        "steps": steps,
        "measured_on": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "wall_s": rep["wall_s"],
        "compute_s": rep["compute_s"],
        "final_accuracy": rep["final_accuracy"],
        "history": rep["history"],
        "uplink_bytes": up,
        "uplink_bytes_total": sum(up.values()),
        "outer_syncs": rep.get("outer_syncs"),
        "local_steps": rep.get("local_steps"),  # hivemind: group 0's own steps
        "auto_decisions": rep.get("auto_decisions"),
        "sync_stats": rep.get("sync_stats"),
    }


def _bed(mbit: float) -> Any:
    from testbed import parse_dcs, up

    return up(parse_dcs(",".join(f"{d}:{mbit}:{WORKERS}" for d in DCS), mbit, WORKERS))


def _safe(fn: Any, peer: Peer, steps: int) -> dict[str, Any]:
    try:
        r: dict[str, Any] = fn()
        return r
    except Exception as exc:  # one peer failing must not lose the others' rows
        print(f"  {peer.name}: FAILED {exc}", file=sys.stderr, flush=True)
        return {
            "peer": peer.name,
            "kind": peer.kind,
            "note": peer.note,
            "steps": steps,
            "error": str(exc).strip().splitlines()[-1] if str(exc).strip() else repr(exc),
            "history": [],
            "uplink_bytes_total": 0,
            "final_accuracy": math.nan,
            "wall_s": None,
        }


def measure(
    setup: Setup,
    mbits: list[float],
    peers: list[Peer],
    hidden: bool,
    budget_s: float,
    probe_steps: int,
    target: float | None,
    fallback: float,
    params: int,
) -> tuple[dict[str, list[dict[str, Any]]], float]:
    """Every peer on the unshaped testbed (only DDP rows without `hidden`), then at each rate;
    the target, unless given, is `TARGET_FRACTION` of the unshaped flat DDP run's final
    quality (synchronous DP), else `fallback` (the task's)."""
    from testbed import down

    unshaped: dict[str, dict[str, Any]] = {}
    out: dict[str, list[dict[str, Any]]] = {}
    try:
        need = [p for p in peers if hidden or p.kind == "ddp"]
        if need:
            bed = _bed(UNSHAPED_MBIT)
            for p in need:
                u = _safe(lambda p=p: run_peer(bed, setup, p, setup.steps), p, setup.steps)
                if not u.get("error"):
                    unshaped[p.name] = u
                print(
                    f"unshaped {p.name}: wall {u.get('wall_s')} acc {u.get('final_accuracy')}",
                    flush=True,
                )
            down()
        base = next((u for n, u in unshaped.items() if n.startswith("(a)")), None)
        if target is None:
            target = TARGET_FRACTION * base["final_accuracy"] if base else fallback
        print(f"target eval accuracy {target:.4f}", flush=True)
        for mbit in mbits:
            bed = _bed(mbit)
            rows: list[dict[str, Any]] = []
            for p in peers:
                r: dict[str, Any] | None = None
                if p.kind == "ddp":
                    probe = _safe(
                        lambda p=p, b=bed: run_peer(b, setup, p, probe_steps), p, probe_steps
                    )
                    per = (probe.get("wall_s") or 0) / probe_steps
                    if probe.get("error"):
                        r = probe
                    elif per * setup.steps > budget_s and p.name in unshaped:
                        r = extrapolate(probe, unshaped[p.name], setup.steps, target)
                if r is None:
                    r = _safe(lambda p=p, b=bed: run_peer(b, setup, p, setup.steps), p, setup.steps)
                if not r.get("error"):
                    r.setdefault("ttt", time_to(r["history"], target))
                    # torchft and hivemind time their syncs inside the optimizer step: their
                    # regime uses DDP's compute per step (measured alone, same shard sizes)
                    per_step = r["compute_s"] / max(1, r["steps"])
                    ref = [x for x in rows if x["kind"] == "ddp" and not x.get("error")]
                    if p.kind in ("torchft", "hivemind") and ref:
                        per_step = ref[0]["compute_s"] / max(1, ref[0]["steps"])
                    r["regime"] = regime(params, per_step, mbit)
                    r["hidden"] = hidden_ratio(unshaped.get(p.name), r) if hidden else None
                rows.append(r)
                print(
                    f"{mbit:g} Mbit/s {p.name}: wall {_fmt(r.get('wall_s'))} ttt "
                    f"{_fmt(r.get('ttt'))} acc {_fmt(r.get('final_accuracy'), '.3f')} "
                    f"MB {r['uplink_bytes_total'] / 1e6:.1f} {r.get('error', '')}",
                    flush=True,
                )
            down()
            out[f"{mbit:g}"] = rows
    finally:
        down()
    return out, target if target is not None else fallback


def merged(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`old` rows with those of the same peer replaced by `new`'s, in `PEERS` order."""
    by_name = {r["peer"]: r for r in old} | {r["peer"]: r for r in new}
    order = [q.name for q in PEERS]
    return sorted(
        by_name.values(), key=lambda r: order.index(r["peer"]) if r["peer"] in order else len(order)
    )


NOTES_HEAD = "Run notes"


def kept_notes(old_md: str) -> str:
    """What a person wrote below an earlier table: every line from the first that starts with
    `NOTES_HEAD` on. A re-run rewrites the table and keeps these."""
    lines = old_md.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if ln.startswith(NOTES_HEAD)), len(lines))
    return "".join(lines[start:])


def _earlier(mbit: float) -> dict[str, Any] | None:
    path = RESULTS / f"peers-{mbit:g}mbit.json"
    return json.loads(path.read_text()) if path.exists() else None


def plot(rows: list[dict[str, Any]], mbit: float, target: float, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5.5))
    for r in rows:
        h = r.get("history") or []
        if not h:
            continue
        style = "-" if r["kind"] == "cpn" else "--"
        label = r["peer"] + (" [extrapolated]" if r.get("extrapolated") else "")
        ax.plot(
            [p["wall_s"] for p in h],
            [100 * p["accuracy"] for p in h],
            style,
            marker=".",
            label=label,
        )
    ax.axhline(100 * target, color="grey", ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_title("\n".join(textwrap.wrap(title, 120, replace_whitespace=False)), fontsize=8)
    ax.set_xlabel("wall time (s, log)")
    ax.set_ylabel("eval accuracy (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _worker_args(w: argparse.ArgumentParser) -> None:
    for k in (
        "group",
        "groups",
        "group-rank",
        "group-world",
        "local-port",
        "store-port",
        "manager-port",
        "steps",
        "eval-every",
        "period",
        "fragments",
        "delay",
    ):
        w.add_argument(f"--{k}", type=int, required=True)
    for k in ("dc-ip", "ifname", "lighthouse", "task", "out", "rundir"):
        w.add_argument(f"--{k}", required=True)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--outer-lr", type=float, default=0.7)
    w.add_argument("--outer-momentum", type=float, default=0.9)
    w.add_argument("--nesterov", action=argparse.BooleanOptionalAction, default=True)
    w.add_argument("--timeout", type=float, default=600.0)
    w.add_argument("--matchmaking", type=float, default=2.0)
    w.add_argument("--mbit", type=float, default=None, help="uplink rate (hivemind's timeout)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
    )
    sub = p.add_subparsers(dest="cmd")
    _worker_args(sub.add_parser("torchft-worker"))
    _worker_args(sub.add_parser("hivemind-worker"))
    d = sub.add_parser("cpn-driver")
    d.add_argument("--task", required=True)
    d.add_argument("--steps", type=int, required=True)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--eval-every", type=int, required=True)
    d.add_argument("--compression", default="none")
    d.add_argument("--sync", required=True)
    d.add_argument("--dcs", default=",".join(DCS))
    d.add_argument("--ray-address", default=None)
    d.add_argument("--outer-lr", type=float, default=0.7)
    d.add_argument("--outer-momentum", type=float, default=0.9)
    d.add_argument("--nesterov", action=argparse.BooleanOptionalAction, default=True)
    d.add_argument(
        "--emulate-mbps", type=float, default=None, help="emulate every link (bench.emulation)"
    )
    p.add_argument("--mbit", type=float, nargs="+", default=[25.0, 100.0])
    p.add_argument("--task", default="builtin:gpt-stdlib")
    p.add_argument("--steps", type=int, default=320)
    p.add_argument("--period", type=int, default=32, help="H: inner steps per outer sync")
    p.add_argument("--evals", type=int, default=10, help="evaluations per run")
    p.add_argument(
        "--target",
        type=float,
        default=None,
        help="eval accuracy to race to (default: 0.97 x the unshaped flat DDP run's final)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--nesterov", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--peers", default="", help="comma-separated row names or substrings of them")
    p.add_argument(
        "--merge",
        action="store_true",
        help="keep the other rows (and the target) of the results file each rate already has",
    )
    p.add_argument("--no-hidden", action="store_true", help="skip the unshaped pass")
    p.add_argument(
        "--budget-s",
        type=float,
        default=240.0,
        help="a DDP row projected longer than this is extrapolated",
    )
    p.add_argument("--probe-steps", type=int, default=6)
    p.add_argument("--quick", action="store_true", help="40 steps, H=8: a smoke run")
    p.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    p.add_argument("--matchmaking-s", type=float, default=2.0, help="hivemind")
    p.add_argument("--peers-python", default=str(ROOT / ".venv" / "peers" / "bin" / "python"))
    a = p.parse_args(argv)
    if a.cmd == "torchft-worker":
        torchft_worker(a)
        return
    if a.cmd == "hivemind-worker":
        hivemind_worker(a)
        return
    if a.cmd == "cpn-driver":
        cpn_driver(a)
        return

    from training.tasks import load_task

    if a.quick:
        a.steps, a.period = 40, 8
    task = load_task(a.task)
    fallback = task.target_accuracy or 0.5
    params = sum(q.numel() for q in task.model().parameters() if q.requires_grad)
    setup = Setup(
        a.task,
        a.steps,
        a.period,
        a.evals,
        a.seed,
        a.outer_lr,
        a.outer_momentum,
        a.nesterov,
        a.peers_python,
        a.timeout_s,
        a.matchmaking_s,
    )
    wanted = [s.strip() for s in a.peers.split(",") if s.strip()]
    names = {q.name for q in PEERS}  # a row's whole name picks that row only

    def picked(q: Peer) -> bool:
        return any(q.name == s if s in names else s in q.name for s in wanted)

    peers = [q for q in PEERS if not wanted or picked(q)]
    earlier = {m: _earlier(m) for m in a.mbit} if a.merge else {}
    if a.target is None and earlier:
        a.target = next((e["target"] for e in earlier.values() if e), None)
    runs, target = measure(
        setup, a.mbit, peers, not a.no_hidden, a.budget_s, a.probe_steps, a.target, fallback, params
    )
    prefix = os.environ.get("CPN_TESTBED_PREFIX", "cpntb")
    command = f"sudo CPN_TESTBED_PREFIX={prefix} .venv/bin/python -m bench.peers " + shlex.join(
        argv if argv is not None else sys.argv[1:]
    )
    meta = (
        f"Task {a.task} ({params:,} parameters), {len(DCS)} datacenters x {WORKERS} workers on "
        f"the namespace testbed, {a.steps} steps, H={a.period} (streaming: 4 fragments, delay "
        f"H/4-1), outer SGD lr {a.outer_lr} momentum {a.outer_momentum} "
        f"{'Nesterov' if a.nesterov else 'plain'} for cpn and torchft, seed {a.seed}. "
        "Bytes: uplink tx counters of all datacenters. WAN-hidden: wall per step unshaped / "
        "shaped, same mode. Timings on a shared machine unless stated otherwise."
    )
    RESULTS.mkdir(exist_ok=True)
    for mbit, rows in runs.items():
        stem = RESULTS / f"peers-{mbit}mbit"
        old = earlier.get(float(mbit))
        if old:
            rows = merged(old["rows"], rows)
            again = ", ".join(r["peer"] for r in runs[mbit])
            cmd = f"{old['command']}; rows {again} re-run: {command}"
        else:
            cmd = command
        md = table(rows, float(mbit), target, cmd, meta)
        print(md, flush=True)
        old_md = stem.with_suffix(".md")
        notes = kept_notes(old_md.read_text()) if old_md.exists() else ""
        old_md.write_text(md + ("\n" + notes if notes else ""))
        stem.with_suffix(".json").write_text(
            json.dumps(
                {
                    "command": cmd,
                    "setup": asdict(setup),
                    "target": target,
                    "params": params,
                    "mbit": float(mbit),
                    "rows": rows,
                },
                indent=1,
            )
        )
        plot(
            rows,
            float(mbit),
            target,
            f"{a.task} on the testbed, {mbit} Mbit/s uplinks, 3 DC x 2\n{cmd}",
            stem.with_suffix(".png"),
        )
        print(f"wrote {stem}.{{md,json,png}}", flush=True)


if __name__ == "__main__":
    main()
