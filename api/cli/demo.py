"""`cpn demo`: the whole story on the embedded default, with real processes.

A control plane on SQLite with a local Ray, three datacenter clusters with their agents, a
tenant that gets a quote and trains a built-in job across the clusters over an emulated WAN,
a report (placement, compression, accuracy, WAN bytes, cost from the ledger, a plot), then an
agent killed while a second job runs, and the job moving and finishing.
"""

from __future__ import annotations

import secrets
import shutil
import signal
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import typer

from api.cli.errors import FAILED, fail

DEMO_CLUSTERS: dict[str, dict[str, Any]] = {
    "us-east": {"region": "us-east-1", "model": "A100", "memory": 80, "count": 4, "price": 2.40},
    "eu-west": {"region": "eu-west-1", "model": "H100", "memory": 80, "count": 2, "price": 3.90},
    "ap-south": {"region": "ap-south-1", "model": "L4", "memory": 24, "count": 4, "price": 0.70},
}
# The WAN the demo emulates (pinned: on one machine the agents can only measure loopback).
DEMO_LINKS = [
    ("us-east", "eu-west", {"bandwidth_gbps": 0.2, "rtt_ms": 70.0, "egress_price_per_gb": 0.02}),
    ("us-east", "ap-south", {"bandwidth_gbps": 0.1, "rtt_ms": 180.0, "egress_price_per_gb": 0.08}),
    ("eu-west", "ap-south", {"bandwidth_gbps": 0.15, "rtt_ms": 120.0, "egress_price_per_gb": 0.05}),
]
QOS_FACTORS = {"guaranteed": 1.4, "standard": 1.0, "spot": 0.35}


def price_cluster(admin: Any, name: str, spec: dict[str, Any]) -> None:
    """A demo cluster's GPU-hour price for every QoS class: its base price x the class factor."""
    for qos_class, factor in QOS_FACTORS.items():
        admin.post(
            "/v1/pricing/gpu",
            {
                "cluster": name,
                "gpu_model": spec["model"],
                "qos_class": qos_class,
                "price_per_gpu_hour": round(spec["price"] * factor, 4),
            },
        )


def _with_range(total: float, spread: tuple[float, float] | None) -> str:
    """An estimate with where observed runs say it lands: "32.8 (16-66)"."""
    return f"{total:.1f}" + (f" ({spread[0]:.0f}-{spread[1]:.0f})" if spread else "")


def demo_job_spec(name: str, steps: int) -> dict[str, Any]:
    """The demo's training job, as a tenant would submit it (also used by bench/controller.py)."""
    return {
        "name": name,
        "task": "builtin:mnist1d-mlp",
        "gpus": 6,
        "steps": steps,
        "compression": "auto",
        "sync": "auto",
        "qos": {"qos_class": "standard"},
        # Outer averaging without momentum (FedAvg): DiLoCo's Nesterov 0.7/0.9 outer step
        # diverged on this MLP over long runs; the default 0.7/0.5 holds too, and the plain
        # average is what the demo has shown since (bench/results/outer-momentum.md).
        "args": {"outer_lr": 1.0, "outer_momentum": 0.0},
    }


def demo(
    workdir: Path = typer.Option(Path("var/demo"), help="Where the demo keeps its state."),
    steps: int = typer.Option(300, min=20, max=100_000, help="Training steps of each job."),
    timeout: float = typer.Option(600.0, min=30, help="Seconds to wait for each phase."),
) -> None:
    """Run the control plane, three clusters and two training jobs, one surviving a failure."""
    from rich.console import Console

    from api.processes import ProcessError

    console = Console()
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    try:
        _Demo(console, workdir.resolve(), steps, timeout).run()
    except ProcessError as exc:
        raise fail("demo", None, str(exc), FAILED) from None


def since_lost(events: list[dict[str, Any]], lost: str) -> str:
    """The job's states from the one it was in when cluster `lost` went DOWN (its events,
    oldest first): RUNNING on to SUCCEEDED where the others went on without it, through
    RESCHEDULING where the run restarted from a checkpoint."""
    down = next(
        (
            i
            for i, e in enumerate(events)
            if f"cluster {lost} " in (e.get("message") or "") and "DOWN" in e["message"]
        ),
        None,
    )
    states = [(i, e["to_state"]) for i, e in enumerate(events) if e["kind"] == "state"]
    if down is None:  # the event aged out of the page: every state, as they were
        return f"{lost} went DOWN; the job's states: {' -> '.join(s for _, s in states)}"
    before = [s for i, s in states if i < down][-1:]
    after = [s for i, s in states if i >= down]  # the DOWN may be a state change's message
    return (
        f"{lost} went DOWN while the job was {before[0] if before else 'not yet placed'}; "
        f"its states since: {' -> '.join(before + after)}"
    )


class _Demo:
    def __init__(self, console: Any, workdir: Path, steps: int, timeout: float) -> None:
        self.console, self.workdir, self.steps, self.timeout = console, workdir, steps, timeout
        self.agents: dict[str, Any] = {}
        self.tokens: dict[str, str] = {}

    def run(self) -> None:
        from api.client import Client
        from api.processes import start_control_plane

        token = f"cpn_admin_{secrets.token_urlsafe(24)}"
        settings = {
            "CPN_HEARTBEAT_INTERVAL_S": "1",
            "CPN_LEASE_GRACE_S": "4",
            "CPN_PROBE_INTERVAL_S": "5",
            "CPN_PROBE_BYTES": str(1 << 20),
            "CPN_RECONCILE_INTERVAL_S": "0.5",
            "CPN_CHECKPOINT_ROOT": str(self.workdir / "checkpoints"),
        }
        with self.console.status("starting the control plane (SQLite, migrations, cpn serve)..."):
            self.plane = start_control_plane(
                f"sqlite:///{self.workdir / 'cpn.db'}", token, settings=settings
            )
        self.console.print(f"control plane at [bold]{self.plane.url}[/] (SQLite, local Ray)")
        try:
            with Client(self.plane.url, token, timeout=60) as admin:
                self.admin = admin
                self._clusters()
                tenant = admin.post("/v1/tenants", {"name": "acme-research", "budget": 1000})
                self.tenant_id = tenant["id"]
                with Client(
                    self.plane.url,
                    admin.create_api_key("tenant", tenant["id"])["token"],
                    timeout=60,
                ) as tenant_client:
                    self.tenant = tenant_client
                    first = self._first_job()
                    second = self._second_job()
                    self._plot([first, second])
        finally:
            for agent in self.agents.values():
                agent.stop()
            self.plane.proc.stop(timeout=60)
        self.console.print("[green]demo complete[/]: agents, controller and Ray stopped cleanly")

    # ---- phase 1: the compute network -----------------------------------------------------

    def _clusters(self) -> None:
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn

        from api.cli.admin import clusters_table, links_table

        admin = self.admin
        for name, spec in DEMO_CLUSTERS.items():
            admin.create_cluster(name, spec["region"])
            self.tokens[name] = admin.create_api_key("agent", name, f"{name} agent")["token"]
            price_cluster(admin, name, spec)
            self._start_agent(name)
        for a, b, values in DEMO_LINKS:
            admin.declare_link(a, b, pinned=True, **values)
        want = len(DEMO_CLUSTERS) * (len(DEMO_CLUSTERS) - 1)
        columns = (
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
        )
        with Progress(*columns, console=self.console, transient=True) as progress:
            ready = progress.add_task("clusters READY", total=len(DEMO_CLUSTERS))
            measured = progress.add_task("links measured by the agents", total=want)
            self._wait(lambda: self._counts(progress, ready, measured, want), "clusters READY")
        self.console.print(clusters_table(admin.clusters()))
        self.console.print(links_table(admin.links("all")))
        self.console.print(
            "[dim]On one machine the agents measure loopback; the pinned declared links are the "
            "WAN the training emulates.[/]"
        )

    def _counts(self, progress: Any, ready: Any, measured: Any, want: int) -> bool:
        n_ready = sum(c["state"] == "READY" and c["gpus"] != [] for c in self.admin.clusters())
        n_links = len(self.admin.links("measured"))
        progress.update(ready, completed=n_ready)
        progress.update(measured, completed=min(n_links, want))
        return n_ready == len(DEMO_CLUSTERS) and n_links >= want

    def _start_agent(self, name: str) -> None:
        from api.processes import start_agent, write_inventory

        spec = DEMO_CLUSTERS[name]
        inventory = write_inventory(
            self.workdir / f"{name}-gpus.yaml",
            [{"model": spec["model"], "memory_gib": spec["memory"], "count": spec["count"]}],
        )
        self.agents[name] = start_agent(name, self.plane.url, self.tokens[name], inventory)

    # ---- phase 2: quote, submit, train --------------------------------------------------

    def _first_job(self) -> dict[str, Any]:
        from rich.table import Table

        quote = self.tenant.quote(demo_job_spec("mnist1d-mlp", self.steps))
        table = Table(title=f"Quote {quote.id[:8]} (valid until {quote.expires_at:%H:%M:%S} UTC)")
        for col in (
            "option",
            "placement",
            "compression",
            "sync",
            "est. time s (range)",
            "WAN MB",
            "price $",
        ):
            table.add_column(col)
        for o in quote.options:
            table.add_row(
                o.objective or "",
                ", ".join(f"{p.cluster}:{p.gpus}" for p in o.clusters),
                o.compression,
                o.sync,
                _with_range(o.estimate.total_time_s, o.estimate.total_time_range_s),
                f"{o.estimate.wan_bytes / 1e6:.1f}",
                f"{o.price.total:.4f}" if o.price else "",
            )
        self.console.print(table)
        job = self.tenant.submit(
            {
                **demo_job_spec("mnist1d-mlp", self.steps),
                "quote_id": quote.id,
                "quote_option": "time",
            }
        )
        self.console.print(f"submitted job [bold]{job.id[:8]}[/] with the quote's price held")
        done = self._follow(job.id, "job 1", self.steps)
        self._report(done)
        return done

    # ---- phase 3: a cluster fails mid-job ---------------------------------------------------

    def _second_job(self) -> dict[str, Any]:
        steps = self.steps * 6  # long enough to outlive the dead agent's lease
        job = self.tenant.submit(demo_job_spec("mnist1d-mlp-2", steps))
        self.console.print(f"submitted job [bold]{job.id[:8]}[/]; an agent dies while it trains")
        running = self._wait(
            lambda: (
                (j := self.tenant.job(job.id)).state == "RUNNING"
                and any(m.step >= self.steps // 5 for m in self.tenant.metrics(job.id))
                and j
            ),
            "job 2 to make progress",
        )
        assert running.placement is not None  # RUNNING: placed
        victim = running.placement.clusters[0].cluster
        self.agents[victim].kill(signal.SIGKILL)
        self.console.print(f"[red]SIGKILL[/] the agent of [bold]{victim}[/]: its lease will expire")
        done = self._follow(job.id, "job 2", steps)
        self._report(done, lost=victim)
        return done

    def _follow(self, job_id: str, label: str, steps: int) -> dict[str, Any]:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("step {task.completed}/{task.total}"),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
        )
        seen_events = 0
        with Progress(*columns, console=self.console) as progress:
            bar = progress.add_task(label, total=steps, info="PENDING")
            deadline = time.monotonic() + self.timeout
            while time.monotonic() < deadline:
                job = self.tenant.job(job_id)
                events = self.tenant.get(f"/v1/jobs/{job_id}/events", limit=500, offset=seen_events)
                for e in events["items"]:
                    if e["kind"] == "progress":
                        d = e["data"]
                        acc = d.get("accuracy")
                        info = f"loss {d['loss']:.3f}" + (
                            f" acc {acc:.3f}" if acc is not None else ""
                        )
                        progress.update(bar, completed=d["step"], info=info)
                    elif e["kind"] in ("state", "error") or "checkpoint" in e["message"]:
                        progress.console.print(
                            f"  {e['at'][11:19]} {e['to_state'] or e['kind']}: {e['message']}"
                        )
                seen_events += len(events["items"])
                if job.state in ("SUCCEEDED", "FAILED", "CANCELLED"):
                    progress.update(bar, info=job.state)
                    return job.model_dump(mode="json")
                time.sleep(0.5)
        raise TimeoutError(f"{label} did not finish within {self.timeout:g}s")

    def _report(self, job: dict[str, Any], lost: str | None = None) -> None:
        from datetime import datetime

        from rich.table import Table

        from controller.values.tasks import builtin_work

        report: dict[str, Any] = next(
            (
                e["data"].get("report", {})
                for e in self.tenant.get(f"/v1/jobs/{job['id']}/events", limit=500)["items"]
                if e["to_state"] == "SUCCEEDED"
            ),
            {},
        )
        ledger = self.tenant.ledger(self.tenant_id)
        lines = [e for e in ledger["items"] if e["job_id"] == job["id"]]
        cost = sum((Decimal(e["amount"]) for e in lines), Decimal(0))
        credit = -sum((Decimal(e["amount"]) for e in lines if e["kind"] == "credit"), Decimal(0))
        sent = int(report.get("wan_bytes_total", 0))
        # Plain synchronous DP: every step, each of the D cluster leaders sends its fp32
        # gradient to the D-1 others (the same all-gather exchange, uncompressed).
        d = len(job["placement"]["clusters"])
        params = builtin_work(job["spec"]["task"]).params
        uncompressed = params * 4 * d * (d - 1) * int(job["spec"]["steps"])
        elapsed = (
            datetime.fromisoformat(job["finished_at"]) - datetime.fromisoformat(job["created_at"])
        ).total_seconds()
        placement = ", ".join(
            f"{c['cluster']}:{c['gpus']}x{c['gpu_model']}" for c in job["placement"]["clusters"]
        )
        ended_on = {c["cluster"]: c["gpus"] for c in job["placement"]["clusters"]}
        for m in report.get("membership") or []:  # a fault domain's changes, in order
            if m["change"] == "left":
                ended_on.pop(m["cluster"], None)
            elif m["change"] == "joined":
                ended_on[m["cluster"]] = m["workers"]
        if report.get("membership"):
            placement += " (it ended on " + ", ".join(f"{c}:{n}" for c, n in ended_on.items()) + ")"
        table = Table(title=f"Job {job['id'][:8]}: {job['state']}", show_header=False)
        table.add_column(style="bold")
        table.add_column()
        rows = [
            ("placement (final)", placement),
            ("compression / sync", f"{report.get('compression', '?')} / {report.get('sync', '?')}"),
            ("final accuracy", _measured(report.get("final_accuracy"))),
            ("final eval loss", _measured(report.get("final_eval_loss"))),
            (
                "submit to finish",
                f"{elapsed:.1f} s (training {report.get('wall_s', 0):.1f} s, "
                f"WAN emulated: {report.get('wan_emulated')})",
            ),
            ("WAN bytes sent", f"{sent / 1e6:.2f} MB"),
            (
                "uncompressed DP would send",
                f"{uncompressed / 1e6:.2f} MB ({uncompressed / max(sent, 1):.1f}x more)",
            ),
        ]
        # quote beside bill: what the plan promised, what the run took and was charged
        promised = job.get("held_price") or job["placement"]
        est = promised["estimate"]
        price = (promised.get("price") or {}).get("total", est.get("cost"))
        ran = (
            datetime.fromisoformat(job["finished_at"]) - datetime.fromisoformat(job["started_at"])
        ).total_seconds()
        rows += [
            (
                "quoted (held)" if job.get("held_price") else "planned",
                f"{est['total_time_s']:.1f} s, ${price:.6f} (quality cost "
                f"{est.get('quality_cost', 0.0):.0%})",
            ),
            (
                "ran / billed (ledger)",
                f"{ran:.1f} s, ${cost:.6f}"
                + (f" (platform credit ${credit:.6f}: the held price)" if credit else ""),
            ),
        ]
        if report.get("warning"):
            rows.append(("warning", str(report["warning"])))
        art = report.get("artefact") or {}
        if art.get("which") == "best":
            rows.append(
                (
                    "model kept",
                    f"its best evaluation's (step {art['step']}, accuracy "
                    f"{art['accuracy']:.3f}): {art['where']}",
                )
            )
        why = next((w for w in promised.get("explanation", ()) if w.startswith("quality:")), None)
        if why:
            rows.append(("why this sync", why.removeprefix("quality: ")))
        if lost:
            events = self.tenant.get(f"/v1/jobs/{job['id']}/events", limit=500)["items"]
            rows.append(("lost cluster", since_lost(events, lost)))
            changes = report.get("membership") or []
            if changes:  # a fault domain: the others went on without it
                rows.append(
                    (
                        "fault domain",
                        "; ".join(
                            f"{m['cluster']} {m['change']} at step {m['step']} ({m['why']})"
                            for m in changes
                        )
                        + "; the other clusters went on, no checkpoint read",
                    )
                )
            else:
                rows.append(("resumed from step", str(report.get("resumed_from_step"))))
        for k, v in rows:
            table.add_row(k, v)
        self.console.print(table)

    def _plot(self, jobs: list[dict[str, Any]]) -> None:
        import matplotlib

        matplotlib.use("Agg")

        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4.5))
        for i, job in enumerate(jobs, 1):
            events = self.tenant.get(f"/v1/jobs/{job['id']}/events", limit=500)["items"]
            points = [
                (e["data"]["step"], e["data"]["accuracy"])
                for e in events
                if e["kind"] == "progress" and e["data"].get("accuracy") is not None
            ]
            if points:
                ax.plot(*zip(*points, strict=True), marker=".", label=f"job {i} ({job['id'][:8]})")
            for e in events:
                if e["to_state"] == "RESCHEDULING":
                    step = e["data"].get("step") or 0
                    ax.axvline(
                        step,
                        color="red",
                        linestyle="--",
                        label=f"job {i}: {e['message'].split(';')[0]}",
                    )
        ax.set_xlabel("training step (a resumed run repeats the steps since its checkpoint)")
        ax.set_ylabel("evaluation accuracy")
        ax.set_title("cpn demo: MNIST-1D across three datacenters (emulated WAN)")
        ax.grid(alpha=0.3)
        ax.legend()
        out = self.workdir / "demo.png"
        fig.tight_layout()
        fig.savefig(out, dpi=120)
        plt.close(fig)
        self.console.print(f"plot saved to [bold]{out}[/]")

    def _wait(self, predicate: Any, what: str) -> Any:
        from api.processes import ProcessError, wait_until

        try:
            return wait_until(predicate, self.timeout, what, every=0.3)
        except TimeoutError:
            tails = "\n".join(a.tail(5) for a in self.agents.values())
            raise ProcessError(
                f"timed out waiting for {what}:\n{tails}\n{self.plane.proc.tail(10)}"
            ) from None


def register(app: typer.Typer) -> None:
    """Attach `cpn demo`."""
    app.command("demo")(demo)


def _measured(value: object) -> str:
    """A report's accuracy or loss: a run that never evaluated stores none (JSON has no NaN)."""
    return f"{value:.4f}" if isinstance(value, int | float) else "not evaluated"
