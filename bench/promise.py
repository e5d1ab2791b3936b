"""Is the plan what runs, and are its promises kept? (issue 47)

A fixed set of varied jobs goes through the real control plane: `cpn serve` on SQLite with
its local Ray, the demo's three clusters with real `cpn agent` processes, prices and pinned
(emulated) WAN links. Small and WAN-bound tasks, one to three clusters, every data-parallel
mode family, a pipeline, held and unheld quotes, one at a time. Per job it prints what was
planned against what ran (compression, sync, the ring's links, from the worker's report),
estimated against actual run time (RUNNING to SUCCEEDED), WAN bytes and cost (the ledger),
and final and best accuracy against the same task trained every step on one cluster with
the same workers and steps (run after the control plane stops, on the same local Ray).

Goals (a benchmark, not tests): decisions equal on every job; wall-time error median <= 15 %
and p90 <= 35 %; WAN bytes error <= 10 %; the WAN share of wall time the plan predicts
within 5 points of the run's; no held quote exceeded; no job more than 2 points below its
single-cluster reference unless its plan said so.

Run: `.venv/bin/python -m bench.promise [--only N,M] [--no-save]`; writes
bench/results/promise.md, promise.json and promise.png. Two cores: run nothing beside it.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
# the demo's (docs/concepts/training.md: DiLoCo on this MLP)
OUTER = {"outer_lr": 1.0, "outer_momentum": 0.0}


@dataclass(frozen=True)
class Case:
    """One job of the set: its spec (as a tenant submits it) and whether a quote is held."""

    name: str
    spec: dict[str, Any]
    held: str | None = None  # the quote option held, or None: submitted without a quote


def _job(name: str, task: str, gpus: int, steps: int, **kw: Any) -> dict[str, Any]:
    args = kw.pop("args", {})
    return {
        "name": name,
        "task": f"builtin:{task}",
        "gpus": gpus,
        "steps": steps,
        "compression": kw.pop("compression", "auto"),
        "sync": kw.pop("sync", "auto"),
        "qos": {"qos_class": "standard", **kw.pop("qos", {})},
        "args": {**OUTER, **args},
        **kw,
    }


CASES: tuple[Case, ...] = (
    Case("demo", _job("demo", "mnist1d-mlp", 6, 300), held="time"),
    Case("one-cluster", _job("one", "mnist1d-mlp", 2, 300), held="time"),
    Case("every-step", _job("es", "mnist1d-mlp", 6, 300, compression="none", sync="every-step")),
    Case("local-sgd", _job("lsgd", "mnist1d-mlp", 6, 300, sync="local-sgd:8"), held="time"),
    Case("stale", _job("stale", "mnist1d-mlp", 6, 300, compression="int8", sync="stale:1")),
    Case("partial", _job("partial", "mnist1d-mlp", 8, 300, sync="partial:16"), held="time"),
    Case("async-ps", _job("aps", "mnist1d-mlp", 8, 300, sync="async-ps:4")),
    Case("gossip", _job("gossip", "mnist1d-mlp", 10, 300, sync="gossip:8")),
    Case("cnn-auto", _job("cnn", "mnist1d-cnn", 6, 300), held="time"),
    Case("cnn-cost", _job("cnnc", "mnist1d-cnn", 4, 300), held="cost"),
    Case("three-dc", _job("three", "mnist1d-mlp", 10, 300), held="time"),
    Case(
        "pipeline",
        _job("pipe", "char-transformer", 2, 40, parallelism="pipeline", args={}),
        held="time",
    ),
)


@dataclass(frozen=True)
class Row:
    """One job: what was planned and promised, what ran and was charged."""

    case: str
    clusters: str
    planned: str
    ran: str
    decisions_equal: bool
    est_s: float
    actual_s: float
    est_wan_mb: float
    actual_wan_mb: float
    est_cost: float
    billed: float
    held: bool
    credit: float
    quality_cost: float
    final_acc: float | None
    best_acc: float | None
    reference_acc: float | None = None
    warning: str = ""
    est_wan_share: float | None = None
    """The share of the run's wall time its steps wait on the WAN, as the plan has it: the
    step's time beyond compute, the intra-cluster reduce and the fitted step overhead, times
    the steps, over the estimated run time. None: one cluster, or a pipeline."""
    wan_share: float | None = None
    """The same, as it ran: rank 0's exchange waits less its intra-cluster reduces (the
    report's `comm_s - intra_s`) over the run time."""
    est_setup_s: float | None = None
    """Of `est_s`, the seconds outside the steps (the fitted set-up, or its prior)."""
    setup_s: float | None = None
    """Of `actual_s`, the seconds before the first step (the run's time less the driver's
    `wall_s`, which starts at the first step)."""

    @property
    def wan_share_error(self) -> float | None:
        """Points between the plan's WAN share and the run's."""
        if self.est_wan_share is None or self.wan_share is None:
            return None
        return abs(self.wan_share - self.est_wan_share)

    @property
    def time_error(self) -> float:
        return abs(self.actual_s - self.est_s) / self.actual_s if self.actual_s else 0.0

    @property
    def wan_error(self) -> float | None:
        if self.actual_wan_mb <= 0 and self.est_wan_mb <= 0:
            return None
        return abs(self.actual_wan_mb - self.est_wan_mb) / max(self.actual_wan_mb, 1e-9)


def ring_edges(ring: list[str]) -> set[tuple[str, str]]:
    """The directed links a ring of clusters sends over, both ways (a ring all-reduce)."""
    if len(ring) < 2:
        return set()
    pairs = set(zip(ring, [*ring[1:], ring[0]], strict=True))
    return pairs | {(b, a) for a, b in pairs}


def compare(
    case: str, job: dict[str, Any], report: dict[str, Any], ledger: list[dict[str, Any]]
) -> Row:
    """Planned against executed, promised against charged, for one finished job (pure)."""
    plan = job["held_price"] or job["placement"]
    est = plan["estimate"]
    ring = list(est.get("ring") or [])
    tree = dict(est.get("tree") or {})
    sent = {tuple(k.split("->")): n for k, n in (report.get("wan_bytes") or {}).items() if n > 0}
    planned = f"{plan['compression']} / {plan['sync']}"
    ran = f"{report.get('compression')} / {report.get('sync')}"
    mode = (plan.get("parallel") or {}).get("mode", "data")
    # the exchange's links: the tree's both ways, or the ring's (the start-up's digests go
    # round gloo's ring whatever the plan: counted apart, `wan_setup_bytes`)
    edges = {e for c, p in tree.items() for e in ((c, p), (p, c))} if tree else ring_edges(ring)
    off = sum(n for e, n in sent.items() if e not in edges)
    same_ring = mode != "data" or len(ring) < 2 or off <= int(report.get("wan_setup_bytes") or 0)
    same = same_ring and (mode != "data" or planned == ran)
    started = datetime.fromisoformat(job["started_at"])
    finished = datetime.fromisoformat(job["finished_at"])
    billed = sum((Decimal(e["amount"]) for e in ledger), Decimal(0))
    credit = -sum((Decimal(e["amount"]) for e in ledger if e["kind"] == "credit"), Decimal(0))
    price = (plan.get("price") or {}).get("total", est.get("cost") or 0.0)
    best = report.get("best_accuracy")
    actual_s = (finished - started).total_seconds()
    est_share = share = None
    if mode == "data" and len(plan["clusters"]) > 1 and est.get("compute_s") is not None:
        local = float(est["compute_s"]) + float(est.get("intra_s") or 0.0)
        waited = float(est["step_time_s"]) - local - float(est.get("step_overhead_s") or 0.0)
        steps = int(report.get("steps") or 0)
        est_share = max(0.0, waited) * steps / float(est["total_time_s"])
        if actual_s > 0 and report.get("wan_wait_s") is not None:
            # the rank that arrived last at the exchanges: the links' time, not a wait for
            # another cluster's compute (which the plan counts in the pace, not the WAN)
            share = float(report["wan_wait_s"]) / actual_s
        elif actual_s > 0 and "intra_s" in report:
            exposed = float(report.get("comm_s") or 0.0) - float(report["intra_s"])
            share = max(0.0, exposed) / actual_s
    return Row(
        case=case,
        clusters=", ".join(f"{c['cluster']}:{c['gpus']}" for c in plan["clusters"]),
        planned=planned if mode == "data" else f"{mode} ({planned})",
        ran=ran if mode == "data" else f"{mode} ({ran})",
        decisions_equal=same,
        est_s=float(est["total_time_s"]),
        actual_s=actual_s,
        est_wan_mb=float(est["wan_bytes"]) / 1e6,
        actual_wan_mb=sum((report.get("wan_bytes") or {}).values()) / 1e6,
        est_cost=float(price),
        billed=float(billed),
        held=job["held_price"] is not None,
        credit=float(credit),
        quality_cost=float(est.get("quality_cost") or 0.0),
        final_acc=report.get("final_accuracy"),
        best_acc=best if isinstance(best, float) else None,
        warning=str(report.get("warning") or ""),
        est_wan_share=est_share,
        wan_share=share,
        est_setup_s=float(est["setup_s"]) if est.get("setup_s") is not None else None,
        setup_s=actual_s - float(report["wall_s"]) if report.get("wall_s") else None,
    )


def summary(rows: list[Row]) -> dict[str, Any]:
    """The goals, measured."""
    errors = sorted(r.time_error for r in rows)
    wan = [e for e in (r.wan_error for r in rows) if e is not None]
    shares = [e for e in (r.wan_share_error for r in rows) if e is not None]
    p90 = errors[min(len(errors) - 1, int(0.9 * len(errors)))] if errors else 0.0
    below = [
        r.case
        for r in rows
        if r.reference_acc is not None
        and r.final_acc is not None
        and r.final_acc < r.reference_acc - 0.02
        and r.quality_cost <= 0.0
    ]
    return {
        "jobs": len(rows),
        "decisions_equal": sum(r.decisions_equal for r in rows),
        "time_error_median": statistics.median(errors) if errors else 0.0,
        "time_error_p90": p90,
        "wan_error_max": max(wan) if wan else 0.0,
        "wan_share_error_max": max(shares) if shares else 0.0,
        "wan_share_within_5_points": sum(e <= 0.05 for e in shares),
        "wan_share_jobs": len(shares),
        "held_exceeded": sum(r.held and r.billed > r.est_cost + 1e-6 for r in rows),
        "credits": sum(r.credit > 0 for r in rows),
        "below_reference_unannounced": below,
    }


# ---- the run ----------------------------------------------------------------------------


class _Network:
    """The demo's network on a real control plane (SQLite, local Ray)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.agents: dict[str, Any] = {}

    def __enter__(self) -> _Network:
        from api.cli.demo import DEMO_CLUSTERS, DEMO_LINKS, price_cluster
        from api.client import Client
        from api.processes import start_agent, start_control_plane, write_inventory

        token = f"cpn_admin_{secrets.token_urlsafe(24)}"
        settings = {
            "CPN_HEARTBEAT_INTERVAL_S": "1",
            "CPN_LEASE_GRACE_S": "30",
            "CPN_PROBE_INTERVAL_S": "3600",
            "CPN_RECONCILE_INTERVAL_S": "0.5",
            "CPN_CHECKPOINT_ROOT": str(self.workdir / "checkpoints"),
        }
        self.plane = start_control_plane(
            f"sqlite:///{self.workdir / 'cpn.db'}", token, settings=settings
        )
        self.admin = Client(self.plane.url, token, timeout=60)
        for name, spec in DEMO_CLUSTERS.items():
            self.admin.create_cluster(name, spec["region"])
            key = self.admin.create_api_key("agent", name, f"{name} agent")["token"]
            price_cluster(self.admin, name, spec)
            inventory = write_inventory(
                self.workdir / f"{name}-gpus.yaml",
                [{"model": spec["model"], "memory_gib": spec["memory"], "count": spec["count"]}],
            )
            self.agents[name] = start_agent(name, self.plane.url, key, inventory)
        for a, b, values in DEMO_LINKS:
            self.admin.declare_link(a, b, pinned=True, **values)
        tenant = self.admin.post("/v1/tenants", {"name": "bench", "budget": 1000})
        self.tenant_id = tenant["id"]
        key = self.admin.create_api_key("tenant", tenant["id"])["token"]
        self.tenant = Client(self.plane.url, key, timeout=60)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            ready = [c for c in self.admin.clusters() if c["state"] == "READY" and c["gpus"]]
            if len(ready) == len(DEMO_CLUSTERS):
                return self
            time.sleep(0.5)
        raise RuntimeError("clusters did not become READY in 120 s")

    def __exit__(self, *exc: object) -> None:
        for agent in self.agents.values():
            agent.stop()
        self.tenant.close()
        self.admin.close()
        self.plane.proc.stop(timeout=60)

    def run(self, case: Case, timeout_s: float = 900) -> tuple[dict[str, Any], dict[str, Any]]:
        """Submit `case` (with its quote held, if it says so) and wait for it to end."""
        spec = dict(case.spec)
        if case.held is not None:
            quote = self.tenant.quote(spec)
            spec = {**spec, "quote_id": quote.id, "quote_option": case.held}
        job = self.tenant.submit(spec)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = self.tenant.job(job.id)
            if got.state in ("SUCCEEDED", "FAILED", "CANCELLED"):
                break
            time.sleep(1.0)
        else:
            raise RuntimeError(f"{case.name}: not done in {timeout_s:.0f} s")
        events = self.tenant.get(f"/v1/jobs/{job.id}/events", limit=500)["items"]
        report: dict[str, Any] = next(
            (e["data"].get("report", {}) for e in events if e["to_state"] == "SUCCEEDED"), {}
        )
        return got.model_dump(mode="json"), report

    def ledger(self, job_id: str) -> list[dict[str, Any]]:
        items = self.tenant.ledger(self.tenant_id)["items"]
        return [e for e in items if e["job_id"] == job_id]


def reference(task: str, workers: int, steps: int, data_args: dict[str, Any]) -> float:
    """Final accuracy of `task` trained every step, uncompressed, on one cluster."""
    import training
    from training import TrainSpec

    report = training.run(
        TrainSpec(
            task=task,
            clusters={"ref": workers},
            steps=steps,
            compression="none",
            sync="every-step",
            **data_args,
        )
    )
    return float(report.final_accuracy)


def _table(rows: list[Row]) -> list[str]:
    head = (
        "| job | placement | planned | ran | equal | est s | actual s | err | est set-up s | "
        "set-up s | est WAN MB | "
        "WAN MB | est $ | billed $ | credit $ | quality cost | final acc | best acc | "
        "1-cluster every-step | est WAN share | WAN share | warning |"
    )
    out = [head, "|" + "---|" * 22]
    for r in rows:

        def acc(x: float | None) -> str:
            return f"{x:.3f}" if x is not None else "-"

        def pct(x: float | None) -> str:
            return f"{x:.0%}" if x is not None else "-"

        def num(x: float | None) -> str:
            return f"{x:.1f}" if x is not None else "-"

        out.append(
            f"| {r.case} | {r.clusters} | {r.planned} | {r.ran} | "
            f"{'yes' if r.decisions_equal else 'NO'} | {r.est_s:.1f} | {r.actual_s:.1f} | "
            f"{r.time_error:.0%} | {num(r.est_setup_s)} | {num(r.setup_s)} | "
            f"{r.est_wan_mb:.2f} | {r.actual_wan_mb:.2f} | "
            f"{r.est_cost:.4f}{' (held)' if r.held else ''} | {r.billed:.4f} | "
            f"{r.credit:.4f} | {r.quality_cost:.0%} | {acc(r.final_acc)} | {acc(r.best_acc)} | "
            f"{acc(r.reference_acc)} | {pct(r.est_wan_share)} | {pct(r.wan_share)} | "
            f"{'diverged' if r.warning else ''} |"
        )
    return out


def _plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5))
    xs = [r.est_s for r in rows]
    ys = [r.actual_s for r in rows]
    ax.scatter(xs, ys)
    for r in rows:
        ax.annotate(r.case, (r.est_s, r.actual_s), fontsize=7)
    top = max([*xs, *ys, 1.0]) * 1.1
    ax.plot([0, top], [0, top], "k--", linewidth=0.8, label="estimate = actual")
    ax.plot([0, top], [0, top * 1.15], ":", linewidth=0.8, label="+15 %")
    ax.plot([0, top], [0, top * 0.85], ":", linewidth=0.8, label="-15 %")
    ax.set_xlabel("estimated run time (s)")
    ax.set_ylabel("actual run time, RUNNING to SUCCEEDED (s)")
    ax.set_title("cpn: estimate against actual (bench.promise)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated case names")
    parser.add_argument("--no-save", action="store_true", help="print only")
    args = parser.parse_args(argv)
    wanted = {n for n in args.only.split(",") if n}
    cases = [c for c in CASES if not wanted or c.name in wanted]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="cpn-promise-") as tmp, _Network(Path(tmp)) as net:
        for case in cases:
            t0 = time.monotonic()
            job, report = net.run(case)
            if job["state"] != "SUCCEEDED":
                print(f"{case.name}: {job['state']}: {job['reason']}", flush=True)
                continue
            row = compare(case.name, job, report, net.ledger(job["id"]))
            rows.append(row)
            print(
                f"{case.name}: {row.planned} -> {row.ran}, est {row.est_s:.1f} s, actual "
                f"{row.actual_s:.1f} s, billed ${row.billed:.4f} of ${row.est_cost:.4f}, acc "
                f"{row.final_acc} ({time.monotonic() - t0:.0f} s)",
                flush=True,
            )
    refs: dict[tuple[str, int, int], float] = {}
    for i, (case, row) in enumerate(zip(cases, rows, strict=False)):
        if case.spec.get("parallelism") == "pipeline":
            continue
        key = (case.spec["task"], case.spec["gpus"], case.spec["steps"])
        if key not in refs:
            refs[key] = reference(*key, {})
        rows[i] = Row(**{**asdict(row), "reference_acc": refs[key]})
    lines = _table(rows)
    goals = summary(rows)
    print("\n".join(lines))
    print(json.dumps(goals, indent=2))
    if args.no_save:
        return
    RESULTS.mkdir(exist_ok=True)
    cmd = "`.venv/bin/python -m bench.promise`"
    md = [
        "# The plan is the run: planned against executed, promised against charged",
        "",
        f"{cmd}, {datetime.now():%Y-%m-%d}, on 2 CPU cores, nothing beside it. The demo's "
        "network (us-east 4 A100, eu-west 2 H100, ap-south 4 L4, emulated links 100-200 "
        "Mbit/s, 70-180 ms RTT) on a real `cpn serve` (SQLite, local Ray); the GPUs are CPU "
        "worker slots, so the calibration learns this machine's speed as jobs finish (the "
        "first job plans on the priors). Actual time: RUNNING to SUCCEEDED (what is billed). "
        "Reference: the same task, workers and steps, every step, uncompressed, one cluster.",
        "",
        *lines,
        "",
        "Goals: " + json.dumps(goals),
    ]
    (RESULTS / "promise.md").write_text("\n".join(md) + "\n")
    (RESULTS / "promise.json").write_text(
        json.dumps({"rows": [asdict(r) for r in rows], "goals": goals}, indent=2) + "\n"
    )
    _plot(rows, RESULTS / "promise.png")


if __name__ == "__main__":
    main()
