"""The tenant CLI (`cpn quote|submit|jobs|job|cancel|usage`) and the Python client's job methods.

The CLI runs as a real `cpn` process against a real server; it runs on SQLite only to keep the
suite short (the API under it is tested on both backends in test_jobs_api.py). The client's
methods run on both backends.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy import insert

from api.client import ApiError, Client
from controller.jobs.lifecycle import transition
from controller.network.allocations import Slot, reserve
from controller.store.db import make_engine, make_sessionmaker
from controller.store.models import Job, JobEvent, JobLog, JobMetric
from tests.conftest import start_server
from tests.service.conftest import Network, build_network, spec

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def priced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Network]:
    """The priced three-cluster network of conftest on SQLite, served once for this module."""
    from controller.store.migrate import upgrade

    url = f"sqlite:///{tmp_path_factory.mktemp('cli-db') / 'cpn.db'}"
    upgrade(url)
    live = start_server(database_url=url, quote_ttl_s=600.0, run_controller=False)
    network = build_network(live)
    yield network
    for c in (network.admin, network.tenant, network.other):
        c.close()
    live.stop()


@pytest.fixture
def net(priced: Network) -> Iterator[Network]:
    """Two fresh tenants on the shared network, so each test starts with no jobs and no usage."""
    admin = priced.admin
    suffix = uuid.uuid4().hex[:8]
    a = admin.post("/v1/tenants", {"name": f"acme-{suffix}", "gpu_quota": 20, "budget": 10_000})
    b = admin.post("/v1/tenants", {"name": f"globex-{suffix}"})
    live = priced.server
    ta, tb = (live.client(admin.create_api_key("tenant", t["id"])["token"]) for t in (a, b))
    yield Network(live, admin, a["id"], ta, b["id"], tb)
    ta.close()
    tb.close()


def token_of(client: Client) -> str:
    return client._http.headers["Authorization"].removeprefix("Bearer ")


def cli_env(net: Network, client: Client) -> dict[str, str]:
    url, token = net.server.url, token_of(client)
    return {**os.environ, "CPN_URL": url, "CPN_TOKEN": token, "COLUMNS": "200"}


def cpn(net: Network, client: Client, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "api.cli", *map(str, args)],
        env=cli_env(net, client),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def write_spec(path: Path, **overrides: Any) -> Path:
    body = spec(**overrides)
    path.write_text(json.dumps(body) if path.suffix == ".json" else yaml.safe_dump(body))
    return path


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


def test_quote_then_submit_holding_its_price(net: Network, tmp_path: Path) -> None:
    job_file = write_spec(tmp_path / "job.yaml")
    shown = cpn(net, net.tenant, "quote", job_file)
    assert shown.returncode == 0, shown.stderr
    assert "Quote " in shown.stdout and "hold this price: cpn submit" in shown.stdout
    got = cpn(net, net.tenant, "quote", job_file, "--json")
    assert got.returncode == 0, got.stderr
    quote = json.loads(got.stdout)
    assert [o["objective"] for o in quote["options"]] == ["time", "cost"]
    cost = quote["options"][1]["price"]["total"]

    done = cpn(
        net, net.tenant, "submit", job_file, "--quote", quote["id"], "--option", "cost", "--json"
    )
    assert done.returncode == 0, done.stderr
    job = json.loads(done.stdout)
    assert job["state"] == "PENDING" and job["quote_id"] == quote["id"]
    assert job["held_price"]["price"]["total"] == cost
    assert net.tenant.get(f"/v1/quotes/{quote['id']}")["id"] == quote["id"]


def test_resubmit_with_the_same_key_returns_the_same_job(net: Network, tmp_path: Path) -> None:
    job_file = write_spec(tmp_path / "job.json")
    first = cpn(net, net.tenant, "submit", job_file, "--idempotency-key", "retry-1")
    assert first.returncode == 0, first.stderr
    assert "PENDING" in first.stdout and "retry-1" in first.stdout
    again = cpn(net, net.tenant, "submit", job_file, "--idempotency-key", "retry-1", "--json")
    assert again.returncode == 0, again.stderr
    job_id = json.loads(again.stdout)["id"]
    assert first.stdout.split()[1] == job_id
    assert [j.id for j in net.tenant.jobs()] == [job_id]
    # Without a key each run is a new job (its own generated key).
    fresh = cpn(net, net.tenant, "submit", job_file, "--json")
    assert fresh.returncode == 0 and json.loads(fresh.stdout)["id"] != job_id
    assert len(net.tenant.jobs()) == 2
    # The same key with another body is refused by the server: one line, exit 1.
    other = cpn(
        net,
        net.tenant,
        "submit",
        write_spec(tmp_path / "b.yaml", steps=7),
        "--idempotency-key",
        "retry-1",
    )
    assert other.returncode == 1
    line = one_line(other.stderr)
    assert line.startswith("cpn submit: error: 422 ") and "Idempotency-Key" in line


def test_jobs_job_and_cancel(net: Network) -> None:
    a = net.tenant.submit(spec(name="alpha"))
    b = net.tenant.submit(spec(name="beta", gpus=None, min_gpus=2, max_gpus=4))
    table = cpn(net, net.tenant, "jobs")
    assert table.returncode == 0, table.stderr
    assert table.stdout.index(b.id) < table.stdout.index(a.id)  # newest first
    assert "beta" in table.stdout and "2-4" in table.stdout

    cancelled = cpn(net, net.tenant, "cancel", a.id)
    assert cancelled.returncode == 0, cancelled.stderr
    assert cancelled.stdout.startswith(f"job {a.id} CANCELLED")
    assert net.tenant.job(a.id).state == "CANCELLED"
    only = cpn(net, net.tenant, "jobs", "--state", "cancelled", "--json")
    assert [j["id"] for j in json.loads(only.stdout)] == [a.id]
    as_yaml = cpn(net, net.tenant, "jobs", "--state", "cancelled", "-o", "yaml")
    assert as_yaml.returncode == 0 and yaml.safe_load(as_yaml.stdout) == json.loads(only.stdout)
    as_json = cpn(net, net.tenant, "jobs", "--state", "cancelled", "-o", "json")
    assert json.loads(as_json.stdout) == json.loads(only.stdout)
    wide = cpn(net, net.tenant, "jobs", "-o", "wide")  # kubectl's: more columns, ids whole
    assert wide.returncode == 0, wide.stderr
    assert "attempts" in wide.stdout and "placement" in wide.stdout
    xml = cpn(net, net.tenant, "jobs", "-o", "xml")
    assert xml.returncode == 2 and one_line(xml.stderr) == (
        "cpn jobs: error: --output: 'xml': use table, wide, json or yaml"
    )

    shown = cpn(net, net.tenant, "job", a.id, "--json")
    assert shown.returncode == 0, shown.stderr
    detail = json.loads(shown.stdout)
    assert detail["job"]["state"] == "CANCELLED"
    assert [e["to_state"] for e in detail["events"]] == ["PENDING", "CANCELLED"]
    short = cpn(net, net.tenant, "job", a.id[:8], "--json")  # the id as the table prints it
    assert short.returncode == 0, short.stderr
    assert json.loads(short.stdout) == detail
    last = cpn(net, net.tenant, "job", a.id, "--events", "1")
    assert "alpha" in last.stdout and "PENDING -> CANCELLED" in last.stdout
    assert "- -> PENDING" not in last.stdout  # only the most recent event

    twice = cpn(net, net.tenant, "cancel", a.id)
    assert twice.returncode == 1 and one_line(twice.stderr).startswith("cpn cancel: error: 409 ")
    # Another tenant neither sees nor cancels it: a 404, the same as a job that does not exist.
    hidden = cpn(net, net.other, "cancel", b.id)
    assert hidden.returncode == 1 and one_line(hidden.stderr).startswith("cpn cancel: error: 404 ")
    hidden = cpn(net, net.other, "cancel", b.id[:8])
    assert hidden.returncode == 1 and one_line(hidden.stderr).startswith("cpn cancel: error: 404 ")
    assert net.tenant.job(b.id).state == "PENDING"


def test_logs_prints_a_jobs_lines(net: Network) -> None:
    """`cpn logs JOB`: every line, `--tail N` the last N, `--worker` one worker's, `--json`
    one object a line, `-f` follows until the job has ended (here: already cancelled)."""
    job = net.tenant.submit(spec(name="chatty"))
    rows = [
        {"job_id": job.id, "at": datetime.now(UTC), "source": f"a/{i % 2}", "stream": "stdout"}
        | {"text": f"hello {i}"}
        for i in range(4)
    ]
    with make_sessionmaker(make_engine(net.server.database_url))() as s, s.begin():
        s.execute(insert(JobLog), rows)
    every = cpn(net, net.tenant, "logs", job.id[:8])
    assert every.returncode == 0, every.stderr
    assert [line.split(" | ")[1] for line in every.stdout.splitlines()] == [
        f"hello {i}" for i in range(4)
    ]
    assert " a/1 | hello 1" in every.stdout
    tail = cpn(net, net.tenant, "logs", job.id, "--tail", "2", "--worker", "a/0", "--json")
    assert [json.loads(x)["text"] for x in tail.stdout.splitlines()] == ["hello 0", "hello 2"]
    net.tenant.cancel(job.id)
    followed = cpn(net, net.tenant, "logs", job.id, "-f", "--tail", "1")
    assert followed.returncode == 0 and followed.stdout.splitlines()[-1].endswith("hello 3")
    ended = cpn(net, net.tenant, "job", job.id[:8], "-f", "--json")  # follows it to its end
    assert ended.returncode == 4, ended.stderr  # CANCELLED, as submit --wait exits
    assert json.loads(ended.stdout)["job"]["state"] == "CANCELLED"
    hidden = cpn(net, net.other, "logs", job.id)
    assert hidden.returncode == 1 and one_line(hidden.stderr).startswith("cpn logs: error: 404 ")


def test_usage_matches_the_ledger(net: Network, tmp_path: Path) -> None:
    none_yet = cpn(net, net.tenant, "usage")
    assert none_yet.returncode == 2 and "--tenant" in one_line(none_yet.stderr)
    admin_needs_tenant = cpn(net, net.admin, "usage")
    assert admin_needs_tenant.returncode == 2 and "--tenant" in one_line(admin_needs_tenant.stderr)

    job = net.tenant.submit(spec(gpus=4))
    engine = make_engine(net.server.database_url)
    with make_sessionmaker(engine)() as s, s.begin():  # what the scheduler would reserve
        row = s.get(Job, job.id)
        assert row is not None
        reserve(s, row, [Slot("us-east", "A100", 3), Slot("eu-west", "H100", 1)])
        transition(s, row, "SCHEDULED", "placed")
        transition(s, row, "RUNNING", "launched")  # billed from here on
    engine.dispose()
    time.sleep(0.5)  # the job runs on its GPUs for a measurable while before it is cancelled
    assert cpn(net, net.tenant, "cancel", job.id).returncode == 0  # meters and prices it

    mine = cpn(net, net.tenant, "usage", "--json")
    assert mine.returncode == 0, mine.stderr
    data = json.loads(mine.stdout)
    assert data["usage"]["tenant_id"] == net.tenant_id
    assert data["usage"]["gpu_seconds"] >= 4 * 0.5
    from decimal import Decimal

    entries = data["ledger"]["entries"]
    assert {e["job_id"] for e in entries} == {job.id} and len(entries) == 2
    assert Decimal(data["ledger"]["total"]) == sum(Decimal(e["amount"]) for e in entries) > 0
    as_admin = json.loads(cpn(net, net.admin, "usage", "--tenant", net.tenant_id, "--json").stdout)
    assert as_admin == data
    table = cpn(net, net.tenant, "usage")
    assert table.returncode == 0 and data["ledger"]["total"] in table.stdout
    other = cpn(net, net.other, "usage", "--tenant", net.tenant_id)
    assert other.returncode == 1 and one_line(other.stderr).startswith("cpn usage: error: 404 ")


BAD_FILES = [
    ("missing.yaml", None, "cannot read"),
    ("job.yaml", "name: [unclosed\n", "not valid YAML"),
    ("job.json", "{'name': 1}", "not valid JSON"),
    ("job.yaml", "- name: x\n", "a job spec is a mapping"),
    ("job.yaml", "name: x\ntask: builtin:mnist1d-mlp\ngpus: 0\nsteps: 5\n", "gpus: "),
    ("job.yaml", "name: x\ntask: builtin:mnist1d-mlp\ngpus: 2\n", "steps: required"),
    ("job.yaml", "name: x\ntask: builtin:x\ngpus: 2\nsteps: 5\ngpu: 3\n", "gpu: unknown field"),
    (
        "job.yaml",
        "name: x\ntask: nope\ngpus: 2\nsteps: 5\nqos: {qos_class: gold}\n",
        "qos.qos_class: ",
    ),
    ("job.yaml", "name: x\ntask: builtin:x\nmin_gpus: 2\nsteps: 5\n", "spec: give gpus"),
]


@pytest.mark.parametrize(("name", "content", "says"), BAD_FILES)
def test_bad_files_get_one_line_and_exit_2(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    content: str | None,
    says: str,
) -> None:
    """The CLI's entry point in this process: the file is refused before any request (the URL
    goes nowhere, so reaching the network would exit 1, not 2)."""
    from api.cli import main

    monkeypatch.setenv("CPN_URL", "http://127.0.0.1:9")
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    for cmd in ("quote", "submit"):
        with pytest.raises(SystemExit) as exit_:
            main([cmd, str(path)])
        assert exit_.value.code == 2
        line = one_line(capsys.readouterr().err)
        assert line.startswith(f"cpn {cmd}: error: {path}: ") and says in line, line


def test_bad_file_as_a_process(net: Network, tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("name: x\ntask: builtin:mnist1d-mlp\ngpus: -1\nsteps: 0\n")
    done = cpn(net, net.tenant, "submit", path)
    assert done.returncode == 2 and done.stdout == ""
    line = one_line(done.stderr)
    assert "gpus: Input should be greater than or equal to 1" in line and "steps: " in line
    assert net.tenant.jobs() == []


def test_api_refusals_get_one_line_and_exit_1(net: Network, tmp_path: Path) -> None:
    nowhere = write_spec(tmp_path / "job.yaml", qos={"regions": ["mars"]})
    done = cpn(net, net.tenant, "quote", nowhere)
    assert done.returncode == 1
    line = one_line(done.stderr)
    assert line.startswith("cpn quote: error: 422 ") and "qos.regions" in line, line
    denied = subprocess.run(
        [sys.executable, "-m", "api.cli", "jobs"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**cli_env(net, net.tenant), "CPN_TOKEN": "cpn_tenant_wrong"},
        timeout=60,
    )
    assert denied.returncode == 1 and one_line(denied.stderr).startswith("cpn jobs: error: 401 ")
    down = subprocess.run(
        [sys.executable, "-m", "api.cli", "jobs", "--url", "http://127.0.0.1:9"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=cli_env(net, net.tenant),
        timeout=60,
    )
    assert down.returncode == 1 and "cannot reach http://127.0.0.1:9" in one_line(down.stderr)


def start_waiting(net: Network, job_file: Path) -> tuple[subprocess.Popen[str], str]:
    """`cpn submit --wait` in the background, and the id of the job it submitted."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "api.cli", "submit", str(job_file), "--wait"],
        env=cli_env(net, net.tenant),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    if not ready:
        proc.kill()
        pytest.fail("cpn submit --wait printed nothing within 60 s")
    line = proc.stdout.readline()
    assert line.startswith("job "), line + (proc.stderr.read() if proc.stderr else "")
    return proc, line.split()[1]


def finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"cpn submit --wait did not end: {out} {err}")
    return proc.returncode, out, err


def test_submit_wait_exits_non_zero_when_another_client_cancels(
    net: Network, tmp_path: Path
) -> None:
    proc, job_id = start_waiting(net, write_spec(tmp_path / "job.yaml"))
    net.admin.cancel(job_id)
    code, _, err = finish(proc)
    assert code == 4, err
    assert f"cpn submit: job {job_id} CANCELLED: cancelled by admin" in err.splitlines()[-1]


def test_submit_wait_follows_progress_to_success(net: Network, tmp_path: Path) -> None:
    proc, job_id = start_waiting(net, write_spec(tmp_path / "job.yaml", steps=40))
    engine = make_engine(net.server.database_url)
    sessions = make_sessionmaker(engine)
    # The launcher and workers are not part of this test: their writes are made here, through
    # the controller's own state machine and tables.
    with sessions() as s, s.begin():
        job = s.get(Job, job_id)
        assert job is not None
        transition(s, job, "SCHEDULED", "placed on us-east")
        transition(s, job, "RUNNING", "workers started")
    for step in (10, 20, 30, 40):
        with sessions() as s, s.begin():
            data = {"step": step, "steps": 40, "loss": 1 / step}
            s.add(JobEvent(job_id=job_id, kind="progress", message="", data=data))
            s.add(JobMetric(job_id=job_id, step=step, loss=1 / step, wan_bytes=step * 1000))
    with sessions() as s, s.begin():
        job = s.get(Job, job_id)
        assert job is not None
        transition(s, job, "SUCCEEDED", "all steps done")
    engine.dispose()
    code, _, err = finish(proc)
    assert code == 0, err
    states = [line.split()[1].rstrip(":") for line in err.splitlines() if line[:2].isdigit()]
    assert states == ["PENDING", "SCHEDULED", "RUNNING", "SUCCEEDED"], err
    assert "40/40" in err
    assert [m.step for m in net.tenant.metrics(job_id)] == [10, 20, 30, 40]


# ---- the client, on both backends --------------------------------------------------------


def test_client_job_methods(network: Network) -> None:
    client = network.tenant
    with pytest.raises(LookupError, match="no jobs yet"):
        client.tenant_id()
    with pytest.raises(LookupError, match="admin"):
        network.admin.tenant_id()
    quote = client.quote(spec())
    assert quote.options and quote.expires_at > quote.created_at
    from wire.spec import JobSpec

    job = client.submit(JobSpec.model_validate(spec(quote_id=quote.id)), "key-1")
    assert client.submit(spec(quote_id=quote.id), "key-1").id == job.id
    assert client.tenant_id() == network.tenant_id
    assert [j.id for j in client.jobs(state="PENDING")] == [job.id]
    assert client.jobs(state="RUNNING") == []
    second = client.submit(spec(name="second"))
    assert [j.id for j in client.jobs(limit=1)] == [second.id]
    with pytest.raises(ApiError) as stale:
        client.cancel(job.id, version=job.version + 1)
    assert stale.value.status == 412
    assert client.cancel(job.id, version=job.version).state == "CANCELLED"
    events = list(client.events(job.id))  # ends by itself: the job has ended
    assert [(e["kind"], e["to_state"]) for e in events] == [
        ("state", "PENDING"),
        ("state", "CANCELLED"),
    ]
    assert [e["id"] for e in client.events(job.id, after=events[0]["id"])] == [events[1]["id"]]
    assert client.metrics(job.id) == []
    assert client.usage()["tenant_id"] == network.tenant_id
    ledger = client.ledger()
    assert ledger["tenant_id"] == network.tenant_id and ledger["total"] == "0.000000"
    prices = client.pricing()
    assert {g["cluster"] for g in prices["gpu"]} == {"us-east", "eu-west", "ap-south"}
    with pytest.raises(ApiError) as hidden:
        list(network.other.events(job.id))
    assert hidden.value.status == 404


def test_client_submit_to_an_unreachable_server_raises() -> None:
    with Client("http://127.0.0.1:9", "cpn_tenant_x", timeout=2) as client:
        started = datetime.now(UTC)
        with pytest.raises(ApiError) as exc:
            client.submit(spec(), retries=1)
    assert exc.value.status == 0 and "cannot reach" in exc.value.detail
    assert (datetime.now(UTC) - started).total_seconds() >= 0.2  # it did retry once
