"""`cpn testbed up|down|status`: the namespace WAN testbed of the `testbed` package (root only).

`testbed` is stdlib only and imported here at the top, so a `cpn` installed without it fails at
once rather than on first use.
"""

from __future__ import annotations

import json

import typer

from api.cli.errors import fail
from testbed import HUB_NS, STATE_DIR, TestbedError, down, parse_dcs, status, up

sub = typer.Typer(
    name="testbed",
    help="A WAN testbed on this host: one network namespace and Ray node per datacenter, "
    "uplinks shaped with tc (needs root, ip and tc).",
    no_args_is_help=True,
)


@sub.command("up")
def up_cmd(
    dcs: str = typer.Option(
        "a,b",
        "--dcs",
        help="Datacenters: NAME[:MBIT[:WORKERS]],... e.g. a,b,c or a:100:2,b:1000:2.",
    ),
    mbit: float = typer.Option(100.0, "--mbit", help="Default uplink rate (both directions)."),
    workers: int = typer.Option(2, "--workers", help="Default Ray worker slots per datacenter."),
    as_json: bool = typer.Option(False, "--json", help="Print the testbed as JSON."),
) -> None:
    """Build the testbed (tearing down any earlier one) and start Ray across it."""
    try:
        layout = parse_dcs(dcs, mbit, workers)
    except ValueError as exc:
        raise fail("testbed up", "--dcs", str(exc)) from None
    try:
        bed = up(layout)
    except TestbedError as exc:
        raise fail("testbed up", None, str(exc)) from None
    if as_json:
        print(json.dumps({"ray_address": bed.ray_address, "datacenters": bed.datacenters}))
        return
    print(f"testbed up: Ray at {bed.ray_address} (run drivers in the hub namespace)")
    for d in bed.datacenters:
        print(f"  {d['name']}: netns {d['netns']} ip {d['ip']} uplink {d['mbit']:g} Mbit/s")
    print(
        f"train across it: ip netns exec {HUB_NS} env RAY_AUTH_MODE=token "
        f"RAY_AUTH_TOKEN=$(jq -r .token {_state_path()}) cpn train --ray-address "
        f"{bed.ray_address} --gloo-ifname {bed.gloo_ifname} --clusters ..."
    )


def _state_path() -> str:
    return str(STATE_DIR / "state.json")


@sub.command("down")
def down_cmd() -> None:
    """Remove every namespace, link, qdisc and Ray process the testbed made (idempotent)."""
    try:
        gone = down()
    except TestbedError as exc:
        raise fail("testbed down", None, str(exc)) from None
    print(f"testbed down: removed {len(gone)} namespace(s)/link(s)")


@sub.command("status")
def status_cmd(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Namespaces, shaping, uplink byte counters and processes of the testbed."""
    try:
        st = status()
    except TestbedError as exc:
        raise fail("testbed status", None, str(exc)) from None
    if as_json:
        print(json.dumps(st))
        return
    if not st["namespaces"]:
        print("testbed: down")
        return
    print(f"testbed: namespaces {', '.join(st['namespaces'])}; Ray at {st['ray_address']}")
    for d in st["datacenters"]:
        print(
            f"  {d['name']}: {d['ip']} {d['mbit']:g} Mbit/s tx {d['tx_bytes']:,} B "
            f"rx {d['rx_bytes']:,} B, {d['processes']} process(es); {d['qdisc']}"
        )


def register(app: typer.Typer) -> None:
    """Attach `cpn testbed` to the root CLI app."""
    app.add_typer(sub, name="testbed")
