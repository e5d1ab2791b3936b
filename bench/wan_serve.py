"""The demo's job through the control plane on the namespace WAN testbed (package `testbed`).

A `cpn serve` in the testbed's hub namespace whose Ray is the testbed's cluster; one `cpn agent`
per datacenter inside its namespace, measuring the real shaped links to its peers (nothing
declared, nothing pinned); the demo's job submitted by a tenant, placed by the scheduler on
what the agents measured, trained by the launcher across the namespaces (no emulation: the
links are real). Then the scheduler's estimate of a step against the observed step, in parts,
and the same job again after the controller has fed the first run's observations to its
calibration.

    python -m bench.wan_serve              # as root: prints tables, writes bench/results/

Results: bench/results/wan-serve.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from api.processes import wait_until

RESULTS = Path(__file__).parent / "results"
# NAME:MBIT:GPUS, the demo's three clusters on uplinks of different speeds
DEFAULT_DCS = "us-east:200:4,eu-west:100:2,ap-south:50:4"
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


def shaped_mbit(dcs: list[dict[str, Any]], src: str, dst: str) -> float:
    """A pair's path on the testbed: the source's uplink, then the destination's downlink."""
    rate = {d["name"]: float(d["mbit"]) for d in dcs}
    return min(rate[src], rate[dst])


# ----------------------------------------------------------------------------- in the hub


def last_calibration(lines: list[str]) -> str:
    """The controller's latest fit of efficiency (it logs each), for the report."""
    fits = [
        line.split("calibrated efficiency: ", 1)[1] for line in lines if "calibrated eff" in line
    ]
    return fits[-1] if fits else "none yet"


def drive(a: argparse.Namespace) -> None:
    """Runs inside the hub namespace: control plane, agents, jobs; writes a JSON report."""
    from api.cli.demo import DEMO_CLUSTERS, demo_job_spec, price_cluster
    from api.client import Client
    from api.processes import Proc, start_agent, start_control_plane, write_inventory
    from testbed import load
    from testbed.layout import HUB_IP

    bed = load()
    if bed is None:
        sys.exit("bench.wan_serve: no testbed is up")
    work = Path(tempfile.mkdtemp(prefix="cpn-wan-serve-"))
    token = f"cpn_admin_{secrets.token_urlsafe(24)}"
    settings = {
        "CPN_HEARTBEAT_INTERVAL_S": "1",
        "CPN_LEASE_GRACE_S": "10",
        "CPN_PROBE_INTERVAL_S": str(a.probe_interval),
        "CPN_PROBE_BYTES": str(4 << 20),
        "CPN_RECONCILE_INTERVAL_S": "0.5",
        "CPN_CHECKPOINT_ROOT": str(work / "checkpoints"),
        "CPN_LINK_DISCOVERY": "true",  # the agents find the testbed's links: none is declared
    }  # CPN_RAY_ADDRESS and CPN_GLOO_IFNAME come from the testbed's environment
    plane = start_control_plane(
        f"sqlite:///{work / 'cpn.db'}", token, settings=settings, host=HUB_IP
    )
    agents: list[Proc] = []
    out: dict[str, Any] = {"datacenters": bed.datacenters, "jobs": []}
    try:
        with Client(plane.url, token, timeout=60) as admin:
            for dc in bed.datacenters:
                name = dc["name"]
                spec = DEMO_CLUSTERS.get(name, DEMO_CLUSTERS["us-east"])
                admin.create_cluster(name, spec["region"])
                key = admin.create_api_key("agent", name, f"{name} agent")["token"]
                price_cluster(admin, name, spec)
                gpus = [{"model": spec["model"], "memory_gib": spec["memory"]}]
                inventory = write_inventory(
                    work / f"{name}.yaml", [{**gpus[0], "count": dc["workers"]}]
                )
                agents.append(
                    start_agent(
                        name,
                        plane.url,
                        key,
                        inventory,
                        probe_host=dc["ip"],
                        prefix=["ip", "netns", "exec", dc["netns"]],
                    )
                )
            n = len(bed.datacenters)
            print(f"control plane {plane.url}; {n} agents measuring the shaped links", flush=True)

            def links_measured() -> list[Any] | None:
                ready = sum(c["state"] == "READY" and c["gpus"] != [] for c in admin.clusters())
                links = admin.links("measured")
                return links if ready == n and len(links) >= n * (n - 1) else None

            first = {
                (x["src"], x["dst"]): x["measured_at"]
                for x in wait_until(
                    links_measured, a.timeout, "clusters READY and links measured", every=0.5
                )
            }
            # a second round of probes: a pair first measured while another agent's probe
            # shared its uplink has now been measured again
            wait_until(
                lambda: all(
                    x["measured_at"] != first.get((x["src"], x["dst"]))
                    for x in admin.links("measured")
                ),
                a.timeout,
                "a second round of link probes",
                every=0.5,
            )
            out["links"] = [
                {
                    "src": x["src"],
                    "dst": x["dst"],
                    "measured_mbit": x["bandwidth_gbps"] * 1000,
                    "rtt_ms": x["rtt_ms"],
                    "shaped_mbit": shaped_mbit(bed.datacenters, x["src"], x["dst"]),
                }
                for x in admin.links("measured")
            ]
            print(links_table(out["links"]), flush=True)
            tenant = admin.post("/v1/tenants", {"name": "wan-serve", "budget": 1000})
            with Client(
                plane.url, admin.create_api_key("tenant", tenant["id"])["token"], timeout=60
            ) as client:
                for n in range(1, a.jobs + 1):
                    # the controller refits its efficiency from each run's step observations
                    # on its next pass, before it places the next job
                    out["jobs"].append(run_job(client, bed, demo_job_spec, n, a))
                    out["jobs"][-1]["calibration"] = last_calibration(plane.proc.lines)
                    print(jobs_table(out["jobs"][-1:]), flush=True)
    finally:
        for agent in agents:
            agent.stop()
        plane.proc.stop(timeout=60)
    Path(a.out).write_text(json.dumps(out))


def run_job(
    client: Any, bed: Any, job_spec: Callable[[str, int], dict[str, Any]], n: int, a: Any
) -> dict[str, Any]:
    """Submit the demo job, follow it to the end, and compare estimate with observation."""
    before = bed.uplink_bytes()
    spec = job_spec(f"wan-serve-{n}", a.steps)
    job = client.submit({**spec, "gpus": a.gpus or spec["gpus"]}).model_dump(mode="json")
    done = wait_until(
        lambda: (j := client.job(job["id"]).model_dump(mode="json"))["state"] in TERMINAL and j,
        a.timeout,
        f"job {n}",
        every=1.0,
    )
    after = bed.uplink_bytes()
    if done["state"] != "SUCCEEDED":
        raise RuntimeError(f"job {n} ended {done['state']}: {done.get('reason')}")
    last = max(client.metrics(job["id"]), key=lambda m: m.step).model_dump()
    steps = last["step"]
    est = done["placement"]["estimate"]
    sync = done["placement"]["sync"]
    period = int(sync.split(":")[1]) if sync.startswith("local-sgd") else 1
    return {
        "job": n,
        "placement": {c["cluster"]: c["gpus"] for c in done["placement"]["clusters"]},
        "compression": done["placement"]["compression"],
        "sync": sync,
        "estimate": {
            "step_s": est["step_time_s"],
            "compute_s": est["compute_s"],
            "wan_s": (est.get("wan_s", 0.0) + est.get("overhead_s", 0.0)) / period,
            "step_overhead_s": est.get("step_overhead_s", 0.0),
            "wan_bytes": est["wan_bytes"],
        },
        "observed": {
            "step_s": last["step_time_s"],
            "compute_s": last["compute_time_s"] / steps,
            "comm_s": last["comm_time_s"] / steps,
            "wan_bytes": last["wan_bytes"],
        },
        "uplink_bytes": {dc: after[dc][0] - before[dc][0] for dc in after},
        "steps": steps,
    }


# ----------------------------------------------------------------------------- reporting


def links_table(links: list[dict[str, Any]]) -> str:
    lines = [
        "| link | shaped path (Mbit/s) | measured by the agent (Mbit/s) | measured / shaped "
        "| RTT (ms) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for x in sorted(links, key=lambda x: (x["src"], x["dst"])):
        lines.append(
            f"| {x['src']} -> {x['dst']} | {x['shaped_mbit']:g} | {x['measured_mbit']:.1f} | "
            f"{x['measured_mbit'] / x['shaped_mbit']:.2f} | {x['rtt_ms']:.2f} |"
        )
    return "\n".join(lines)


def _err(est: float, obs: float) -> str:
    return f"{100 * (est - obs) / obs:+.0f} %" if obs else "-"


def jobs_table(jobs: list[dict[str, Any]]) -> str:
    lines = [
        "| job | placement | compression / sync | step est. (ms) | step observed (ms) | error "
        "| compute est. / obs. (ms) | WAN est. / comm obs. (ms) | fitted overhead (ms) "
        "| WAN bytes est. / cpn / uplinks |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for j in jobs:
        e, o = j["estimate"], j["observed"]
        lines.append(
            f"| {j['job']} | {', '.join(f'{c}:{g}' for c, g in j['placement'].items())} | "
            f"{j['compression']} / {j['sync']} | {1e3 * e['step_s']:.2f} | "
            f"{1e3 * o['step_s']:.2f} | {_err(e['step_s'], o['step_s'])} | "
            f"{1e3 * e['compute_s']:.2f} / {1e3 * o['compute_s']:.2f} | "
            f"{1e3 * e['wan_s']:.2f} / {1e3 * o['comm_s']:.2f} | "
            f"{1e3 * e.get('step_overhead_s', 0.0):.2f} | "
            f"{e['wan_bytes'] / 1e6:.2f} / {o['wan_bytes'] / 1e6:.2f} / "
            f"{sum(j['uplink_bytes'].values()) / 1e6:.2f} MB |"
        )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    jobs = result["jobs"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels: list[str] = []
    parts: dict[str, list[float]] = {
        "compute": [],
        "communication": [],
        "overhead (est.: fitted; obs.: evaluation, waits)": [],
    }
    for j in jobs:
        e, o = j["estimate"], j["observed"]
        labels += [f"job {j['job']}\nestimate", f"job {j['job']}\nobserved"]
        over = e.get("step_overhead_s", 0.0)
        rows = (
            (e["compute_s"], max(e["step_s"] - e["compute_s"] - over, 0.0), over),
            (o["compute_s"], o["comm_s"], max(o["step_s"] - o["compute_s"] - o["comm_s"], 0.0)),
        )
        for row in rows:
            for key, value in zip(parts, row, strict=True):
                parts[key].append(1e3 * value)
    bottom = [0.0] * len(labels)
    for key, values in parts.items():
        ax.bar(labels, values, bottom=bottom, label=key)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_ylabel("ms per step")
    ax.set_title("scheduler's step estimate vs observed, testbed through cpn serve")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(
    dcs: str, steps: int, jobs: int, timeout: float, probe_interval: float, gpus: int = 0
) -> dict[str, Any]:
    """Bring the testbed up, run `drive` in its hub namespace, tear it down; the report.
    TestbedError (no root, no tc) or ValueError (bad `dcs`) before anything starts."""
    from testbed import down, parse_dcs, up

    bed = up(parse_dcs(dcs, 100.0, 2))
    out = Path(tempfile.mkstemp(prefix="cpn-wan-serve-", suffix=".json")[1])
    try:
        inner = [sys.executable, "-m", "bench.wan_serve", "--drive", "--out", str(out)]
        inner += ["--steps", str(steps), "--jobs", str(jobs), "--timeout", str(timeout)]
        inner += ["--probe-interval", str(probe_interval), "--gpus", str(gpus)]
        res = subprocess.run(bed.hub_argv(inner), env={**os.environ, **bed.env()})
        if res.returncode != 0:
            raise RuntimeError(f"the run in the hub namespace failed ({res.returncode})")
        result: dict[str, Any] = json.loads(out.read_text())
        return result
    finally:
        out.unlink(missing_ok=True)
        down()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dcs", default=DEFAULT_DCS, help="NAME:MBIT:GPUS,... (testbed)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--gpus", type=int, default=0, help="GPUs the job asks for (0: the demo's)")
    p.add_argument("--jobs", type=int, default=2, help="runs of the job (2nd+: calibrated)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument(
        "--probe-interval",
        type=float,
        default=30.0,
        help="agents' probe period (s); their 4 MiB probes share the uplinks with the jobs",
    )
    p.add_argument("--name", default="wan-serve")
    p.add_argument("--drive", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.drive:
        drive(a)
        return

    from testbed import TestbedError

    try:
        result = run(a.dcs, a.steps, a.jobs, a.timeout, a.probe_interval, a.gpus)
    except (TestbedError, ValueError) as exc:
        sys.exit(f"bench.wan_serve: {exc}")
    cmd = "python -m bench.wan_serve " + shlex.join(argv or sys.argv[1:])
    md = [
        f"`{cmd}` (builtin:mnist1d-mlp, {a.steps} steps, datacenters {a.dcs})",
        "#### links: what the agents measured on the shaped testbed",
        links_table(result["links"]),
        "#### the demo's job through cpn serve: the scheduler's estimate against the run",
        jobs_table(result["jobs"]),
    ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{a.name}.md").write_text("\n\n".join(md) + "\n")
    (RESULTS / f"{a.name}.json").write_text(json.dumps(result, indent=1))
    plot(result, RESULTS / f"{a.name}.png")
    print(f"wrote {RESULTS / a.name}.{{md,json,png}}")


if __name__ == "__main__":
    main()
