"""`cpn demo`: the main job on the embedded default, end to end, with real processes."""

from __future__ import annotations

import secrets
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import typer

DEMO_CLUSTERS: dict[str, dict[str, Any]] = {
    "us-east": {
        "region": "us-east-1",
        "gpus": [{"model": "A100-80GB", "memory_gib": 80, "count": 8}],
    },
    "eu-west": {
        "region": "eu-west-1",
        "gpus": [{"model": "H100-80GB", "memory_gib": 80, "count": 4}],
    },
    "ap-south": {"region": "ap-south-1", "gpus": [{"model": "L4", "memory_gib": 24, "count": 16}]},
}
DEMO_LINKS = [  # declared until the agents measure them
    ("us-east", "eu-west", {"bandwidth_gbps": 10.0, "rtt_ms": 75.0, "egress_price_per_gb": 0.02}),
    ("us-east", "ap-south", {"bandwidth_gbps": 2.0, "rtt_ms": 190.0, "egress_price_per_gb": 0.05}),
    ("eu-west", "ap-south", {"bandwidth_gbps": 5.0, "rtt_ms": 120.0, "egress_price_per_gb": 0.04}),
]


def demo(
    workdir: Path = typer.Option(Path("var/demo"), help="Where the demo keeps its database."),
    timeout: float = typer.Option(90.0, min=5, help="Seconds to wait for the clusters."),
) -> None:
    """Start a control plane on SQLite, three clusters' agents, and show them READY."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn

    from api.cli.admin import clusters_table, gpus_table, links_table
    from api.client import Client
    from api.processes import ProcessError, start_agent, start_control_plane, write_inventory

    console = Console()
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    token = f"cpn_admin_{secrets.token_urlsafe(24)}"
    settings = {
        "CPN_HEARTBEAT_INTERVAL_S": "1",
        "CPN_LEASE_GRACE_S": "5",
        "CPN_PROBE_INTERVAL_S": "2",
        "CPN_PROBE_BYTES": str(2 << 20),
    }
    agents = []
    try:
        with console.status("starting the control plane (SQLite, migrations, cpn serve)..."):
            plane = start_control_plane(f"sqlite:///{workdir / 'cpn.db'}", token, settings=settings)
    except ProcessError as exc:
        print(f"cpn demo: error: {exc}", file=sys.stderr)
        raise typer.Exit(1) from None
    console.print(f"control plane at [bold]{plane.url}[/] (SQLite {workdir / 'cpn.db'})")
    try:
        with Client(plane.url, token) as admin:
            for name, spec in DEMO_CLUSTERS.items():
                admin.create_cluster(name, spec["region"])
                agent_token = admin.create_api_key("agent", name, f"{name} agent")["token"]
                inventory = write_inventory(workdir / f"{name}-gpus.yaml", spec["gpus"])
                agents.append(start_agent(name, plane.url, agent_token, inventory))
            for a, b, values in DEMO_LINKS:
                admin.declare_link(a, b, **values)
            want_links = len(DEMO_CLUSTERS) * (len(DEMO_CLUSTERS) - 1)
            columns = (
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
            )
            with Progress(*columns, console=console) as progress:
                ready = progress.add_task("clusters READY", total=len(DEMO_CLUSTERS))
                measured = progress.add_task("links measured", total=want_links)
                deadline = time.monotonic() + timeout
                while True:
                    n_ready = sum(
                        c["state"] == "READY" and c["gpus"] != [] for c in admin.clusters()
                    )
                    n_links = len(admin.links("measured"))
                    progress.update(ready, completed=n_ready)
                    progress.update(measured, completed=min(n_links, want_links))
                    if n_ready == len(DEMO_CLUSTERS) and n_links >= want_links:
                        break
                    if time.monotonic() > deadline:
                        tails = "\n".join(a.tail(5) for a in agents)
                        raise ProcessError(f"clusters not ready after {timeout:g}s:\n{tails}")
                    time.sleep(0.2)
            console.print(clusters_table(admin.clusters()))
            console.print(gpus_table(admin.gpus()))
            console.print(links_table(admin.links()))
    except ProcessError as exc:
        print(f"cpn demo: error: {exc}", file=sys.stderr)
        raise typer.Exit(1) from None
    finally:
        for agent in agents:
            agent.stop()
        plane.proc.stop()
    console.print("[green]demo complete[/]: agents and control plane stopped cleanly")


def register(app: typer.Typer) -> None:
    """Attach `cpn demo`."""
    app.command("demo")(demo)
