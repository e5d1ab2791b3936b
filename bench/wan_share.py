"""Two tenants' jobs on one datacenter's shared uplink, on the namespace testbed: does each get
what its plan reserved, and does it run as planned? (issue 49)

The wire: datacenters a, b, c (`testbed`, 2 worker slots each), every uplink shaped with tc tbf
at `--mbit` both ways. A job on a+b and one on a+c share a's uplink (and downlink).

The plans: cpn's own placement (`place_pending`) on a real SQLite database, no Ray (this bench
launches the planned runs itself, as `train_spec_of` makes them): clusters a, b, c as on the
testbed plus d and e (not on the testbed), 1 T4 each but a with 3; links of `--mbit` declared
between every pair, and the testbed's links also measured as cpn's agents measure them (each
datacenter's `LinkProber` against the others' `ProbeServer`, the controller's probe size,
windowed over three probes, on the idle wire before any run) and reported to the controller
(`ingest_links`); the GPU efficiency calibrated from the task's compute on the testbed,
measured by two single-datacenter runs side by side (the load of the measured runs). Jobs,
placed in turn:

- J1 (tenant x): data local to a and b (so it runs on a:1 + b:1); J2 (tenant y): on a:1 + c:1; both
  run `--task` with `--compression` / `--sync`;
- J3 (tenant z): the same task, data anywhere, 2 GPUs, compression and sync auto: where its
  plan puts it (a still has a GPU free, on an uplink J1 and J2 reserved); it is not run.

Four modes: `alone` runs J1 by itself as `cpn` plans it (what the cost model misses with no
second job); in the others J1 and J2 run side by side:

- `cpn`: every port declared (`uplink_gbps` / `downlink_gbps` = `--mbit`): each job is planned
  at the share the others left, reserves its plan's average rate, and runs paced (links at
  the planned share, sends averaged to the reservation: `training.wan.Pacer`);
- `blind` (cpn before issue 49): no ports declared: each job planned as if it had the uplink
  to itself, nothing reserved, runs unpaced;
- `share`: as `cpn`, every port also labelled `wan_job_share` = `--job-share`, so no job is
  planned on more than that share of a port and a later job finds its share.

A job that waits for the rate a running job holds (`scheduler.bandwidth_wait`) is placed again
once the runs it waited for ended (they are ended in the database, as at any end) and run
then; its wait's promise (done so many seconds after its submission) is set against when its
run was seen to end.

Per job: planned path share, reservation and step time against the measured send rate of its
a-side leader (its own counters: bytes on its a->x link over the run's wall time) and step
time (wall between its first and last reports, over the steps between); a's uplink counters.
Goals (issue 49, item 4): each job's rate within 10 % of its reservation, its step time within
15 % of its plan, J3 kept off the full uplink or compressed for it.

    sudo .venv/bin/python -m bench.wan_share            # writes bench/results/wan-share.*

Two cores: run nothing beside it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
TESTBED = ("a", "b", "c")
SLOTS = 2
GPUS = {"a": 3, "b": 1, "c": 1, "d": 1, "e": 1}
MODEL = "T4"
RUN_TIMEOUT_S = 600
PROBE_PORT = 9100


@dataclass(frozen=True)
class Case:
    """One job: its name, tenant, the clusters holding its data (None: anywhere), whether
    the bench runs it, and whether its compression and sync are the planner's."""

    name: str
    tenant: str
    data: tuple[str, ...] | None
    run: bool
    auto: bool = False


CASES = (
    Case("J1", "x", ("a", "b"), run=True),
    Case("J2", "y", ("a", "c"), run=True),
    Case("J3", "z", None, run=False, auto=True),
)
CASE = {c.name: c for c in CASES}
RUN = {c.name for c in CASES if c.run}


@dataclass
class Planned:
    """What cpn decided for one job, and the run spec it made (None: not placed)."""

    name: str
    placed: dict[str, int]
    reason: str
    compression: str
    sync: str
    step_s: float | None
    share_mbps: float | None
    reserved_mbps: float | None
    train: dict[str, Any] | None
    total_s: float | None = None
    """The plan's whole run, set-up included (what a wait's promise adds up)."""
    waits_for: list[str] = field(default_factory=list)
    """Waiting for the WAN rate of these running jobs (their ids)."""
    promised_done_s: float | None = None
    """A waiting job: when its wait said it would be done, seconds after its submission."""
    submitted_at: float = 0.0
    """When it was submitted (epoch seconds)."""


# ----------------------------------------------------------------------------- pure parts


def measured(samples: list[dict[str, Any]], edge: str) -> tuple[float | None, float | None]:
    """(send rate of `edge` in Mbit/s, seconds per step) between a run's first and last but
    one reports: the start-up and first segment, and the last (the final checkpoint), are
    left out as the plan's step time leaves them out."""
    if len(samples) < 3:
        return None, None
    first, last = samples[0], samples[-2]
    wall = last["wall_s"] - first["wall_s"]
    steps = last["step"] - first["step"]
    if wall <= 0 or steps <= 0:
        return None, None
    sent = last["wan_bytes"].get(edge, 0) - first["wan_bytes"].get(edge, 0)
    return 8 * sent / wall / 1e6, wall / steps


def rates(samples: list[dict[str, Any]], edge: str) -> list[tuple[float, float]]:
    """(wall s, Mbit/s over the segment before it) for each report after the first."""
    out = []
    for a, b in itertools.pairwise(samples):
        dt = b["wall_s"] - a["wall_s"]
        if dt > 0:
            sent = b["wan_bytes"].get(edge, 0) - a["wan_bytes"].get(edge, 0)
            out.append((b["wall_s"], 8 * sent / dt / 1e6))
    return out


def _pct(x: float | None, y: float | None) -> str:
    return f"{100 * (x - y) / y:+.0f} %" if x is not None and y else "-"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


# ----------------------------------------------------------------------------- control plane


class Board:
    """The bench's control plane between its passes: the database, the jobs by name, and the
    waits `place_pending` keeps between passes (as the loop keeps them)."""

    def __init__(self, factory: Any, engine: Any, config: Any, blind: bool) -> None:
        self.factory, self.engine, self.config = factory, engine, config
        self.blind = blind  # no ports declared: what a plan reserves limits nothing
        self.ids: dict[str, str] = {}
        self.waits: dict[str, Any] = {}

    def place(self, efficiency: dict[str, float]) -> None:
        from controller.loop.placement import place_pending
        from controller.network.snapshot import Calibration

        place_pending(self.factory, "bench", Calibration(fleet=efficiency), waits=self.waits)

    def planned(self, case: Case) -> Planned:
        """What the last pass decided for `case`'s job, and its run spec."""
        from controller.jobs.request import spec_of
        from controller.loop.ray_run import train_spec_of
        from controller.store.models import Job

        job_id = self.ids[case.name]
        with self.factory() as s:
            job = s.get(Job, job_id)
            assert job is not None
            plan = job.placement
            held = {x.cluster: x.gpus for x in plan.clusters} if plan else {}
            train = (
                train_spec_of(self.config, job, spec_of(job), held) if plan and case.run else None
            )
            link = next((k for k in plan.links), None) if plan else None
            kbps = max(plan.wan_kbps.values(), default=0) if plan else 0
            wait = self.waits.get(job_id) if not plan else None
            return Planned(
                name=case.name,
                placed=held,
                reason=job.reason or "",
                compression=plan.compression if plan else "-",
                sync=plan.sync if plan else "-",
                step_s=plan.estimate.step_time_s if plan else None,
                share_mbps=link.bandwidth_gbps * 1000 if link else None,
                reserved_mbps=kbps / 1000 if not self.blind and kbps else None,
                train=None if train is None else train.to_dict(),
                total_s=plan.estimate.total_time_s if plan else None,
                waits_for=list(wait.holders) if wait is not None else [],
                promised_done_s=(
                    wait.finish_s - job.created_at.timestamp() if wait is not None else None
                ),
                submitted_at=job.created_at.timestamp(),
            )

    def end(self, *names: str) -> None:
        """These jobs' runs ended: their GPUs and WAN rates go back (as at any end)."""
        from controller.jobs.service import cancel
        from controller.store.models import Job

        with self.factory() as s, s.begin():
            for name in names:
                job = s.get(Job, self.ids[name])
                assert job is not None
                cancel(s, job, "its bench run ended")

    def close(self) -> None:
        self.engine.dispose()


def plan_all(
    mode: str,
    a: argparse.Namespace,
    efficiency: dict[str, float],
    measured: dict[str, list[dict[str, Any]]],
) -> tuple[list[Planned], Board]:
    """Place J1, J2, J3 in turn through cpn's placement, the agents' `measured` links (by
    reporting datacenter) reported first; each job's plan and run spec, and the board to
    place again on (`Board.end`, `Board.place`)."""
    from agents.protocol import GpuInventory, Heartbeat, LinkReport
    from controller.jobs.service import Submission, Submitted, submit_many
    from controller.loop.ray_run import LauncherConfig
    from controller.network.leases import LeasePolicy
    from controller.network.resources import (
        create_cluster,
        declare_link,
        ingest_heartbeat,
        ingest_links,
    )
    from controller.store.db import make_engine, make_sessionmaker
    from controller.store.migrate import upgrade
    from controller.store.models import QOS_CLASSES, GpuPrice, Tenant, utcnow
    from wire.spec import JobSpec

    tmp = Path(tempfile.mkdtemp(prefix=f"cpn-bench-share-{mode}-"))
    url = f"sqlite:///{tmp / 'cpn.db'}"
    upgrade(url)
    engine = make_engine(url)
    factory = make_sessionmaker(engine)
    leases = LeasePolicy(heartbeat_interval_s=3600.0, grace_s=3600.0)
    gbps = a.mbit / 1000
    ports = {"uplink_gbps": str(gbps), "downlink_gbps": str(gbps)} if mode != "blind" else {}
    if mode == "share":
        ports["wan_job_share"] = str(a.job_share)
    with factory() as s, s.begin():
        for name in GPUS:
            cluster = create_cluster(s, name, "region", dict(ports))
            for qos_class in QOS_CLASSES:
                s.add(
                    GpuPrice(
                        cluster_id=cluster.id,
                        gpu_model=MODEL,
                        qos_class=qos_class,
                        price_per_gpu_hour=Decimal("1.0"),
                        effective_from=utcnow() - timedelta(hours=1),
                    )
                )
    with factory() as s, s.begin():
        for name, n in GPUS.items():
            inv = GpuInventory(model=MODEL, memory_gib=16, count=n, allocatable=n)
            ingest_heartbeat(s, Heartbeat(cluster=name, gpus=[inv]), leases)
        for src in GPUS:
            for dst in GPUS:
                if src != dst:
                    declare_link(
                        s, src, dst, bandwidth_gbps=gbps, rtt_ms=1.0, loss=0.0,
                        egress_price_per_gb=0.0,
                    )  # fmt: skip
        for src, links in measured.items():
            ingest_links(s, LinkReport.model_validate({"cluster": src, "links": links}))
        tenants = {c.tenant: Tenant(name=c.tenant, budget=1e9) for c in CASES}
        s.add_all(tenants.values())
        s.flush()
        tenant_ids = {k: t.id for k, t in tenants.items()}
    config = LauncherConfig(
        replica_id="bench", checkpoint_root=tmp / "ckpt", emulate_wan=False, ray_address=None
    )
    board = Board(factory, engine, config, blind=mode == "blind")
    out: list[Planned] = []
    for case in CASES:
        body: dict[str, Any] = {
            "name": case.name,
            "task": a.task,
            "gpus": 2,
            "steps": a.steps,
            "compression": "auto" if case.auto else a.compression,
            "sync": "auto" if case.auto else a.sync,
            "args": {"eval_every": a.eval_every, "checkpoint_every": a.steps, "seed": 0},
        }
        if case.data is not None:
            body["data"] = {"residency": "local", "clusters": list(case.data)}
        spec = JobSpec.model_validate(body)
        with factory() as s, s.begin():
            [done] = submit_many(s, [Submission(spec, tenant_ids[case.tenant])])
            if not isinstance(done, Submitted):
                raise RuntimeError(f"{case.name} refused: {done}")
            board.ids[case.name] = done.job.id
        board.place(efficiency)
        out.append(board.planned(case))
    return out, board


# ----------------------------------------------------------------------------- runs


def driver(a: argparse.Namespace) -> None:
    """One `training.run` of a spec file (a Ray driver in the hub namespace); prints one line
    of JSON: the report's totals and every progress report's counters."""
    from training import TrainSpec, run
    from training.spec import LinkSpec, Progress

    data = json.loads(Path(a.spec).read_text())
    data["links"] = [LinkSpec(**x) for x in data["links"]]
    data["link_schedule"] = [tuple(x) for x in data["link_schedule"]]
    data["ray_address"] = a.ray_address
    samples: list[dict[str, Any]] = []

    def on_progress(p: Progress) -> None:
        samples.append(
            {
                "wall_s": p.wall_s,
                "step": p.step,
                "compute_s": p.compute_s,
                "exchange_s": p.exchange_s,
                "wan_bytes": p.wan_bytes.to_json(),
            }
        )

    rep = run(TrainSpec(**data), on_progress=on_progress)
    keep = {"wall_s": rep.wall_s, "compute_s": rep.compute_s, "steps": rep.steps}
    print(json.dumps({**keep, "final_accuracy": rep.final_accuracy, "samples": samples}))


def serve_probe(a: argparse.Namespace) -> None:
    """An agent's probe endpoint on `a.host` (in a datacenter's namespace) until killed."""
    from agents.probe_server import ProbeServer

    with ProbeServer(a.host, PROBE_PORT):
        while True:
            time.sleep(3600)


def probe_peers(a: argparse.Namespace) -> None:
    """An agent's link measurements to `a.peers` (name=url,...), as its runner makes them:
    `rounds` rounds of one probe per peer, each report windowed over the last three. Prints
    the last round's reports as one JSON list."""
    from agents.links import LinkProber
    from agents.protocol import PeerProbe

    peers = [PeerProbe(cluster=n, probe_url=u) for n, u in (x.split("=") for x in a.peers)]
    prober = LinkProber()
    found: dict[str, Any] = {}
    for _ in range(a.rounds):
        for m in prober.measure_all(peers, a.probe_bytes):
            found[m.dst] = m.model_dump(mode="json")
    print(json.dumps(list(found.values())))


def measure_on(bed: Any) -> dict[str, list[dict[str, Any]]]:
    """What cpn's agents would report of the testbed's links, on the idle wire: each
    datacenter probes the others in turn (`probe_peers`), against their probe endpoints; the
    controller's default probe size."""
    from api.config import Settings

    dcs = [bed.datacenter(d["name"]) for d in bed.datacenters]
    size = Settings.model_fields["probe_bytes"].default
    module = [sys.executable, "-m", "bench.wan_share"]
    servers = [
        subprocess.Popen(
            ["ip", "netns", "exec", dc.netns, *module, "probe-serve", "--host", dc.ip],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for dc in dcs
    ]
    out: dict[str, list[dict[str, Any]]] = {}
    try:
        time.sleep(2.0)  # the endpoints bind (a failed probe is retried by the next round)
        for dc in dcs:
            peers = [f"{o.name}=http://{o.ip}:{PROBE_PORT}" for o in dcs if o is not dc]
            argv = [*module, "probe", "--probe-bytes", str(size), "--peers", *peers]
            done = subprocess.run(
                ["ip", "netns", "exec", dc.netns, *argv],
                capture_output=True,
                text=True,
                timeout=600,
                check=True,
            )
            out[dc.name] = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        for proc in servers:
            proc.kill()
            proc.wait()
    return out


def run_side_by_side(bed: Any, specs: dict[str, dict[str, Any]], tmp: Path) -> dict[str, Any]:
    """Run every spec at once (one driver each in the hub); their JSON, and the bytes out of
    and into a's uplink meanwhile."""
    procs = {}
    before = bed.uplink_bytes()
    env = {**os.environ, **bed.env()}
    for name, spec in specs.items():
        path = tmp / f"{name}.json"
        path.write_text(json.dumps(spec))
        argv = [sys.executable, "-m", "bench.wan_share", "driver", "--spec", str(path)]
        argv += ["--ray-address", bed.ray_address]
        procs[name] = subprocess.Popen(
            bed.hub_argv(argv), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    out: dict[str, Any] = {}
    deadline = time.monotonic() + RUN_TIMEOUT_S
    for name, p in procs.items():
        try:
            stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"{name}: driver exit {p.returncode}: {stderr[-1500:]}")
        # when it was seen to end (epoch s): exact for the first, no sooner for the others
        out[name] = {**json.loads(stdout.strip().splitlines()[-1]), "ended_at": time.time()}
    after = bed.uplink_bytes()
    out["a_uplink"] = {
        "out": after["a"][0] - before["a"][0],
        "in": after["a"][1] - before["a"][1],
    }
    return out


def calibrate_on(bed: Any, a: argparse.Namespace, tmp: Path) -> tuple[dict[str, float], float]:
    """The GPU efficiency of the testbed's workers for the task: two single-datacenter runs
    (b:2 and c:2) side by side, each worker doing half a step's work as in the measured runs;
    (efficiency, compute seconds a step)."""
    import scheduler
    from controller.values.tasks import builtin_work
    from training import TrainSpec

    specs = {
        f"calibrate-{dc}": (
            TrainSpec(
                task=a.task,
                clusters={dc: SLOTS},
                compression=a.compression,
                sync=a.sync,
                steps=a.calibrate_steps,
                eval_every=a.calibrate_steps,
            ).to_dict()
        )
        for dc in ("b", "c")
    }
    runs = run_side_by_side(bed, specs, tmp)
    per_step = max(runs[k]["compute_s"] / runs[k]["steps"] for k in specs)
    flops = builtin_work(a.task).flops_per_step / SLOTS
    found = [scheduler.Observation(gpu_model=MODEL, gpus=1, flops=flops, compute_s=per_step)]
    return scheduler.calibrate(found), per_step


# ----------------------------------------------------------------------------- report


def rows(mode: str, planned: list[Planned], runs: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in planned:
        row: dict[str, Any] = {"mode": mode, **asdict(p)}
        row.pop("train")
        if p.name in runs:
            other = next(c for c in p.placed if c != "a")
            rate, step = measured(runs[p.name]["samples"], f"a->{other}")
            row.update(
                rate_mbps=rate,
                measured_step_s=step,
                series=rates(runs[p.name]["samples"], f"a->{other}"),
                final_accuracy=runs[p.name]["final_accuracy"],
            )
        out.append(row)
    return out


def table(
    mode: str,
    got: list[dict[str, Any]],
    a_uplink: dict[str, int],
    wall: float,
    then: bool = False,
) -> str:
    title = {
        "cpn": "cpn: ports declared, each job planned at the share left, reserved and paced",
        "blind": "link-blind (before issue 49): no ports, each job planned alone, unpaced",
        "alone": "J1 alone, as cpn plans and paces it: the cost model's error without contention",
        "share": "cpn with `wan_job_share` on every port: no job planned on more than that share",
    }[mode]
    if then:
        title += ": then, the jobs that waited, placed again once the runs they waited for ended"
    lines = [
        f"#### {title}",
        "",
        "| job | placed | compression / sync | planned share (Mbit/s) | reserved (Mbit/s) "
        "| sent (Mbit/s) | vs reserved | est step (s) | step (s) | vs plan |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in got:
        placed = ", ".join(f"{c}:{n}" for c, n in r["placed"].items()) or f"- ({r['reason']})"
        ran = "rate_mbps" in r
        lines.append(
            f"| {r['name']} | {placed} | {r['compression']} / {r['sync']} | "
            f"{_num(r['share_mbps'], '.1f')} | {_num(r['reserved_mbps'], '.1f')} | "
            f"{_num(r.get('rate_mbps'), '.1f') if ran else 'not run'} | "
            f"{_pct(r.get('rate_mbps'), r['reserved_mbps']) if ran else ''} | "
            f"{_num(r['step_s'], '.3f')} | {_num(r.get('measured_step_s'), '.3f')} | "
            f"{_pct(r.get('measured_step_s'), r['step_s']) if ran else ''} |"
        )
    lines.append("")
    lines.append(
        f"a's uplink during the runs: {8 * a_uplink['out'] / wall / 1e6:.1f} Mbit/s out, "
        f"{8 * a_uplink['in'] / wall / 1e6:.1f} Mbit/s in (interface counters over the "
        f"longer run's {wall:.0f} s, start-up included)."
    )
    return "\n".join(lines)


def promises(waited: list[Planned], runs: dict[str, Any]) -> list[dict[str, Any]]:
    """Each waiting job's promise (done so many seconds after its submission) against when
    its run, once placed again, was seen to end."""
    out = []
    for x in waited:
        ended = runs.get(x.name, {}).get("ended_at")
        out.append(
            {
                "name": x.name,
                "reason": x.reason,
                "promised_done_s": x.promised_done_s,
                "done_s": None if ended is None else ended - x.submitted_at,
            }
        )
    return out


def promise_table(kept: list[dict[str, Any]]) -> str:
    """`promises` as a markdown table."""
    lines = [
        "| job | its wait's reason | promised done (s after submission) | done (s) | vs promise |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for p in kept:
        lines.append(
            f"| {p['name']} | {p['reason']} | {_num(p['promised_done_s'], '.0f')} | "
            f"{_num(p['done_s'], '.0f')} | {_pct(p['done_s'], p['promised_done_s'])} |"
        )
    return "\n".join(lines)


def plot(results: dict[str, Any], mbit: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(results["modes"])
    cols = min(2, len(modes))
    rows_n = -(-len(modes) // cols)
    fig, grid = plt.subplots(
        rows_n, cols, figsize=(7 * cols, 4.2 * rows_n), sharey=True, squeeze=False
    )
    axes = list(grid.flat)
    for ax in axes[len(modes) :]:
        ax.set_visible(False)
    for ax, mode in zip(axes, modes, strict=False):
        for i, r in enumerate(x for x in results["modes"][mode]["rows"] if "series" in x):
            color = f"C{i}"
            xs = [p[0] for p in r["series"]]
            ys = [p[1] for p in r["series"]]
            ax.step(xs, ys, where="pre", color=color, label=f"{r['name']} sent")
            if r["reserved_mbps"]:
                ax.axhline(r["reserved_mbps"], color=color, ls="--", lw=1, label="reserved")
            if r["share_mbps"]:
                ax.axhline(r["share_mbps"], color=color, ls=":", lw=1, label="planned share")
        ax.axhline(mbit, color="grey", lw=1)
        jobs = "J1 a+b alone" if mode == "alone" else "J1 a+b and J2 a+c side by side"
        ax.set_title(f"{mode}: a's uplink {mbit:g} Mbit/s, {jobs}")
        ax.set_xlabel("wall time of the run (s)")
        ax.set_ylabel("a-side leader's send rate (Mbit/s, per report)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd")
    d = sub.add_parser("driver")
    d.add_argument("--spec", required=True)
    d.add_argument("--ray-address", required=True)
    ps = sub.add_parser("probe-serve")
    ps.add_argument("--host", required=True)
    pr = sub.add_parser("probe")
    pr.add_argument("--peers", nargs="+", required=True)
    pr.add_argument("--probe-bytes", type=int, required=True)
    pr.add_argument("--rounds", type=int, default=3)
    p.add_argument("--mbit", type=float, default=100.0)
    p.add_argument("--task", default="builtin:wide-mlp")
    p.add_argument("--compression", default="none")
    p.add_argument("--sync", default="local-sgd:4")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument("--calibrate-steps", type=int, default=24)
    p.add_argument("--modes", default="alone,blind,cpn,share")
    p.add_argument("--job-share", type=float, default=0.5, help="wan_job_share of mode share")
    p.add_argument("--name", default="wan-share", help="results file stem in bench/results/")
    a = p.parse_args(argv)
    if a.cmd == "driver":
        driver(a)
        return
    if a.cmd == "probe-serve":
        serve_probe(a)
        return
    if a.cmd == "probe":
        probe_peers(a)
        return

    from testbed import TestbedError, down, parse_dcs, up

    layout = ",".join(f"{dc}:{a.mbit}:{SLOTS}" for dc in TESTBED)
    tmp = Path(tempfile.mkdtemp(prefix="cpn-bench-share-"))
    results: dict[str, Any] = {"args": vars(a), "modes": {}}
    md: list[str] = []
    try:
        try:
            bed = up(parse_dcs(layout, a.mbit, SLOTS))
        except TestbedError as exc:
            sys.exit(f"bench.wan_share: {exc}")
        measured = measure_on(bed)
        results["measured_links"] = measured
        seen = {
            f"{src}->{m['dst']}": m["bandwidth_gbps"] * 1000
            for src, links in measured.items()
            for m in links
        }
        print(f"measured (Mbit/s): {seen}", flush=True)
        efficiency, compute = calibrate_on(bed, a, tmp)
        results["calibration"] = {"efficiency": efficiency, "compute_s_per_step": compute}
        print(f"calibrated: {compute:.4f} s a step, efficiency {efficiency}", flush=True)
        for mode in a.modes.split(","):
            planned, board = plan_all("cpn" if mode == "alone" else mode, a, efficiency, measured)
            if mode == "alone":  # J1 on its own: the model's error without a second job
                planned = planned[:1]
            for x in planned:
                print(
                    f"{mode} {x.name}: {x.placed} {x.compression}/{x.sync} {x.reason}", flush=True
                )
            specs = {x.name: x.train for x in planned if x.train is not None}
            runs = run_side_by_side(bed, specs, tmp)
            got = rows(mode, planned, runs)
            wall = max(runs[k]["wall_s"] for k in specs)
            results["modes"][mode] = {"rows": got, "a_uplink": runs["a_uplink"], "wall_s": wall}
            md.append(table(mode, got, runs["a_uplink"], wall))
            waited = [x for x in planned if x.waits_for and x.name in RUN]
            if waited:  # the runs it waited for ended: placed again, run, its promise weighed
                board.end(*specs)
                board.place(efficiency)
                later = [board.planned(CASE[x.name]) for x in waited]
                for x in later:
                    print(f"{mode} {x.name} then: {x.placed} {x.compression}/{x.sync}", flush=True)
                then = {x.name: x.train for x in later if x.train is not None}
                runs_then = run_side_by_side(bed, then, tmp) if then else {}
                got_then = rows(mode, later, runs_then)
                kept = promises(waited, runs_then)
                results["modes"][mode]["then"] = {"rows": got_then, "promises": kept}
                wall_then = max((runs_then[k]["wall_s"] for k in then), default=0.0)
                md.append(
                    table(mode, got_then, runs_then.get("a_uplink", {"out": 0, "in": 0}),
                          wall_then, then=True)
                    + "\n\n"
                    + promise_table(kept)
                )  # fmt: skip
            board.close()
            print("\n\n".join(md[-2 if waited else -1 :]), flush=True)
    finally:
        down()
    cmd = "sudo .venv/bin/python -m bench.wan_share " + shlex.join(argv or sys.argv[1:])
    regime = (
        f"`{cmd}`, {time.strftime('%Y-%m-%d')}, 2 CPU cores, nothing beside it. {a.task}, "
        f"{a.compression} / {a.sync} for J1 and J2, {a.steps} steps, 1 worker per cluster; "
        f"uplinks {a.mbit:g} Mbit/s (tc tbf, both ways); compute calibrated on the testbed at "
        f"{results['calibration']['compute_s_per_step']:.3f} s a step (two runs side by side). "
        "The testbed's links as cpn's agents measured them on the idle wire (Mbit/s): "
        + ", ".join(
            f"{src}->{m['dst']} {m['bandwidth_gbps'] * 1000:.1f}"
            for src, links in sorted(results["measured_links"].items())
            for m in links
        )
        + f"; declared: {a.mbit:g} between every pair."
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{a.name}.md").write_text(
        "# Two jobs on one shared uplink: reserved, paced, as planned?\n\n"
        + regime
        + "\n\n"
        + "\n\n".join(md)
        + "\n"
    )
    (RESULTS / f"{a.name}.json").write_text(json.dumps(results, indent=1))
    plot(results, a.mbit, RESULTS / f"{a.name}.png")
    print(f"wrote {RESULTS / a.name}.{{md,json,png}}")


if __name__ == "__main__":
    main()
