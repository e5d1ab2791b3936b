"""The pure parts of bench.pipeline's testbed section (counter deltas, reading an older
results file, the markdown): no testbed, no Ray."""

from __future__ import annotations

from typing import Any

from bench.pipeline import LEGACY_COMMAND, load_results, markdown, uplink_delta

PLAN = {
    "reason": "2 stages over a -> b fit",
    "step_s": 0.5,
    "bubble": 0.1,
    "micro_batches": 8,
    "cuts": [2],
    "model_gb": 0.002,
    "declared_gb": 0.0019,
}
RUN = {
    "mode": "pipeline gpipe",
    "micro_batches": 8,
    "step_s": 0.25,
    "samples_per_s": 256.0,
    "bubble_schedule": 0.1,
    "idle_measured": 0.5,
    "wan_bytes": 1_000,
    "final_loss": 2.5,
}


def test_uplink_delta_counts_tx_of_each_datacenter() -> None:
    before = {"a": (100, 7), "b": (50, 9)}
    after = {"a": (1_100, 900), "b": (250, 900)}
    assert uplink_delta(before, after) == {"a": 1_000, "b": 200}


def test_an_older_results_list_becomes_the_emulated_section() -> None:
    doc = load_results([{"task": "t"}])
    assert doc["emulated"]["tasks"] == [{"task": "t"}]
    assert doc["emulated"]["command"] == LEGACY_COMMAND
    assert "testbed" not in doc
    kept = {"emulated": {"command": "x", "tasks": []}, "testbed": {"command": "y", "tasks": []}}
    assert load_results(kept) == kept


def test_markdown_puts_both_sections_with_their_commands() -> None:
    task = {"task": "builtin:t", "batch": 64, "steps": 4, "mbps": 100.0, "rtt_ms": 0.0}
    tb_runs = [
        {**RUN, "uplink_bytes_total": 123_456},
        {**RUN, "mode": "data parallel (fp32, every step)", "micro_batches": None,
         "bubble_schedule": None, "idle_measured": None, "uplink_bytes_total": 9},
        {"mode": "1f1b", "error": "boom"},
    ]  # fmt: skip
    doc = {
        "emulated": {"command": "CMD-E", "tasks": [{**task, "plan": PLAN, "runs": [RUN]}]},
        "testbed": {
            "command": "CMD-T",
            "idle_uplink_bytes_per_s": 10.0,
            "tasks": [{**task, "plan": PLAN, "runs": tb_runs}],
        },
    }
    md = markdown(doc)
    assert md.index("## Emulated links") < md.index("CMD-E") < md.index("## On the testbed")
    assert md.index("## On the testbed") < md.index("CMD-T")
    assert "2 CPU cores shared" in md
    testbed = md[md.index("## On the testbed") :]
    assert (
        "| pipeline gpipe | 8 | 0.2500 | 256.0 | 0.5000 | 10.0 % | 50.0 % | 123,456 | 1,000 |"
        in (testbed)
    )
    assert "| data parallel (fp32, every step) | - | 0.2500 | 256.0 | - | - | - | 9 | 1,000 |" in (
        testbed
    )
    assert "| 1f1b | FAILED: boom |" in testbed


def test_markdown_sets_the_calibrated_plan_beside_the_prior_one() -> None:
    """Planned against measured, on the prior micro-batch cost and on the fitted one."""
    task = {"task": "builtin:t", "batch": 64, "steps": 4, "mbps": 100.0, "rtt_ms": 20.0}
    fitted_plan: dict[str, Any] = {"step_s": 0.3, "micro_batches": 2, "cuts": [2]}
    calibrated: dict[str, Any] = {
        "prior_s": 0.005,
        "fitted_s": 0.04,
        "plan": fitted_plan,
        "run": {**RUN, "micro_batches": 2, "step_s": 0.32, "idle_measured": 0.2},
    }
    doc = {"emulated": {"command": "C", "tasks": [{**task, "plan": PLAN, "runs": [RUN],
                                                   "calibrated": calibrated}]}}  # fmt: skip
    md = markdown(doc)
    assert "| GPipe | prior | 5.0 | 8 | 0.5000 | 0.2500 | +100 % | 50.0 % |" in md
    fitted = "| GPipe | fitted from the prior plan's run | 40.0 | 2 | 0.3000 | 0.3200 | -6 % |"
    assert fitted in md
    assert "| 1F1B |" not in md  # kept before the 1F1B row was measured
    calibrated.update(plan_1f1b={**fitted_plan, "step_s": 0.6}, run_1f1b=RUN)
    md = markdown(doc)
    assert "| 1F1B | fitted from the prior plan's run | 40.0 | 2 | 0.6000 | 0.2500 | +140 % |" in md
