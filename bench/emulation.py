"""Does the emulated WAN keep within 15 % of the testbed on the WAN-bound workloads? (issue 16,
item 6)

The emulation (`training.wan`: a link table; each exchange waits out what its measured bytes
would have needed on the links) is what `cpn train --link-mbps` and the planner's calibration
use when no real WAN is at hand. Here every cpn row of a testbed run of `bench.peers` (its
`bench/results/peers-<mbit>mbit.json`: same task, steps, seed, sync, compression and outer
optimizer) is run again on one node, a local Ray with every cluster pair's link emulated at the
testbed's uplink rate and no latency (the testbed's `tbf` adds none), and the wall times are
set side by side. On the testbed a pair's path is one shaped uplink and one shaped downlink,
both at that rate and full duplex, which is what one emulated link is.

    .venv/bin/python -m bench.emulation --mbit 25       # after bench.peers --mbit 25

Results: bench/results/emulation-<mbit>mbit.{md,json}, headed by the command.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Any

from bench.peers import PEERS, RESULTS, Peer

TOLERANCE = 0.15
"""The issue's bound on |emulated - testbed| / testbed wall time."""


@dataclass(frozen=True)
class Pair:
    """One cpn row, on the testbed and emulated."""

    peer: str
    sync: str
    compression: str
    testbed_wall_s: float
    emulated_wall_s: float
    testbed_compute_s: float
    emulated_compute_s: float
    testbed_uplink_mb: float
    emulated_wan_mb: float

    @property
    def gap(self) -> float:
        """Emulated over testbed wall time, minus one."""
        return self.emulated_wall_s / self.testbed_wall_s - 1.0

    @property
    def within(self) -> bool:
        return abs(self.gap) <= TOLERANCE

    @property
    def testbed_wait_s(self) -> float:
        """Wall time not spent computing (rank 0): mostly waiting on the WAN."""
        return self.testbed_wall_s - self.testbed_compute_s

    @property
    def emulated_wait_s(self) -> float:
        return self.emulated_wall_s - self.emulated_compute_s


def table(pairs: list[Pair], mbit: float, command: str, meta: str) -> str:
    rows = [
        f"# Emulated WAN against the testbed, {mbit:g} Mbit/s\n",
        f"`{command}`\n",
        meta + "\n",
        "| row | testbed wall s | emulated wall s | gap | within 15 % | testbed non-compute s "
        "| emulated non-compute s | testbed uplink MB | emulated WAN MB |",
        "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for p in pairs:
        rows.append(
            f"| {p.peer} | {p.testbed_wall_s:.1f} | {p.emulated_wall_s:.1f} | "
            f"{100 * p.gap:+.0f} % | {'yes' if p.within else '**no**'} | "
            f"{p.testbed_wait_s:.1f} | {p.emulated_wait_s:.1f} | "
            f"{p.testbed_uplink_mb:,.0f} | {p.emulated_wan_mb:,.0f} |"
        )
    n_in = sum(p.within for p in pairs)
    rows.append(f"\n{n_in} of {len(pairs)} rows within {TOLERANCE:.0%}.")
    return "\n".join(rows) + "\n"


def emulated(peer: Peer, setup: dict[str, Any], mbit: float, timeout_s: float) -> dict[str, Any]:
    """One cpn row on a local Ray, every link emulated at `mbit`."""
    sync = peer.sync.format(H=setup["period"])
    argv = [sys.executable, "-m", "bench.peers", "cpn-driver", "--task", setup["task"]]
    argv += ["--steps", str(setup["steps"]), "--seed", str(setup["seed"])]
    argv += ["--eval-every", str(max(1, setup["steps"] // setup["evals"]))]
    argv += ["--compression", peer.compression, "--sync", sync]
    argv += ["--outer-lr", str(setup["outer_lr"]), "--outer-momentum"]
    argv += [str(setup["outer_momentum"]), "--emulate-mbps", str(mbit)]
    argv += ["--nesterov" if setup["nesterov"] else "--no-nesterov"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CPN_RAY", "RAY_ADDRESS"))}
    res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"{peer.name}: {res.stderr[-800:]}")
    out: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mbit", type=float, default=25.0)
    p.add_argument("--peers", default="", help="comma-separated substrings of cpn row names")
    p.add_argument("--timeout-s", type=float, default=900.0)
    a = p.parse_args(argv)
    stem = f"peers-{a.mbit:g}mbit"
    testbed = json.loads((RESULTS / f"{stem}.json").read_text())
    setup = testbed["setup"]
    measured = {r["peer"]: r for r in testbed["rows"] if r["kind"] == "cpn" and r.get("wall_s")}
    wanted = [s.strip() for s in a.peers.split(",") if s.strip()]
    pairs: list[Pair] = []
    for peer in PEERS:
        row = measured.get(peer.name)
        if row is None or (wanted and not any(s in peer.name for s in wanted)):
            continue
        if peer.sync == "auto":  # decides from what it measures: not the same run twice
            continue
        print(f"  {peer.name} ...", file=sys.stderr, flush=True)
        rep = emulated(peer, setup, a.mbit, a.timeout_s)
        pairs.append(
            Pair(
                peer=peer.name,
                sync=peer.sync.format(H=setup["period"]),
                compression=peer.compression,
                testbed_wall_s=float(row["wall_s"]),
                emulated_wall_s=float(rep["wall_s"]),
                testbed_compute_s=float(row["compute_s"]),
                emulated_compute_s=float(rep["compute_s"]),
                testbed_uplink_mb=row["uplink_bytes_total"] / 1e6,
                emulated_wan_mb=sum((rep.get("wan_bytes") or {}).values()) / 1e6,
            )
        )
    command = ".venv/bin/python -m bench.emulation " + shlex.join(
        argv if argv is not None else sys.argv[1:]
    )
    meta = (
        f"Testbed rows from `bench/results/{stem}.json` (`{testbed['command']}`); the same "
        f"runs ({setup['task']}, {setup['steps']} steps, 3 clusters x 2 workers, seed "
        f"{setup['seed']}) on one local Ray with every link emulated at {a.mbit:g} Mbit/s, no "
        "latency. Non-compute: wall minus rank 0's compute time. Emulated WAN MB: what the "
        "exchanges put on all directed links (payload); testbed: uplink interface counters "
        "(headers and control traffic included). `auto` is left out: it decides from what it "
        "measures, so the two sides would not run the same modes."
    )
    md = table(pairs, a.mbit, command, meta)
    print(md)
    out = RESULTS / f"emulation-{a.mbit:g}mbit"
    out.with_suffix(".md").write_text(md)
    out.with_suffix(".json").write_text(
        json.dumps({"command": command, "mbit": a.mbit, "pairs": [asdict(x) for x in pairs]})
    )
    print(f"wrote {out}.{{md,json}}", file=sys.stderr)


if __name__ == "__main__":
    main()
