"""A lost datacenter on the namespace WAN testbed (issue 50, item 4): cpn's fault domains against
its checkpoint-restart and against torchft's own fault tolerance, on the same shaped wire.

Three datacenters a, b, c (`--workers` each) on uplinks of `--mbit` (tc tbf both ways), the
peers' task (`bench.peers`: builtin:gpt-stdlib, 320 steps, H=32), one Ray node per namespace.
Runs, one after the other, nothing beside them:

- `clean`: no failure;
- `fault-domains, node killed`: once the run passes a third of its steps, every process in c's
  namespace is killed (SIGTERM then SIGKILL: its Ray node and its workers: the datacenter's
  power); a and b go on; at two thirds c's Ray node is started again and the run asks for c
  (`membership`): it joins, taking the model and outer state from a peer;
- `fault-domains, link cut`: the same, but c's uplink drops every packet, both ways (a tc
  `pfifo` of no room in place of its shaping) instead: a and b see silence, not a reset, and
  wait out the grace window (`--grace-s`); at two thirds the link is mended, c's stale node
  is killed and started again;
- `restart, node killed` (cpn before, `fault_domains=False`): the same kill; every datacenter
  restarts from the newest checkpoint (one every tenth of the run). c's node is started again at
  once, so the restart gets all three datacenters back sooner than the fault-domain run gets c:
  the comparison favours it;
- `torchft clean` and `torchft, node killed` (`--torchft`): torchft 0.2.0's DiLoCo, one replica
  group per datacenter, the lighthouse in the hub, `min_replicas` 2, a quorum waiting up to
  10 s for every replica still heartbeating; c's process is SIGKILLed
  at a third; at two thirds a new one starts, joins the next quorum and heals from a peer
  (torchft's own recovery). fp32: torchft has no compression.

Per run: wall time, goodput (the clean run's wall time over this one's: the same useful samples),
time to the target accuracy (`--target` of the clean run's final), final accuracy, bytes on the
uplinks (interface counters), and the membership changes cpn recorded. Goals (issue 50, item 4):
goodput >= 0.9, time to target >= 1.5x sooner than checkpoint-restart, final accuracy within 1
point of the run without failure.

    .venv/bin/python -m bench.fault_testbed --torchft   # root; bench/results/fault-testbed.*

torchft runs from the peers' venv (`bench.peers` says how to install it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
DCS = ("a", "b", "c")
LOST = "c"
LIGHTHOUSE_PORT = 29511


# ----------------------------------------------------------------------------- cpn (a Ray driver)


def cpn_driver(a: argparse.Namespace) -> None:
    """One cpn run through `training.run`, in the hub namespace; the fault is made from here
    (root reaches every namespace), on a thread, so the run's own progress is not held up."""
    import testbed
    from training import Progress, TrainSpec, run
    from training.faults import Membership

    bed = testbed.load()
    assert bed is not None, "no testbed is up"
    clusters = dict.fromkeys(DCS, a.workers)
    spec = TrainSpec(
        task=a.task,
        clusters=dict(clusters),
        sync=a.sync,
        compression=a.compression,
        steps=a.steps,
        seed=a.seed,
        eval_every=max(1, a.steps // 10),
        ray_address=bed.ray_address,
        checkpoint=a.checkpoint,
        checkpoint_every=max(1, a.steps // 10),
        fault_domains=a.mode != "restart",
        fault_grace_s=a.grace_s,
    )
    t0 = time.perf_counter()
    state: dict[str, Any] = {"want": Membership(0, dict(clusters)), "events": []}
    busy = threading.Lock()

    def note(what: str) -> None:
        state["events"].append({"what": what, "wall_s": time.perf_counter() - t0})

    def guarded(fn: Any) -> Any:
        def go() -> None:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 (the table says the fault did not happen)
                note(f"failed: {exc}")

        return go

    @guarded
    def lose() -> None:
        with busy:
            if a.fault == "cut":
                bed.cut(LOST)
                note(f"{LOST}'s uplink cut")
            else:
                bed.kill_node(LOST)
                note(f"{LOST}'s node killed")
                if a.mode == "restart":  # back at once: the restart gets all three
                    bed.start_node(LOST)
                    note(f"{LOST}'s node started again")

    @guarded
    def back() -> None:
        with busy:
            if a.fault == "cut":
                bed.mend(LOST)
                note(f"{LOST}'s uplink mended")
                bed.kill_node(LOST)  # the head declared it dead: its raylet cannot come back
            bed.start_node(LOST)
            note(f"{LOST}'s node started again")
            state["want"] = Membership(1, dict(clusters))

    def on_progress(p: Progress) -> None:
        state["compute"] = dict(p.compute_by_cluster)  # since the group last re-formed
        for line in p.logs:
            print(f"[{p.step}] {line}", file=sys.stderr, flush=True)
        if a.mode == "clean":
            return
        if "lost" not in state and p.step >= a.steps // 3:
            state["lost"] = p.step
            threading.Thread(target=lose, daemon=True).start()
        elif a.mode != "restart" and "back" not in state and p.step >= int(a.back * a.steps):
            state["back"] = p.step
            threading.Thread(target=back, daemon=True).start()

    rep = run(spec, on_progress=on_progress, membership=lambda: state["want"]).to_dict()
    keep = ("wall_s", "final_accuracy", "history", "restarts", "membership", "wan_bytes")
    out = {k: rep.get(k) for k in keep}
    out["fault_events"] = state["events"]
    out["compute_by_cluster"] = state.get("compute", {})  # 0 for one that sat the end out
    print(json.dumps(out, default=str))


# ----------------------------------------------------------------------------- torchft


def torchft_worker(a: argparse.Namespace) -> None:
    """One datacenter's replica group (one process) of torchft DiLoCo, fp32, quorum-tolerant:
    `min_replica_size` 2, so a and b go on without c; a restarted c (`--start-step`) joins the
    next quorum and heals from a peer. Every rank writes its step to `rundir/step-<group>`."""
    import socket
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    from bench.peers import _evaluate, _task_setup
    from training.data import batch_indices, shard

    os.environ["GLOO_SOCKET_IFNAME"] = a.ifname
    # torchft's checkpoint server (a newcomer heals from it) advertises the host name, which
    # names no address inside a testbed namespace: advertise the datacenter's own
    socket.gethostname = lambda: a.dc_ip
    task, x, y, xe, ye, model = _task_setup(a.task, a.seed, a.timeout)
    store = dist.TCPStore(a.dc_ip, a.store_port, 1, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=a.timeout)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=a.grace_s)),
        load_state_dict=lambda sd: model.load_state_dict(sd["model"]),
        state_dict=lambda: {"model": model.state_dict()},
        min_replica_size=2,
        use_async_quorum=False,
        replica_id=f"dc{a.group}",
        store_addr=a.dc_ip,
        store_port=a.store_port,
        rank=0,
        world_size=1,
        lighthouse_addr=a.lighthouse,
        hostname=a.dc_ip,
        port=a.manager_port,
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
        init_sync=a.start_step > 0,  # a newcomer heals from a peer at its first quorum
    )
    params = [p for p in model.parameters() if p.requires_grad]
    inner = task.optimizer.build(params)
    outer = torch.optim.SGD(params, lr=a.outer_lr, momentum=a.outer_momentum, nesterov=True)
    history: list[dict[str, float]] = []
    stepfile = Path(a.rundir) / f"step-{a.group}"
    start = time.perf_counter()
    with DiLoCo(manager, [model], inner, outer, sync_every=a.period):
        for step in range(a.start_step, a.steps):
            mine = shard(batch_indices(len(x), task.batch_size, a.seed, step), a.group, a.groups)
            inner.zero_grad()
            task.loss(model(x[mine]), y[mine]).backward()
            inner.step()
            stepfile.write_text(str(step + 1))
            if a.group == 0 and ((step + 1) % a.eval_every == 0 or step + 1 == a.steps):
                ev = _evaluate(task, model, xe, ye)
                history.append({"wall_s": time.perf_counter() - start, "step": step + 1, **ev})
    wall = time.perf_counter() - start
    if a.group == 0:
        Path(a.out).write_text(
            json.dumps(
                {
                    "wall_s": wall,
                    "final_accuracy": history[-1]["accuracy"],
                    "history": history,
                    "outer_syncs": int(manager.current_step()),
                }
            )
        )
    manager.shutdown(wait=False)
    del store


def _torchft_run(bed: Any, a: argparse.Namespace, fault: bool, rundir: Path) -> dict[str, Any]:
    from testbed.layout import HUB_IP, HUB_NS, UPLINK_IF

    rundir.mkdir(parents=True)
    lh = Path(a.peers_python).parent / "torchft_lighthouse"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env["TORCHFT_QUORUM_TIMEOUT_SEC"] = str(int(a.timeout_s))
    env["TORCHFT_TIMEOUT_SEC"] = str(int(a.timeout_s))
    logs: list[Any] = []
    base = 29800 + 40 * (os.getpid() % 40) + (20 if fault else 0)

    def spawn(g: int, start_step: int) -> subprocess.Popen[bytes]:
        dc = bed.datacenters[g]
        argv = ["ip", "netns", "exec", dc["netns"], a.peers_python, "-m", "bench.fault_testbed"]
        argv += ["torchft-worker", "--group", str(g), "--groups", str(len(DCS))]
        again = 1 if start_step else 0  # a new process, new ports
        argv += ["--dc-ip", dc["ip"], "--store-port", str(base + 4 * g + again)]
        argv += ["--manager-port", str(base + 4 * g + 2 + again), "--ifname", UPLINK_IF]
        argv += ["--lighthouse", f"http://{HUB_IP}:{LIGHTHOUSE_PORT}", "--task", a.task]
        argv += ["--steps", str(a.steps), "--seed", str(a.seed), "--period", str(a.period)]
        argv += ["--eval-every", str(max(1, a.steps // 10)), "--out", str(rundir / "out.json")]
        argv += ["--rundir", str(rundir), "--start-step", str(start_step)]
        argv += ["--grace-s", str(a.grace_s), "--timeout", str(a.timeout_s)]
        log = open(rundir / f"g{g}-{start_step}.err", "wb")  # noqa: SIM115
        logs.append(log)
        return subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=log, env=env, start_new_session=True
        )

    def step_of(g: int) -> int:
        with contextlib.suppress(OSError, ValueError):
            return int((rundir / f"step-{g}").read_text() or 0)
        return 0

    lighthouse = subprocess.Popen(
        [
            *("ip", "netns", "exec", HUB_NS, str(lh), "--min_replicas", "2"),
            # a quorum waits this long for every replica still heartbeating (a dead one stops)
            *("--bind", f"{HUB_IP}:{LIGHTHOUSE_PORT}", "--join_timeout_ms", "10000"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(0.5)
    procs = [spawn(g, 0) for g in range(len(DCS))]
    events: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    lost = len(DCS) - 1
    deadline = time.monotonic() + a.timeout_s
    try:
        while procs[0].poll() is None and time.monotonic() < deadline:
            s = step_of(0)
            if fault and not events and s >= a.steps // 3:
                os.killpg(procs[lost].pid, signal.SIGKILL)
                events.append({"what": f"{LOST} killed", "step": s, "t": time.perf_counter() - t0})
            elif fault and len(events) == 1 and s >= int(a.back * a.steps):
                procs[lost].wait()
                procs[lost] = spawn(lost, s)
                events.append({"what": f"{LOST} started", "step": s, "t": time.perf_counter() - t0})
            time.sleep(0.1)
        if procs[0].returncode != 0:
            tail = (rundir / "g0-0.err").read_text(errors="replace")[-900:]
            raise RuntimeError(f"torchft group a: exit {procs[0].returncode}: {tail}")
        rep: dict[str, Any] = json.loads((rundir / "out.json").read_text())
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        lighthouse.kill()
        lighthouse.wait()
        for f in logs:
            f.close()
    rep["fault_events"] = events
    rep["restarts"] = 0
    rep["membership"] = []
    return rep


# ----------------------------------------------------------------------------- orchestration


RUNS = (
    ("clean", "cpn", "clean", "kill"),
    ("fault-domains, node killed", "cpn", "fault-domains", "kill"),
    ("fault-domains, link cut", "cpn", "fault-domains", "cut"),
    ("restart, node killed", "cpn", "restart", "kill"),
    ("torchft clean", "torchft", "clean", "kill"),
    ("torchft, node killed", "torchft", "fault-domains", "kill"),
)


def _one(bed: Any, a: argparse.Namespace, name: str, who: str, mode: str, fault: str) -> Any:
    rundir = Path(f"/tmp/cpn-fault-testbed-{os.getpid()}/{mode}-{fault}-{who}")
    before = bed.uplink_bytes()
    if who == "torchft":
        rep = _torchft_run(bed, a, mode != "clean", rundir)
    else:
        argv = [sys.executable, "-m", "bench.fault_testbed", "cpn-driver", "--mode", mode]
        argv += ["--fault", fault, "--task", a.task, "--steps", str(a.steps)]
        argv += ["--back", str(a.back)]
        argv += ["--sync", a.sync, "--compression", a.compression, "--seed", str(a.seed)]
        argv += ["--workers", str(a.workers), "--grace-s", str(a.grace_s)]
        argv += ["--checkpoint", str(rundir / "ckpt")]
        res = bed.run_in_hub(argv, timeout=a.timeout_s)
        rundir.mkdir(parents=True, exist_ok=True)
        (rundir / "driver.err").write_text(res.stderr)  # kept: what the run logged
        if res.returncode != 0:
            raise RuntimeError(res.stderr[-1500:])
        rep = json.loads(res.stdout.strip().splitlines()[-1])
    after = bed.uplink_bytes()
    rep["uplink_bytes"] = sum(after[d][0] - before[d][0] for d in after)
    rep["run"], rep["who"], rep["mode"], rep["fault"] = name, who, mode, fault
    rep["measured_on"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"  {name}: wall {rep['wall_s']:.1f} s, final {rep['final_accuracy']:.4f}", flush=True)
    return rep


def _whole(bed: Any) -> None:
    """Whatever a run left (a failed one too), the next starts with c's link and node up."""
    from testbed import net

    bed.mend(LOST)
    if not net.sh("ip", "netns", "pids", bed.datacenter(LOST).netns, check=False).split():
        bed.start_node(LOST)


def _table(rows: list[dict[str, Any]], a: argparse.Namespace, command: str) -> tuple[str, str]:
    from bench.fault_domains import _met, _time_to

    clean = {r["who"]: r for r in rows if r["mode"] == "clean" and "error" not in r}
    target = a.target * clean["cpn"]["final_accuracy"]
    for r in rows:
        if "error" in r:
            continue
        ref = clean.get(r["who"])
        r["goodput"] = ref["wall_s"] / r["wall_s"] if ref else None
        r["time_to_target_s"] = _time_to(r["history"], target)
        r["accuracy_delta"] = r["final_accuracy"] - ref["final_accuracy"] if ref else None
    regime = (
        f"namespace testbed on 2 cores, datacenters a, b, c x {a.workers} worker(s), uplinks "
        f"{a.mbit:g} Mbit/s (tc tbf both ways), {a.task}, {a.steps} steps; cpn {a.sync} "
        f"{a.compression}, grace {a.grace_s:g} s, a checkpoint every {a.steps // 10} steps; "
        f"torchft DiLoCo fp32 H={a.period}, min_replicas 2; "
        f"c lost at 1/3 of the steps, back at {a.back:.2g}"
    )
    lines = [
        "# A lost datacenter on the WAN testbed: fault domains, checkpoint-restart, torchft",
        "",
        f"`{command}`",
        "",
        f"Regime: {regime}. Nothing else ran on the machine. Target accuracy: {target:.4f} "
        f"({a.target:g} of cpn's clean run's final). Goodput and Δ are against the same "
        "system's clean run.",
        "",
        "| run | wall s | goodput | time to target s | final accuracy | Δ vs clean | "
        "uplink MB | restarts |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def f(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    for r in rows:
        if "error" in r:
            lines.append(f"| {r['run']} | failed: {r['error']} | | | | | | |")
            continue
        lines.append(
            f"| {r['run']} | {r['wall_s']:.1f} | {f(r['goodput'], '.2f')} | "
            f"{f(r['time_to_target_s'], '.1f')} | {r['final_accuracy']:.4f} | "
            f"{f(r['accuracy_delta'], '+.4f')} | {r['uplink_bytes'] / 1e6:,.1f} | "
            f"{r.get('restarts', 0)} |"
        )
    lines += [""]
    for r in rows:
        for m in r.get("membership") or []:
            ready = (
                f" (its workers started and loaded in {m['ready_s']:.2f} s while the others "
                "trained on)"
                if "ready_s" in m
                else ""
            )
            reformed = "" if m["change"] == "seated" else f", re-formed in {m['recovery_s']:.2f} s"
            lines.append(
                f"- {r['run']}: step {m['step']}: {m['cluster']} {m['change']} ({m['why']})"
                f"{reformed}{ready}"
            )
    by = {r["run"]: r for r in rows if "error" not in r}
    rs = by.get("restart, node killed")
    goals = []
    for name in ("fault-domains, node killed", "fault-domains, link cut"):
        fd = by.get(name)
        if fd is None:
            continue
        sooner = (
            rs["time_to_target_s"] / fd["time_to_target_s"]
            if rs and fd["time_to_target_s"] and rs["time_to_target_s"]
            else None
        )
        goals.append(
            f"- {name}: goodput >= 0.9 ({'met' if fd['goodput'] >= 0.9 else 'not met'}: "
            f"{fd['goodput']:.2f}); time to target >= 1.5x sooner than restart ("
            + ("n/a" if sooner is None else f"{_met(sooner >= 1.5)}: {sooner:.2f}x")
            + f"); final accuracy within 1 point ("
            f"{'met' if abs(fd['accuracy_delta']) <= 0.01 else 'not met'}: "
            f"{fd['accuracy_delta']:+.4f})"
        )
    lines += ["", "Goals (issue 50, item 4):", "", *goals]
    return "\n".join(lines) + "\n", regime


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd")
    d = sub.add_parser("cpn-driver")
    d.add_argument("--mode", choices=("clean", "fault-domains", "restart"), required=True)
    d.add_argument("--fault", choices=("kill", "cut"), default="kill")
    d.add_argument("--checkpoint", required=True)
    w = sub.add_parser("torchft-worker")
    for k in ("group", "groups", "store-port", "manager-port", "eval-every", "period"):
        w.add_argument(f"--{k}", type=int, required=True)
    for k in ("dc-ip", "ifname", "lighthouse", "out", "rundir"):
        w.add_argument(f"--{k}", required=True)
    w.add_argument("--start-step", type=int, default=0)
    w.add_argument("--timeout", type=float, default=900.0)
    w.add_argument("--outer-lr", type=float, default=0.7)
    w.add_argument("--outer-momentum", type=float, default=0.9)
    for q in (p, d, w):
        q.add_argument("--task", default="builtin:gpt-stdlib")
        q.add_argument("--steps", type=int, default=320)
        q.add_argument("--back", type=float, default=2 / 3, help="c returns at this fraction")
        q.add_argument("--seed", type=int, default=0)
        q.add_argument("--grace-s", type=float, default=20.0)
    for q in (p, d):
        q.add_argument("--sync", default="local-sgd:32")
        q.add_argument("--compression", default="int8")
        q.add_argument("--workers", type=int, default=1)
    p.add_argument("--period", type=int, default=32, help="torchft's H")
    p.add_argument("--mbit", type=float, default=25.0)
    p.add_argument("--target", type=float, default=0.97)
    p.add_argument("--runs", default="", help="comma-separated run names or parts of them")
    p.add_argument("--torchft", action="store_true", help="also torchft's two runs")
    p.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--peers-python", default=str(ROOT / ".venv" / "peers" / "bin" / "python"))
    a = p.parse_args(argv)
    if a.cmd == "cpn-driver":
        cpn_driver(a)
        return 0
    if a.cmd == "torchft-worker":
        torchft_worker(a)
        return 0

    from testbed import down, parse_dcs, up

    wanted = [s.strip() for s in a.runs.split(",") if s.strip()]
    runs = [
        r
        for r in RUNS
        if (a.torchft or r[1] == "cpn") and (not wanted or any(s in r[0] for s in wanted))
    ]
    layout = ",".join(f"{x}:{a.mbit:g}:{a.workers}" for x in DCS)
    rows = []
    try:
        bed = up(parse_dcs(layout, a.mbit, a.workers))
        for name, who, mode, fault in runs:
            print(f"{name} ...", flush=True)
            try:
                rows.append(_one(bed, a, name, who, mode, fault))
            except Exception as exc:  # noqa: BLE001 (one failed run must not lose the others)
                print(f"  {name}: FAILED {exc}", file=sys.stderr, flush=True)
                rows.append({"run": name, "who": who, "mode": mode, "error": str(exc)[-300:]})
            _whole(bed)
    finally:
        down()
    command = ".venv/bin/python -m bench.fault_testbed " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    md, regime = _table(rows, a, command)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "fault-testbed.md").write_text(md)
    (a.out / "fault-testbed.json").write_text(
        json.dumps({"command": command, "regime": regime, "runs": rows}, indent=1, default=str)
    )
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
