"""The control loop end to end: REST submission -> placement -> Ray actors -> SUCCEEDED,
and the failures it must survive. Real `cpn serve`, real `cpn agent`s, real Ray."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from controller.store.db import make_engine
from controller.store.models import StepObservation
from tests.e2e.world import World, build_world, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    """A world of its own, for tests that kill a part of it."""
    w = build_world(tmp_path)
    yield w
    w.stop()


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """One world (and one Ray) for the tests that leave it whole: each ends with no GPU held.
    Its admin allows `module:function` tasks under tests.e2e (none are by default). Its
    control plane runs two worker processes (`cpn serve --workers 2`), so every request of
    these tests may land on either, and the controller runs in the one that holds the loops."""
    w = build_world(tmp_path_factory.mktemp("shared"), workers=2, CPN_TASK_MODULES="tests.e2e")
    yield w
    w.stop()


def submit(world: World, **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": "mlp",
        "task": "builtin:mnist1d-mlp",
        "gpus": 2,
        "steps": 60,
        "compression": "topk:0.1",
        "sync": "every-step",
    }
    spec.update(overrides)
    return dict(world.tenant.post("/v1/jobs", spec))


def test_submit_runs_to_success_with_events_metrics_and_ledger(shared: World) -> None:
    world = shared
    job = submit(world, gpus=4, steps=60)
    done = world.wait_state(job["id"], {"SUCCEEDED", "FAILED"}, 240)
    assert done["state"] == "SUCCEEDED", world.admin.get(f"/v1/jobs/{job['id']}/events")
    assert world.states(job["id"]) == ["PENDING", "SCHEDULED", "RUNNING", "SUCCEEDED"]
    clusters = done["placement"]["clusters"]
    assert sum(c["gpus"] for c in clusters) == 4 and len(clusters) >= 2
    metrics = list(world.tenant.paginate(f"/v1/jobs/{job['id']}/metrics"))
    assert metrics and metrics[-1]["step"] == 60 and metrics[-1]["wan_bytes"] > 0
    assert world.gpus_in_use() == 0
    # calibration data: each placed cluster's compute time, under its own GPU model
    engine = make_engine(world.plane.env["CPN_DATABASE_URL"])
    try:
        with engine.connect() as conn:
            observed = set(
                conn.scalars(
                    select(StepObservation.gpu_model).where(StepObservation.job_id == job["id"])
                )
            )
    finally:
        engine.dispose()
    assert observed == {c["gpu_model"] for c in clusters}
    # Ledger = metered usage x prices, recomputed here from the public usage and pricing views.
    usage = world.tenant.get(f"/v1/tenants/{world.tenant_id}/usage")
    ledger = world.tenant.get(f"/v1/tenants/{world.tenant_id}/ledger")
    prices = {
        p["cluster"]: Decimal(str(p["price_per_gpu_hour"]))
        for p in world.tenant.get("/v1/pricing")["gpu"]
        if p["qos_class"] == "standard"
    }
    egress = {
        (p["src"], p["dst"]): Decimal(str(p["price_per_gb"]))
        for p in world.tenant.get("/v1/pricing")["egress"]
    }
    gpu_rows = [r for r in usage["rows"] if r["kind"] == "gpu_seconds"]
    wan_rows = [r for r in usage["rows"] if r["kind"] == "wan_bytes"]
    assert {r["cluster"] for r in gpu_rows} == {c["cluster"] for c in clusters}
    assert wan_rows, "WAN bytes were metered from the workers' reports"
    entries = ledger["items"]
    assert Decimal(ledger["total"]) == sum(Decimal(e["amount"]) for e in entries)
    for e in entries:
        if e["kind"] == "gpu":
            cluster = e["description"].split(" on ")[1].split(" ")[0]
            assert Decimal(e["unit_price"]) == prices[cluster]
        else:
            src, dst = e["description"].removeprefix("WAN ").split(" -> ")
            assert Decimal(e["unit_price"]) == egress[(src, dst)]
    assert Decimal(ledger["total"]) > 0


def test_agent_killed_mid_job_reschedules_and_resumes(world: World) -> None:
    # A mode that cannot shrink in place (bounded staleness keeps exchanges in flight), so a
    # lost cluster restarts the run from its checkpoint on what is left.
    # Killed after its first checkpoints (every tenth of the run, 45 steps) with ~390 steps
    # (~20 s at the emulated links' ~50 ms a step) left: it outlives the lost lease (grace
    # 3 s) by several times, so the move is observable and resumes from a real checkpoint.
    job = submit(world, gpus=4, steps=450, compression="none", sync="stale:2")
    running = world.wait_state(job["id"], {"RUNNING"}, 120)
    victim = running["placement"]["clusters"][0]["cluster"]
    wait_for(
        lambda: (
            world.job(job["id"]).get("placement")
            and any(m["step"] >= 60 for m in world.tenant.paginate(f"/v1/jobs/{job['id']}/metrics"))
        ),
        120,
        "progress past the first checkpoint",
    )
    world.agents[victim].kill(signal.SIGKILL)
    world.wait_state(job["id"], {"RESCHEDULING", "SCHEDULED", "RUNNING"}, 60)
    wait_for(lambda: "RESCHEDULING" in world.states(job["id"]), 60, "RESCHEDULING")
    done = world.wait_state(job["id"], {"SUCCEEDED", "FAILED"}, 300)
    assert done["state"] == "SUCCEEDED", list(world.admin.paginate(f"/v1/jobs/{job['id']}/events"))
    states = world.states(job["id"])
    assert states[:3] == ["PENDING", "SCHEDULED", "RUNNING"]
    assert "RESCHEDULING" in states and states[-1] == "SUCCEEDED"
    after = states.index("RESCHEDULING")
    assert states[after + 1 : after + 3] == ["SCHEDULED", "RUNNING"]
    assert victim not in {c["cluster"] for c in done["placement"]["clusters"]}
    messages = [e["message"] for e in world.admin.paginate(f"/v1/jobs/{job['id']}/events")]
    assert any("resuming from checkpoint" in m for m in messages)
    assert any(f"cluster {victim} is DOWN" in m for m in messages)
    assert world.gpus_in_use() == 0


def test_agent_killed_mid_diloco_job_shrinks_and_grows_back(world: World) -> None:
    """Datacenter fault domains through the real control plane: DiLoCo on all three
    clusters; one agent SIGKILLed: its lease lapses, the cluster goes DOWN and leaves the run,
    which goes on on two without a restart (the job never leaves RUNNING, no checkpoint is
    read); the agent comes back, the cluster is READY and joins again, taking the model from
    a peer. Its GPUs are billed for the time it was in the run only."""
    # long enough that the returning cluster's workers start, load and join well before the
    # end (900 steps, 14 s here, once ended first and the join was never seen)
    job = submit(world, gpus=6, steps=2400, compression="none", sync="local-sgd:10")
    running = world.wait_state(job["id"], {"RUNNING"}, 120)
    assert len(running["placement"]["clusters"]) == 3
    victim = running["placement"]["clusters"][-1]["cluster"]

    def events() -> list[str]:
        return [e["message"] for e in world.admin.paginate(f"/v1/jobs/{job['id']}/events")]

    def step() -> int:
        rows = list(world.tenant.paginate(f"/v1/jobs/{job['id']}/metrics"))
        return int(rows[-1]["step"]) if rows else 0

    wait_for(lambda: step() >= 60, 120, "progress")
    world.agents[victim].kill(signal.SIGKILL)
    wait_for(lambda: any(f"cluster {victim} went DOWN" in m for m in events()), 60, "shrink")
    at_shrink = step()
    shrunk = world.job(job["id"])["placement"]  # the plan follows: re-estimated on two
    assert victim not in {c["cluster"] for c in shrunk["clusters"]}, shrunk
    assert any(m.startswith("plan updated") for m in events())
    wait_for(lambda: step() >= at_shrink + 60, 120, "progress on two clusters")
    assert world.job(job["id"])["state"] == "RUNNING"
    world.start_agent(victim)
    wait_for(lambda: any(f"cluster {victim} joined" in m for m in events()), 120, "rejoin")
    done = world.wait_state(job["id"], {"SUCCEEDED", "FAILED"}, 300)
    assert done["state"] == "SUCCEEDED", events()
    assert world.states(job["id"]) == ["PENDING", "SCHEDULED", "RUNNING", "SUCCEEDED"]
    messages = events()
    assert not any("resuming from checkpoint" in m for m in messages), messages
    assert sum(m.startswith("plan updated") for m in messages) == 2, messages
    grown = world.job(job["id"])["placement"]
    assert {c["cluster"] for c in grown["clusters"]} == {
        c["cluster"] for c in running["placement"]["clusters"]
    }
    final = [e for e in world.admin.paginate(f"/v1/jobs/{job['id']}/events") if e["to_state"]]
    membership = final[-1]["data"]["report"]["membership"]  # what the demo shows
    changes = [(m["cluster"], m["change"]) for m in membership if m["change"] != "refused"]
    # local SGD seats the returning cluster at the round's end: the event says from when
    assert changes == [(victim, "left"), (victim, "joined"), (victim, "seated")], membership
    seated = membership[-1]["step"]
    assert any(f"cluster {victim} trains from step {seated}" in m for m in messages), messages
    said = [x["text"] for x in world.tenant.paginate(f"/v1/jobs/{job['id']}/logs")]
    assert any(f"cluster {victim} left" in t for t in said), said  # the driver's, in the log
    assert world.gpus_in_use() == 0
    usage = world.tenant.get(f"/v1/tenants/{world.tenant_id}/usage")["rows"]
    gpu_s: dict[str, float] = {}
    for r in usage:
        if r["kind"] == "gpu_seconds":  # this world ran this job only
            gpu_s[r["cluster"]] = gpu_s.get(r["cluster"], 0.0) + float(r["quantity"])
    others = [v for c, v in gpu_s.items() if c != victim]
    assert set(gpu_s) == {c["cluster"] for c in running["placement"]["clusters"]}
    assert gpu_s[victim] < min(others)  # not billed while it was out of the run


def test_cancel_stops_workers_and_releases_gpus(shared: World) -> None:
    world = shared
    job = submit(world, gpus=2, steps=5000, compression="none")
    world.wait_state(job["id"], {"RUNNING"}, 120)
    wait_for(lambda: list(world.tenant.paginate(f"/v1/jobs/{job['id']}/metrics")), 120, "progress")
    cancelled = world.tenant.post(f"/v1/jobs/{job['id']}/cancel")
    assert cancelled["state"] == "CANCELLED"
    assert world.gpus_in_use() == 0
    wait_for(
        lambda: any(
            e["message"] == "workers stopped"
            for e in world.admin.paginate(f"/v1/jobs/{job['id']}/events")
        ),
        60,
        "workers stopped",
    )
    last_step = max(m["step"] for m in world.tenant.paginate(f"/v1/jobs/{job['id']}/metrics"))
    assert last_step < 5000
    assert world.states(job["id"]) == ["PENDING", "SCHEDULED", "RUNNING", "CANCELLED"]


def test_failing_entrypoint_ends_failed_with_the_error(shared: World) -> None:
    world = shared
    job = submit(
        world, task="tests.e2e.bad_task:explode", work={"params": 1000, "flops_per_step": 1e9}
    )
    done = world.wait_state(job["id"], {"FAILED", "SUCCEEDED"}, 240)
    assert done["state"] == "FAILED"
    errors = [
        e for e in world.admin.paginate(f"/v1/jobs/{job['id']}/events") if e["kind"] == "error"
    ]
    assert errors and "deliberately broken task" in errors[-1]["message"]
    assert world.gpus_in_use() == 0


def test_a_jobs_log_holds_what_its_workers_printed(shared: World) -> None:
    """Issue 51: each worker's stdout and stderr lines reach the job's log (`cpn logs`)."""
    world = shared
    job = submit(
        world,
        task="tests.e2e.entry_tasks:chatty",
        gpus=2,
        steps=20,
        work={"params": 20_000, "flops_per_step": 1e9},
    )
    done = world.wait_state(job["id"], {"FAILED", "SUCCEEDED"}, 240)
    assert done["state"] == "SUCCEEDED", done
    lines = list(world.tenant.paginate(f"/v1/jobs/{job['id']}/logs"))
    for cluster in (c["cluster"] for c in done["placement"]["clusters"]):
        mine = [x for x in lines if x["source"].startswith(f"{cluster}/")]
        assert any(x["stream"] == "stdout" and "chatty: loaded" in x["text"] for x in mine), lines
        assert any(x["stream"] == "stderr" and "a line on stderr" in x["text"] for x in mine)


def test_tenant_code_cannot_see_the_control_planes_secrets(shared: World) -> None:
    """`cpn serve` runs with CPN_ADMIN_TOKEN and CPN_DATABASE_URL in its environment and starts
    the embedded Ray; the tenant's code reports what it sees through its error."""
    world = shared
    assert world.plane.env["CPN_ADMIN_TOKEN"]
    job = submit(
        world,
        task="tests.e2e.entry_tasks:look_around",
        work={"params": 1000, "flops_per_step": 1e9},
    )
    done = world.wait_state(job["id"], {"FAILED", "SUCCEEDED"}, 240)
    assert done["state"] == "FAILED"
    errors = [
        e["message"]
        for e in world.tenant.paginate(f"/v1/jobs/{job['id']}/events")
        if e["kind"] == "error"
    ]
    assert errors, done
    assert "admin token absent; database url absent" in errors[-1]
    assert "parent environment lacks the token" in errors[-1]
    assert world.plane.admin_token not in errors[-1] and len(errors[-1]) <= 2048


def test_preemption_checkpoints_victim_and_resumes_it(shared: World) -> None:
    world = shared
    low = submit(
        world,
        name="low",
        gpus=6,
        steps=250,  # preempted at step ~70 with ~180 steps (~14 s) to go
        compression="none",
        qos={"qos_class": "spot", "priority": 0},
    )
    world.wait_state(low["id"], {"RUNNING"}, 120)
    wait_for(
        lambda: any(
            m["step"] >= 70 for m in world.tenant.paginate(f"/v1/jobs/{low['id']}/metrics")
        ),
        120,
        "low progress",
    )
    # Priority is granted, not chosen: the admin grants 10 before the tenant may ask for it.
    world.admin.request("PATCH", f"/v1/tenants/{world.tenant_id}", json={"priority_ceiling": 10})
    high = submit(
        world,
        name="high",
        gpus=2,
        steps=20,
        compression="none",
        qos={"qos_class": "standard", "priority": 10},
    )
    done_high = world.wait_state(high["id"], {"SUCCEEDED", "FAILED"}, 300)
    assert done_high["state"] == "SUCCEEDED"
    done_low = world.wait_state(low["id"], {"SUCCEEDED", "FAILED"}, 400)
    assert done_low["state"] == "SUCCEEDED"
    states = world.states(low["id"])
    assert states == [
        "PENDING",
        "SCHEDULED",
        "RUNNING",
        "PENDING",
        "SCHEDULED",
        "RUNNING",
        "SUCCEEDED",
    ]
    messages = [e["message"] for e in world.admin.paginate(f"/v1/jobs/{low['id']}/events")]
    assert "preempted by a higher-priority job; checkpointed, resumes later" in messages
    assert not any(high["id"] in m for m in messages)  # it might be another tenant's job
    assert any("resuming from checkpoint" in m for m in messages)
    assert world.gpus_in_use() == 0


def test_controller_killed_mid_job_is_restarted_and_job_finishes(world: World) -> None:
    from api.processes import ProcessError, start_control_plane

    job = submit(world, gpus=2, steps=300, compression="none")
    world.wait_state(job["id"], {"RUNNING"}, 120)
    wait_for(
        lambda: any(
            m["step"] >= 45 for m in world.tenant.paginate(f"/v1/jobs/{job['id']}/metrics")
        ),
        120,
        "progress",
    )
    port = int(world.plane.url.rsplit(":", 1)[1])
    world.plane.proc.kill(signal.SIGKILL)
    world.plane.proc.popen.wait(10)

    def restart() -> Any:
        try:  # refused while the dead replica still counts as alive (its TTL), then accepted
            return start_control_plane(
                world.plane.env["CPN_DATABASE_URL"],
                world.plane.admin_token,
                settings=world.plane.env,
                port=port,
            )
        except ProcessError as exc:
            assert "another cpn serve" in str(exc)
            return None

    old_group = world.plane.proc.popen.pid
    world.plane = wait_for(restart, 60, "cpn serve to start again")
    try:
        done = world.wait_state(job["id"], {"SUCCEEDED", "FAILED"}, 300)
    finally:  # what a killed container would take with it: the dead server's Ray helpers
        with contextlib.suppress(ProcessLookupError):
            os.killpg(old_group, signal.SIGKILL)
    assert done["state"] == "SUCCEEDED"
    events = list(world.admin.paginate(f"/v1/jobs/{job['id']}/events"))
    assert [e["to_state"] for e in events if e["kind"] == "state"].count("SUCCEEDED") == 1
    assert any("adopted by replica" in e["message"] for e in events)
    assert any("resuming from checkpoint" in e["message"] for e in events)
    # Nothing ran twice: after the adoption, progress continues from the checkpoint and the
    # metrics never show two runs interleaving (steps only rise within each launch).
    steps = [e["data"]["step"] for e in events if e["kind"] == "progress"]
    assert steps[-1] == 300
    assert world.gpus_in_use() == 0
