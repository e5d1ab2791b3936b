"""The outer step's momentum under local SGD on shared data: which default holds up.

Trains each task on 3 clusters x 2 workers (local Ray, no WAN emulation: quality only),
local SGD with period H, uncompressed, under outer (lr, momentum) pairs, and prints the
training loss and accuracy at a third, two thirds and the end. Run alone on the machine:

    .venv/bin/python -m bench.outer_momentum [--no-save]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
CLUSTERS = {"a": 2, "b": 2, "c": 2}
CASES: tuple[tuple[str, int, tuple[int, ...]], ...] = (
    ("builtin:mnist1d-mlp", 600, (4, 10, 32)),
    ("builtin:char-transformer", 300, (10, 32)),
)
SETTINGS = ((0.7, 0.9), (0.7, 0.5), (1.0, 0.0))


def run_one(task: str, steps: int, period: int, lr: float, momentum: float) -> dict[str, Any]:
    import training
    from training import TrainSpec

    seen: list[tuple[int, float, float | None]] = []
    spec = TrainSpec(
        task=task,
        clusters=dict(CLUSTERS),
        steps=steps,
        sync=f"local-sgd:{period}",
        compression="none",
        eval_every=steps // 3,
        outer_lr=lr,
        outer_momentum=momentum,
    )
    report = training.run(spec, on_progress=lambda p: seen.append((p.step, p.loss, p.accuracy)))
    return {
        "task": task,
        "steps": steps,
        "period": period,
        "outer_lr": lr,
        "outer_momentum": momentum,
        "points": seen,
        "final_accuracy": report.final_accuracy,
        "best_accuracy": report.best_accuracy,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)
    import ray

    from training.runner import local_resources

    rows = []
    ray.init(
        num_cpus=4,
        resources=local_resources(CLUSTERS),
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        for task, steps, periods in CASES:
            for period in periods:
                for lr, momentum in SETTINGS if task.endswith("mlp") else SETTINGS[:2]:
                    rows.append(run_one(task, steps, period, lr, momentum))
                    print(json.dumps(rows[-1]), flush=True)
    finally:
        ray.shutdown()
    lines = [
        "# The outer step's momentum under local SGD (shared data)",
        "",
        f"`.venv/bin/python -m bench.outer_momentum`, {time.strftime('%Y-%m-%d')}, on 2 CPU "
        "cores, nothing beside it. 3 clusters x 2 workers on a local Ray (no WAN emulation: "
        "quality only), `local-sgd:H`, uncompressed, seed 0, outer SGD with Nesterov "
        "momentum. Loss: the training loss of the steps before each report; accuracy: the "
        "evaluation's. Chance: 0.10 (mnist1d), loss ln 10 = 2.30.",
        "",
        "| task | steps | H | outer lr | outer momentum | loss / accuracy at 1/3 | at 2/3 "
        "| at the end | accuracy of the best (by eval loss) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [f"{loss:.3f} / {acc:.3f}" for _, loss, acc in r["points"][:3]]
        lines.append(
            f"| {r['task'].split(':')[1]} | {r['steps']} | {r['period']} | {r['outer_lr']} | "
            f"{r['outer_momentum']} | " + " | ".join(cells) + f" | {r['best_accuracy']:.3f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_save:
        (RESULTS / "outer-momentum.md").write_text(text)
        (RESULTS / "outer-momentum.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
