"""A WAN link that degrades and recovers mid-run, on the namespace testbed: does `auto` follow?

3 datacenters x 2 workers on 100 Mbit/s uplinks (tc tbf, both directions); one run of
`cpn train --sync auto --compression auto` (through `training.run`, a driver in the hub
namespace) drops datacenter `--dc`'s uplink to `--low` Mbit/s at the first eval at or past
step `--down-at` (`tc qdisc change`, `testbed.Testbed.set_rate`) and raises it back at
`--up-at`. A reference run (same seed, links untouched; `--no-reference` skips it) gives the
quality the changed run should keep.

Reported: each change (step, wall, the rate tc shows afterwards) and the first auto decision
after it (step, wall interpolated from the eval history, rounds after the change = steps over
the period that was running, sync and compression); time per step and the regime (fp32
exchange / compute, `bench.peers.regime`) in each link phase; final loss and accuracy of both
runs. The plot: eval accuracy, steps/s and the changed datacenter's uplink traffic against
wall time, link phases shaded, auto decisions marked.

    sudo CPN_TESTBED_PREFIX=cpnlc .venv/bin/python -m bench.linkchange
    sudo CPN_TESTBED_PREFIX=cpnlc .venv/bin/python -m bench.linkchange --steps 96 \\
        --no-reference --out /tmp/lc-smoke

Results: bench/results/linkchange.{md,json,png} (`--out STEM`: STEM.{md,json,png}), each
headed by the command that made it; `--render JSON` rewrites the .md and .png from a run's
JSON without running anything.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import shlex
import sys
import textwrap
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.peers import DCS, RESULTS, WORKERS, _fmt, regime
from training.sync.auto import OBSERVE_EVERY as EVERY_STEP_OBSERVE

# ----------------------------------------------------------------------------- pure parts


@dataclass(frozen=True)
class RateChange:
    """Set the changed datacenter's uplink to `mbit` at the first eval at or past `step`."""

    step: int
    mbit: float


def schedule(steps: int, down_at: int, up_at: int, low: float, mbit: float) -> list[RateChange]:
    """Down to `low` at `down_at`, back to `mbit` at `up_at` (ValueError names the fix)."""
    if not 0 < down_at < up_at:
        raise ValueError(f"need 0 < --down-at ({down_at}) < --up-at ({up_at})")
    if up_at > steps:
        raise ValueError(f"--up-at ({up_at}) is past the run's {steps} steps")
    if not (low > 0 and mbit > 0):
        raise ValueError("rates must be > 0 Mbit/s")
    return [RateChange(down_at, low), RateChange(up_at, mbit)]


@dataclass
class LinkSchedule:
    """The changes still to make; `due(step)` hands each out once, at the first progress at
    or past its step (several at once if one eval segment passed them all: the last wins)."""

    changes: list[RateChange]
    made: int = 0

    def due(self, step: int) -> list[RateChange]:
        out: list[RateChange] = []
        while self.made < len(self.changes) and self.changes[self.made].step <= step:
            out.append(self.changes[self.made])
            self.made += 1
        return out


@dataclass(frozen=True)
class AppliedChange:
    """A change as made: at the end of the eval segment that ended at `step` (between two
    segments: no step was running), `wall_s` after the run's start; `qdisc` is what tc showed
    on the datacenter's side of the uplink right after."""

    step: int
    wall_s: float
    mbit: float
    qdisc: str = ""


@dataclass(frozen=True)
class Sample:
    """The driver's view after each eval segment: rank 0's compute seconds so far and the
    changed datacenter's uplink counters (bytes out of it, into it)."""

    step: int
    wall_s: float
    compute_s: float
    tx_bytes: int
    rx_bytes: int
    mbit: float


@dataclass(frozen=True)
class Choice:
    """One of the run's `auto_decisions`: from `step` on it ran `sync` with `compression`."""

    step: int
    sync: str
    compression: str
    why: str = ""


@dataclass
class Run:
    """One driver run, as its JSON comes back."""

    label: str
    wall_s: float
    compute_s: float
    final_loss: float
    final_accuracy: float
    history: list[dict[str, Any]]
    decisions: list[Choice]
    changes: list[AppliedChange] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    uplink_bytes: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_json(cls, label: str, d: dict[str, Any]) -> Run:
        return cls(
            label=label,
            wall_s=float(d["wall_s"]),
            compute_s=float(d["compute_s"]),
            final_loss=float(d["final_loss"]),
            final_accuracy=float(d["final_accuracy"]),
            history=list(d["history"]),
            decisions=[Choice(**c) for c in d.get("auto_decisions") or []],
            changes=[AppliedChange(**c) for c in d.get("changes") or []],
            samples=[Sample(**s) for s in d.get("samples") or []],
            uplink_bytes=dict(d.get("uplink_bytes") or {}),
        )


def wall_at(history: Sequence[dict[str, Any]], step: float) -> float | None:
    """Wall seconds at `step`, linear between the history's (step, wall_s) points, from
    (0, 0) (the run's clock starts at step 0); past the last point, at the last segment's
    pace. None without history."""
    pts = [(0.0, 0.0), *sorted((float(h["step"]), float(h["wall_s"])) for h in history)]
    if len(pts) < 2:
        return None
    for (s0, w0), (s1, w1) in itertools.pairwise(pts):
        if step <= s1:
            return w0 + (w1 - w0) * (step - s0) / (s1 - s0) if s1 > s0 else w1
    (s0, w0), (s1, w1) = pts[-2], pts[-1]
    return w1 + (w1 - w0) * (step - s1) / (s1 - s0) if s1 > s0 else w1


def round_steps(sync: str, every_step_observe: int = EVERY_STEP_OBSERVE) -> int:
    """Steps between two of auto's measurements while `sync` runs: local SGD's (and
    streaming's) period H, `every_step_observe` under every-step."""
    from grammar import SyncKind, parse_sync

    s = parse_sync(sync)
    if s.kind is SyncKind.EVERY_STEP:
        return every_step_observe
    return max(1, s.period)


def running_at(decisions: Sequence[Choice], step: int) -> Choice | None:
    """The decision in force at `step` (the last one made at or before it)."""
    before = [c for c in decisions if c.step <= step]
    return max(before, key=lambda c: c.step) if before else None


@dataclass(frozen=True)
class Response:
    """How auto answered one link change: `decision` is its first decision after the change
    and before the next one (None: it kept what ran), `rounds` the steps between them over
    the round of what was running when the link changed."""

    change: AppliedChange
    running: Choice | None
    decision: Choice | None
    wall_s: float | None
    rounds: float | None


def responses(
    changes: Sequence[AppliedChange],
    decisions: Sequence[Choice],
    history: Sequence[dict[str, Any]],
    every_step_observe: int = EVERY_STEP_OBSERVE,
) -> list[Response]:
    out: list[Response] = []
    for i, ch in enumerate(changes):
        until = changes[i + 1].step if i + 1 < len(changes) else math.inf
        after = sorted((c for c in decisions if ch.step < c.step <= until), key=lambda c: c.step)
        running = running_at(decisions, ch.step)
        first = after[0] if after else None
        rounds = None
        if first is not None and running is not None:
            rounds = (first.step - ch.step) / round_steps(running.sync, every_step_observe)
        wall = wall_at(history, first.step) if first is not None else None
        out.append(Response(ch, running, first, wall, rounds))
    return out


@dataclass(frozen=True)
class Phase:
    """Steps run at one rate of the changed datacenter's uplink."""

    mbit: float
    start_step: int
    end_step: int
    start_wall: float
    end_wall: float
    compute_s: float
    """Rank 0's compute seconds within the phase."""

    @property
    def steps(self) -> int:
        return self.end_step - self.start_step

    @property
    def s_per_step(self) -> float | None:
        return (self.end_wall - self.start_wall) / self.steps if self.steps > 0 else None

    @property
    def compute_per_step(self) -> float | None:
        return self.compute_s / self.steps if self.steps > 0 else None


def _interp(points: Sequence[tuple[float, float]], x: float) -> float:
    """Linear in sorted (x, y) points, held flat outside them."""
    return float(np.interp(x, [p[0] for p in points], [p[1] for p in points]))


def phases(samples: Sequence[Sample], bounds: Sequence[int], rates: Sequence[float]) -> list[Phase]:
    """Split a run at the steps `bounds` (the changes' steps) into phases at `rates`
    (`len(bounds) + 1` of them), wall and compute from the samples, from (0, 0, 0). A run
    that never reached a bound has no phase after it."""
    if len(rates) != len(bounds) + 1:
        raise ValueError("one rate per phase: len(rates) == len(bounds) + 1")
    if not samples:
        return []
    pts = [(0.0, 0.0, 0.0), *sorted((s.step, s.wall_s, s.compute_s) for s in samples)]
    walls = [(float(p[0]), p[1]) for p in pts]
    comps = [(float(p[0]), p[2]) for p in pts]
    last = int(pts[-1][0])
    edges = [0, *[b for b in bounds if b < last], last]
    out = []
    for i, (a, b) in enumerate(itertools.pairwise(edges)):
        out.append(
            Phase(
                rates[i],
                a,
                b,
                _interp(walls, a),
                _interp(walls, b),
                _interp(comps, b) - _interp(comps, a),
            )
        )
    return out


@dataclass(frozen=True)
class Rate:
    """One eval segment: its end (step, wall), steps/s, and the changed datacenter's uplink
    traffic (Mbit/s, the busier direction) averaged over it."""

    step: int
    wall_s: float
    steps_per_s: float
    uplink_mbit: float


def segment_rates(samples: Sequence[Sample]) -> list[Rate]:
    out = []
    for a, b in itertools.pairwise(samples):
        dt = b.wall_s - a.wall_s
        if dt <= 0:
            continue
        moved = max(b.tx_bytes - a.tx_bytes, b.rx_bytes - a.rx_bytes)
        out.append(Rate(b.step, b.wall_s, (b.step - a.step) / dt, moved * 8 / dt / 1e6))
    return out


_TC_RATE = re.compile(r"\brate (\S+)")


def tc_rate(qdisc: str) -> str | None:
    """The rate a `tc qdisc show` line reports (e.g. "10Mbit"), None if it shows none."""
    m = _TC_RATE.search(qdisc)
    return m.group(1) if m else None


def peak_uplink(rates: Sequence[Rate], start_step: int, end_step: int) -> float | None:
    """The busiest eval segment's uplink traffic (Mbit/s) within steps (start, end]: at most
    the rate tc lets through, which is what shows a change took effect."""
    inside = [r.uplink_mbit for r in rates if start_step < r.step <= end_step]
    return max(inside) if inside else None


def _choice(c: Choice | None) -> str:
    return "-" if c is None else f"{c.sync} / {c.compression}"


def table(
    run: Run,
    reference: Run | None,
    dc: str,
    mbit: float,
    params: int,
    command: str,
    meta: str,
) -> str:
    """The markdown report, headed by the command."""
    resp = responses(run.changes, run.decisions, run.history)
    bounds = [c.step for c in run.changes]
    rates = [mbit, *[c.mbit for c in run.changes]]
    ph = phases(run.samples, bounds, rates)
    ref_ph = phases(reference.samples, bounds, [mbit] * len(rates)) if reference else []
    out = [
        f"# A link change mid-run: datacenter {dc}'s uplink under `auto`",
        "",
        f"`{command}`",
        "",
        meta,
        "",
        "## Link changes and auto's answer",
        "",
        "| change at step | wall (s) | rate (Mbit/s) | tc shows | running then | first decision "
        "after: step | wall (s) | rounds after | sync / compression | why |",
        "| ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | --- | --- |",
    ]
    for i, rr in enumerate(resp):
        d = rr.decision
        none = "none before the next change" if i + 1 < len(resp) else "none by the end"
        out.append(
            f"| {rr.change.step} | {rr.change.wall_s:.1f} | {rr.change.mbit:g} | "
            f"{tc_rate(rr.change.qdisc) or '-'} | {_choice(rr.running)} | "
            f"{d.step if d else none} | {_fmt(rr.wall_s)} | "
            f"{_fmt(rr.rounds, '.2g')} | {_choice(d)} | {d.why if d else '-'} |"
        )
    if not resp:
        out.append("| (no change made) | | | | | | | | | |")
    out += [
        "",
        "## Phases",
        "",
        f"| phase (steps) | {dc}'s uplink (Mbit/s) | s/step, changed run | s/step, reference "
        "| compute s/step | regime (fp32 exchange / compute) | busiest eval segment on "
        f"{dc}'s uplink (Mbit/s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    seg = segment_rates(run.samples)
    for i, p in enumerate(ph):
        ref = ref_ph[i] if i < len(ref_ph) else None
        cps = p.compute_per_step
        out.append(
            f"| {p.start_step}-{p.end_step} | {p.mbit:g} | {_fmt(p.s_per_step, '.3f')} | "
            f"{_fmt(ref.s_per_step if ref else None, '.3f')} | {_fmt(cps, '.3f')} | "
            f"{_fmt(regime(params, cps, p.mbit) if cps else None, '.3g')} | "
            f"{_fmt(peak_uplink(seg, p.start_step, p.end_step), '.1f')} |"
        )
    out += [
        "",
        "## Quality",
        "",
        "| run | final loss | final accuracy | wall (s) | uplink MB (all DCs, out) "
        "| auto decisions (step: sync / compression) |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in [run, *([reference] if reference else [])]:
        dec = "; ".join(f"{c.step}: {_choice(c)}" for c in r.decisions) or "-"
        mb = sum(r.uplink_bytes.values()) / 1e6 if r.uplink_bytes else None
        out.append(
            f"| {r.label} | {r.final_loss:.4f} | {100 * r.final_accuracy:.2f} % | "
            f"{r.wall_s:.1f} | {_fmt(mb, ',.1f')} | {dec} |"
        )
    if reference is not None:
        out += [
            "",
            "Changed run vs reference: final accuracy "
            f"{100 * (run.final_accuracy - reference.final_accuracy):+.2f} points, "
            f"final loss {run.final_loss - reference.final_loss:+.4f}, wall "
            f"{run.wall_s / reference.wall_s:.2f}x.",
        ]
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- driver (hub)


def driver(a: argparse.Namespace) -> None:
    """One `training.run` under sync auto / compression auto, a Ray driver in the hub
    namespace; changes the link between eval segments and prints one line of JSON."""
    from testbed import UPLINK_IF, load, net
    from training import TrainSpec, run
    from training.spec import Progress

    bed = load()
    if bed is None:
        raise SystemExit("no testbed recorded (CPN_TESTBED_PREFIX?): bring one up first")
    dc = bed.datacenter(a.dc)
    plan = LinkSchedule([] if a.no_change else schedule(a.steps, a.down_at, a.up_at, a.low, a.mbit))
    changes: list[AppliedChange] = []
    samples: list[Sample] = []
    now = [dc.mbit]

    def on_progress(p: Progress) -> None:
        entered = time.perf_counter()
        tx, rx = net.counters(dc.netns, UPLINK_IF)
        samples.append(Sample(p.step, p.wall_s, p.compute_s, tx, rx, now[0]))
        for c in plan.due(p.step):
            bed.set_rate(a.dc, c.mbit)
            now[0] = c.mbit
            wall = p.wall_s + time.perf_counter() - entered
            changes.append(AppliedChange(p.step, wall, c.mbit, net.qdisc(dc.netns, UPLINK_IF)))
            print(f"step {p.step}: {a.dc} -> {c.mbit:g} Mbit/s", file=sys.stderr, flush=True)

    spec = TrainSpec(
        task=a.task,
        clusters=dict.fromkeys(a.dcs.split(","), WORKERS),
        compression="auto",
        sync="auto",
        steps=a.steps,
        seed=a.seed,
        eval_every=a.eval_every,
        ray_address=a.ray_address,
    )
    rep = run(spec, on_progress=on_progress).to_dict()
    keep = ("wall_s", "compute_s", "final_loss", "final_accuracy", "history", "auto_decisions")
    out = {k: rep.get(k) for k in keep}
    out["changes"] = [asdict(c) for c in changes]
    out["samples"] = [asdict(s) for s in samples]
    print(json.dumps(out, default=str))


# ----------------------------------------------------------------------------- orchestration


def _drive(bed: Any, a: argparse.Namespace, change: bool) -> dict[str, Any]:
    """One driver run in the hub, the link reset to `--mbit` first; its JSON plus the bytes
    out of each datacenter's uplink during it."""
    bed.set_rate(a.dc, a.mbit)
    argv = [sys.executable, "-m", "bench.linkchange", "driver", "--task", a.task]
    argv += ["--steps", str(a.steps), "--seed", str(a.seed), "--eval-every", str(a.eval_every)]
    argv += ["--dc", a.dc, "--mbit", str(a.mbit), "--low", str(a.low)]
    argv += ["--down-at", str(a.down_at), "--up-at", str(a.up_at)]
    argv += ["--dcs", ",".join(d["name"] for d in bed.datacenters)]
    argv += ["--ray-address", bed.ray_address]
    argv += [] if change else ["--no-change"]
    before = bed.uplink_bytes()
    res = bed.run_in_hub(argv, timeout=a.timeout_s)
    after = bed.uplink_bytes()
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-1500:])
    rep: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    rep["uplink_bytes"] = {dc: after[dc][0] - before[dc][0] for dc in after}
    return rep


def plot(run: Run, reference: Run | None, dc: str, mbit: float, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(11, 10), sharex=True)
    acc, speed, link = axes
    runs = [(run, "C0"), *([(reference, "C7")] if reference else [])]
    end = max(r.wall_s for r, _ in runs)
    walls = [0.0, *[c.wall_s for c in run.changes], end]
    rates = [mbit, *[c.mbit for c in run.changes]]
    for ax in axes:
        for (w0, w1), rate in zip(itertools.pairwise(walls), rates, strict=False):
            if rate != mbit:
                ax.axvspan(w0, w1, color="C3", alpha=0.12, lw=0)
        ax.grid(alpha=0.3)
    for r, color in runs:
        h = [p for p in r.history if p.get("accuracy") is not None]
        acc.plot(
            [p["wall_s"] for p in h],
            [100 * p["accuracy"] for p in h],
            "-",
            marker=".",
            color=color,
            label=r.label,
        )
        seg = segment_rates(r.samples)
        # each value holds over its segment, which ends at its wall time
        speed.step([s.wall_s for s in seg], [s.steps_per_s for s in seg], where="pre", color=color)
        link.step(
            [s.wall_s for s in seg],
            [s.uplink_mbit for s in seg],
            where="pre",
            color=color,
            label=f"{r.label}: {dc}'s uplink traffic (busier direction, mean over each eval)",
        )
        pts = [(float(p["wall_s"]), 100 * float(p["accuracy"])) for p in h]
        for i, c in enumerate(r.decisions):
            w = wall_at(r.history, c.step)
            if w is None:
                continue
            y = _interp(pts, w) if pts else 0.0
            acc.plot([w], [y], marker="v", color=color, ms=9)
            if r is run:
                acc.annotate(  # labels along the panel's top, staggered, a line to the mark
                    f"step {c.step}: {c.sync}\n{c.compression}",
                    (w, y),
                    xytext=(w, 0.97 - 0.12 * (i % 3)),
                    textcoords=acc.get_xaxis_transform(),
                    va="top",
                    fontsize=7,
                    color=color,
                    arrowprops={"arrowstyle": "-", "color": color, "lw": 0.5},
                )
            for ax in (speed, link) if r is run else ():
                ax.axvline(w, color=color, ls=":", lw=1)
    link.step(walls, [*rates, rates[-1]], where="post", color="C3", lw=1, label=f"{dc}'s tc rate")
    acc.set_ylabel("eval accuracy (%)")
    speed.set_ylabel("steps/s (between evals)")
    link.set_ylabel("Mbit/s")
    link.set_ylim(0, 1.35 * max(rates))  # room for the legend above the rate line
    link.set_xlabel("wall time (s); shaded: the lowered link; triangles/dotted: auto decisions")
    acc.legend(fontsize=8, loc="lower right")
    link.legend(fontsize=7, loc="upper right")
    acc.set_title("\n".join(textwrap.wrap(title, 140)), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
    )
    sub = p.add_subparsers(dest="cmd")
    d = sub.add_parser("driver", help="(internal) one run, in the hub namespace")
    for ap in (p, d):
        ap.add_argument("--task", default="builtin:gpt-stdlib")
        ap.add_argument("--steps", type=int, default=480)
        ap.add_argument("--seed", type=int, default=0)
        ap.add_argument("--eval-every", type=int, default=8)
        ap.add_argument("--dc", default=DCS[1], help="the datacenter whose uplink changes")
        ap.add_argument("--mbit", type=float, default=100.0, help="every uplink's rate")
        ap.add_argument("--low", type=float, default=10.0, help="the lowered rate")
        ap.add_argument("--down-at", type=int, default=None, help="default: steps/3")
        ap.add_argument("--up-at", type=int, default=None, help="default: 2 steps/3")
    d.add_argument("--dcs", default=",".join(DCS))
    d.add_argument("--ray-address", default=None)
    d.add_argument("--no-change", action="store_true", help="the reference: links untouched")
    p.add_argument("--no-reference", action="store_true", help="skip the unchanged run")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per run")
    p.add_argument("--out", default=str(RESULTS / "linkchange"), help="STEM: STEM.{md,json,png}")
    p.add_argument(
        "--render", metavar="JSON", help="no run: write --out's .md and .png from this JSON"
    )
    a = p.parse_args(argv)
    a.down_at = a.steps // 3 if a.down_at is None else a.down_at
    a.up_at = 2 * a.steps // 3 if a.up_at is None else a.up_at
    if a.cmd == "driver":
        driver(a)
        return
    if a.render:
        stem = Path(a.out)
        stem.parent.mkdir(parents=True, exist_ok=True)
        render(json.loads(Path(a.render).read_text()), stem)
        print(f"wrote {stem}.{{md,png}}", flush=True)
        return
    try:
        schedule(a.steps, a.down_at, a.up_at, a.low, a.mbit)
    except ValueError as exc:
        p.error(str(exc))
    if a.dc not in DCS:
        p.error(f"--dc {a.dc!r}: the testbed's datacenters are {', '.join(DCS)}")

    from bench.peers import _bed
    from testbed import down
    from training.tasks import load_task

    params = sum(q.numel() for q in load_task(a.task).model().parameters() if q.requires_grad)
    prefix = os.environ.get("CPN_TESTBED_PREFIX", "cpntb")
    command = f"CPN_TESTBED_PREFIX={prefix} .venv/bin/python -m bench.linkchange " + shlex.join(
        argv if argv is not None else sys.argv[1:]
    )
    t0 = time.monotonic()
    try:
        bed = _bed(a.mbit)
        print(f"testbed up in {time.monotonic() - t0:.0f} s", flush=True)
        reps: dict[str, dict[str, Any]] = {}
        if not a.no_reference:
            reps["reference"] = _drive(bed, a, change=False)
            print(f"reference: wall {reps['reference']['wall_s']:.1f} s", flush=True)
        reps["changed"] = _drive(bed, a, change=True)
        print(f"changed: wall {reps['changed']['wall_s']:.1f} s", flush=True)
        bed.set_rate(a.dc, a.mbit)
    finally:
        down()
    doc = {
        "command": command,
        "task": a.task,
        "params": params,
        "steps": a.steps,
        "eval_every": a.eval_every,
        "seed": a.seed,
        "dc": a.dc,
        "mbit": a.mbit,
        "low": a.low,
        "down_at": a.down_at,
        "up_at": a.up_at,
        "runs": reps,
    }
    stem = Path(a.out)
    stem.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{stem}.json").write_text(json.dumps(doc, indent=1))  # the data first
    print(render(doc, stem), flush=True)
    print(f"wrote {stem}.{{md,json,png}}", flush=True)


def render(doc: dict[str, Any], stem: Path) -> str:
    """STEM.md and STEM.png from a run's JSON (both headed by its command); the markdown."""
    reps = doc["runs"]
    dc, mbit, low = doc["dc"], float(doc["mbit"]), float(doc["low"])
    run = Run.from_json(f"{dc} {mbit:g}->{low:g}->{mbit:g} Mbit/s", reps["changed"])
    reference = (
        Run.from_json("reference (no change)", reps["reference"]) if "reference" in reps else None
    )
    meta = (
        f"Task {doc['task']} ({doc['params']:,} parameters), {len(DCS)} datacenters x "
        f"{WORKERS} workers on the namespace testbed (as root), every uplink {mbit:g} Mbit/s "
        f"(tc tbf, both directions); `--sync auto --compression auto`, {doc['steps']} steps, "
        f"eval every {doc['eval_every']}, seed {doc['seed']}. Datacenter {dc}'s uplink goes to "
        f"{low:g} Mbit/s at the first eval at or past step {doc['down_at']} and back at step "
        f"{doc['up_at']} (`tc qdisc change` both ways, between two eval segments). Decision "
        "walls: interpolated from the eval history; rounds after: steps from the change to the "
        "decision over the period running at the change (auto measures once a period; "
        f"every-step: every {EVERY_STEP_OBSERVE}). Compute: rank 0's. Timings on a shared "
        "machine unless stated otherwise."
    )
    md = table(run, reference, dc, mbit, int(doc["params"]), doc["command"], meta)
    Path(f"{stem}.md").write_text(md)
    plot(run, reference, dc, mbit, doc["command"], Path(f"{stem}.png"))
    return md


if __name__ == "__main__":
    main()
