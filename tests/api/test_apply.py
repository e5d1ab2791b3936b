"""`cpn apply -f` and `cpn get`: declarative admin state over a real server.

The CLI runs in this process (`api.cli.main`) against a real uvicorn server; create and
apply-again run on SQLite and PostgreSQL, the rest on SQLite only (the REST calls under them
are the admin API's, tested on both backends in test_admin_api.py).
"""

from __future__ import annotations

import io
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml

from api.client import Client
from tests.conftest import LiveServer, clear_tables, start_server


@dataclass(frozen=True)
class Ran:
    code: int
    out: str
    err: str


@pytest.fixture(scope="module")
def server(migrated_url: str) -> Iterator[LiveServer]:
    """One server per backend for the module; each test uses names of its own."""
    clear_tables(migrated_url)
    live = start_server(database_url=migrated_url, run_controller=False)
    yield live
    live.stop()


@pytest.fixture
def cpn(
    server: LiveServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> Iterator[CliRun]:
    monkeypatch.setenv("CPN_URL", server.url)
    monkeypatch.setenv("CPN_TOKEN", server.admin_token)
    monkeypatch.setenv("COLUMNS", "200")
    yield CliRun(capsys)


class CliRun:
    """`cpn ARGS` in this process: its exit code, stdout and stderr."""

    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self.capsys = capsys

    def __call__(self, *args: str | Path) -> Ran:
        from api.cli import main

        self.capsys.readouterr()
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as exc:
            code = int(exc.code or 0)
        got = self.capsys.readouterr()
        return Ran(code, got.out, got.err)


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


def network(s: str, **changes: object) -> str:
    """Two clusters, a symmetric link, a tenant with quota and budget, two prices."""
    docs: list[dict[str, object]] = [
        {"kind": "Cluster", "name": f"a-{s}", "region": "us-east", "labels": {"tier": "gold"}},
        {"kind": "Cluster", "name": f"b-{s}", "region": "eu-west"},
        {
            "kind": "Link",
            "src": f"a-{s}",
            "dst": f"b-{s}",
            "bandwidth_gbps": 10,
            "rtt_ms": 80,
            "egress_price_per_gb": 0.02,
        },
        {"kind": "Tenant", "name": f"acme-{s}", "gpu_quota": 8, "budget": 500.0},
        {
            "kind": "GpuPrice",
            "cluster": f"a-{s}",
            "gpu_model": "A100",
            "qos_class": "standard",
            "price_per_gpu_hour": 2.5,
        },
        {"kind": "EgressPrice", "src": f"a-{s}", "dst": f"b-{s}", "price_per_gb": 0.03},
    ]
    for key, value in changes.items():
        index, field = key.split("__")
        docs[int(index)][field] = value
    return yaml.safe_dump_all(docs, sort_keys=False)


def audit_total(client: Client) -> int:
    return int(client.get("/v1/audit", limit=1)["total"])


def test_apply_creates_then_says_unchanged(cpn: CliRun, server: LiveServer, tmp_path: Path) -> None:
    s = uuid.uuid4().hex[:6]
    path = tmp_path / "net.yaml"
    path.write_text(network(s))
    with server.client() as client:
        before = audit_total(client)
        dry = cpn("apply", "-f", path, "--dry-run")
        assert dry.code == 0, dry.err
        labels = '{"tier": "gold"}'
        assert f"Cluster a-{s}: would be created (region: us-east, labels: {labels})" in dry.out
        assert f"Tenant acme-{s}: would be created (gpu_quota: 8, budget: 500.0" in dry.out
        assert "dry run: 6 created, 0 changed, 0 unchanged; nothing was written" in dry.out
        assert audit_total(client) == before  # the dry run wrote nothing

        done = cpn("apply", "-f", path)
        assert done.code == 0, done.err
        assert "6 created, 0 changed, 0 unchanged" in done.out
        cluster = client.get(f"/v1/clusters/a-{s}")
        assert cluster["region"] == "us-east" and cluster["labels"] == {"tier": "gold"}
        links = {(k["src"], k["dst"]): k for k in client.links("declared")}
        assert links[(f"b-{s}", f"a-{s}")]["bandwidth_gbps"] == 10  # symmetric by default
        tenant = next(t for t in client.paginate("/v1/tenants") if t["name"] == f"acme-{s}")
        assert (tenant["gpu_quota"], tenant["budget"]) == (8, 500.0)
        pricing = client.pricing()
        gpu = [p for p in pricing["gpu"] if p["cluster"] == f"a-{s}"]
        assert [(p["gpu_model"], p["price_per_gpu_hour"]) for p in gpu] == [("A100", 2.5)]
        egress = {(p["src"], p["dst"]): p["price_per_gb"] for p in pricing["egress"]}
        assert egress[(f"a-{s}", f"b-{s}")] == egress[(f"b-{s}", f"a-{s}")] == 0.03

        written = audit_total(client)
        again = cpn("apply", "-f", path)
        assert again.code == 0, again.err
        assert "0 created, 0 changed, 6 unchanged" in again.out
        assert f"Link a-{s}->b-{s}: unchanged" in again.out
        assert audit_total(client) == written  # idempotent: not one write


@pytest.mark.parametrize("migrated_url", ["sqlite"], indirect=True)
def test_dry_run_prints_old_to_new_and_apply_changes_only_that(
    cpn: CliRun, server: LiveServer, tmp_path: Path
) -> None:
    s = uuid.uuid4().hex[:6]
    path = tmp_path / "net.yaml"
    path.write_text(network(s))
    assert cpn("apply", "-f", path).code == 0
    path.write_text(
        network(
            s,
            **{
                "0__region": "us-east-2",
                "2__bandwidth_gbps": 25,
                "3__gpu_quota": 16,
                "3__budget": None,
                "4__price_per_gpu_hour": 3.0,
            },
        )
    )
    with server.client() as client:
        before = audit_total(client)
        dry = cpn("apply", "-f", path, "--dry-run")
        assert dry.code == 0, dry.err
        lines = dry.out.splitlines()
        assert f"Cluster a-{s}: would change (region: us-east → us-east-2)" in lines
        assert f"Cluster b-{s}: unchanged" in lines
        assert f"Tenant acme-{s}: would change (gpu_quota: 8 → 16, budget: 500.0 → null)" in lines
        link = next(line for line in lines if line.startswith(f"Link a-{s}->b-{s}"))
        assert link == f"Link a-{s}->b-{s}: would change (bandwidth_gbps: 10.0 → 25.0)"  # both ways
        assert "price_per_gpu_hour: 2.5 → 3.0" in dry.out
        # Declaring the link again resets its pair's egress price: the EgressPrice follows.
        assert "(as its Link sets it) price_per_gb: 0.02 → 0.03" in dry.out
        assert audit_total(client) == before

        done = cpn("apply", "-f", path)
        assert done.code == 0, done.err
        assert "0 created, 5 changed, 1 unchanged" in done.out
        assert client.get(f"/v1/clusters/a-{s}")["region"] == "us-east-2"
        tenant = next(t for t in client.paginate("/v1/tenants") if t["name"] == f"acme-{s}")
        assert (tenant["gpu_quota"], tenant["budget"]) == (16, None)
        assert cpn("apply", "-f", path).out.strip().endswith("0 created, 0 changed, 6 unchanged")


@pytest.mark.parametrize("migrated_url", ["sqlite"], indirect=True)
def test_get_yaml_round_trips_through_apply(
    cpn: CliRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = uuid.uuid4().hex[:6]
    path = tmp_path / "net.yaml"
    path.write_text(network(s))
    assert cpn("apply", "-f", path).code == 0
    # An asymmetric link and a price set one way only must come back as they are.
    one_way = tmp_path / "one-way.yaml"
    one_way.write_text(
        yaml.safe_dump_all(
            [
                {
                    "kind": "Link",
                    "src": f"b-{s}",
                    "dst": f"a-{s}",
                    "bandwidth_gbps": 5,
                    "rtt_ms": 90,
                    "symmetric": False,
                },
                {
                    "kind": "EgressPrice",
                    "src": f"b-{s}",
                    "dst": f"a-{s}",
                    "price_per_gb": 0.05,
                    "symmetric": False,
                },
            ]
        )
    )
    assert cpn("apply", "-f", one_way).code == 0

    got = cpn("get", "all", "-o", "yaml")
    assert got.code == 0, got.err
    docs = list(yaml.safe_load_all(got.out))
    mine = [d for d in docs if s in json.dumps(d)]
    assert {d["kind"] for d in mine} == {"Cluster", "Link", "Tenant", "GpuPrice", "EgressPrice"}
    assert all(d["apiVersion"] == "cpn/v1" for d in docs)
    links = [d for d in mine if d["kind"] == "Link"]
    assert sorted((d["src"], d["dst"], d.get("symmetric", True)) for d in links) == [
        (f"a-{s}", f"b-{s}", False),
        (f"b-{s}", f"a-{s}", False),
    ]
    exported = tmp_path / "exported.yaml"
    exported.write_text(got.out)
    dry = cpn("apply", "-f", exported, "--dry-run")
    assert dry.code == 0, dry.err
    assert f"0 created, 0 changed, {len(docs)} unchanged" in dry.out

    monkeypatch.setattr("sys.stdin", io.StringIO(got.out))  # `-f -` reads stdin
    assert f"{len(docs)} unchanged" in cpn("apply", "-f", "-", "--dry-run").out

    one = cpn("get", "tenant", f"acme-{s}", "-o", "json")
    assert one.code == 0, one.err
    assert json.loads(one.out) == [
        {
            "apiVersion": "cpn/v1",
            "kind": "Tenant",
            "name": f"acme-{s}",
            "gpu_quota": 8,
            "budget": 500.0,
            "priority_ceiling": 0,
            "qos_classes": ["standard", "spot"],
        }
    ]
    table = cpn("get", "clusters")
    assert table.code == 0 and f"a-{s}" in table.out and "us-east" in table.out


BAD = [
    (
        "kind: Cluster\nname: x\nregion: r\nzone: 1\n",
        2,
        "document 1 (Cluster x): zone: unknown field",
    ),
    (
        "kind: Cluster\nname: ok\nregion: r\n---\nkind: Tenant\nname: acme\ngpu_quota: -1\n",
        2,
        "document 2 (Tenant acme): gpu_quota: Input should be greater than or equal to 0",
    ),
    ("kind: Cluster\nname: x\n", 2, "document 1 (Cluster x): region: required: add it"),
    (
        "kind: Quota\nname: q\n",
        2,
        "document 1 (Quota q): kind: 'Quota' is not one of Cluster, Link",
    ),
    ("- a\n- b\n", 2, "document 1: a document is a mapping with a kind, not list"),
    ("kind: Cluster\nname: [x\n", 2, "YAML: while parsing"),
    (
        "kind: Link\nsrc: p\ndst: q\nbandwidth_gbps: 1\nrtt_ms: 1\n---\n"
        "kind: Link\nsrc: q\ndst: p\nbandwidth_gbps: 2\nrtt_ms: 1\n",
        2,
        "document 2 (Link q->p): sets Link q->p, which document 1 sets already; keep one of them",
    ),
    (
        "kind: GpuPrice\ncluster: nowhere-xyz\ngpu_model: A100\nqos_class: spot\n"
        "price_per_gpu_hour: 1\n",
        2,
        "document 1 (GpuPrice nowhere-xyz/A100/spot): cluster: no cluster named 'nowhere-xyz'",
    ),
]


@pytest.mark.parametrize("migrated_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize(("content", "code", "says"), BAD)
def test_bad_documents_are_one_line_naming_the_document_and_field(
    cpn: CliRun, server: LiveServer, tmp_path: Path, content: str, code: int, says: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    with server.client() as client:
        before = audit_total(client)
        ran = cpn("apply", "-f", path)
        assert ran.code == code and ran.out == ""
        line = one_line(ran.err)
        assert line.startswith(f"cpn apply: error: {path}: ") and says in line, line
        assert audit_total(client) == before  # refused before any write


@pytest.mark.parametrize("migrated_url", ["sqlite"], indirect=True)
def test_an_api_refusal_names_its_document_and_exits_1(cpn: CliRun, tmp_path: Path) -> None:
    s = uuid.uuid4().hex[:6]
    past = (datetime.now(UTC) - timedelta(days=1)).isoformat()
    path = tmp_path / "net.yaml"
    path.write_text(
        network(s) + f"---\n{network(s, **{'4__effective_from': past}).split('---')[4]}"
    )
    ran = cpn("apply", "-f", path)
    assert ran.code == 1
    line = one_line(ran.err)
    assert f"document 7 (GpuPrice a-{s}/A100/standard): 422 " in line, line
    assert "effective_from is in the past" in line
    assert f"Cluster a-{s}: created" in ran.out  # what came before it was applied and said so


@pytest.mark.parametrize("migrated_url", ["sqlite"], indirect=True)
def test_usage_errors(cpn: CliRun, tmp_path: Path) -> None:
    missing = cpn("apply", "-f", tmp_path / "nope.yaml")
    assert missing.code == 2 and "nope.yaml: cannot read it" in one_line(missing.err)
    empty = tmp_path / "empty.yaml"
    empty.write_text("---\n")
    assert "no documents in it" in one_line(cpn("apply", "-f", empty).err)
    kind = cpn("get", "widgets")
    assert kind.code == 2 and one_line(kind.err).startswith("cpn get: error: KIND: ")
    out = cpn("get", "cluster", "-o", "xml")
    assert out.code == 2 and "--output" in one_line(out.err)
    none = cpn("get", "cluster", "no-such-cluster")
    assert none.code == 1 and "no Cluster named 'no-such-cluster'" in one_line(none.err)


def test_plan_names_the_direction_only_when_the_two_differ() -> None:
    """Pure planning, no server: a symmetric link whose one direction drifted."""
    from api.cli.manifests import Action, Current, parse, plan
    from api.schemas import LinkOut

    now = datetime.now(UTC)

    def link(src: str, dst: str, gbps: float) -> LinkOut:
        return LinkOut(
            id=f"{src}-{dst}",
            src=src,
            dst=dst,
            source="declared",
            bandwidth_gbps=gbps,
            rtt_ms=10,
            loss=0,
            egress_price_per_gb=0,
            measured_at=now,
            pinned=False,
        )

    docs = parse("kind: Link\nsrc: a\ndst: b\nbandwidth_gbps: 10\nrtt_ms: 10\n")
    drifted = Current(
        clusters=dict.fromkeys(("a", "b")),  # type: ignore[arg-type]  # names only
        links={("a", "b"): link("a", "b", 10), ("b", "a"): link("b", "a", 4)},
    )
    (step,) = plan(docs, drifted)
    assert step.action is Action.CHANGE
    assert step.line(dry_run=True) == "Link a->b: would change (b->a bandwidth_gbps: 4.0 → 10.0)"
    assert [r.body["src"] for r in step.requests] == ["b"]  # only the drifted direction is sent
    both = Current(
        clusters=drifted.clusters,
        links={("a", "b"): link("a", "b", 4), ("b", "a"): link("b", "a", 4)},
    )
    assert plan(docs, both)[0].line(False) == "Link a->b: changed (bandwidth_gbps: 4.0 → 10.0)"


def test_cordon_uncordon_and_drain_from_the_cli(cpn: CliRun, server: LiveServer) -> None:
    """Issue 51: kubectl's verbs on a cluster, over the REST routes the console uses."""
    s = uuid.uuid4().hex[:6]
    admin = server.client()
    admin.create_cluster(f"c-{s}", "us-east")
    cordoned = cpn("cordon", f"c-{s}")
    assert cordoned.code == 0, cordoned.err
    assert one_line(cordoned.out).startswith(f"cluster c-{s} cordoned")
    shown = {c["name"]: c for c in admin.clusters()}[f"c-{s}"]
    assert shown["cordoned"] and not shown["draining"]
    listed = cpn("clusters", "-o", "yaml")
    assert listed.code == 0 and f"c-{s}" in {c["name"] for c in yaml.safe_load(listed.out)}
    admin.request("PATCH", f"/v1/clusters/c-{s}", json={"labels": {"rack": "r" * 60}})
    table, wide = cpn("clusters"), cpn("clusters", "-o", "wide")  # kubectl's -o wide
    assert table.code == 0 and wide.code == 0, wide.err
    assert "labels" not in table.out and "labels" in wide.out
    [row] = [line for line in wide.out.splitlines() if f"c-{s} " in line]  # one line, whole
    assert "rack=" + "r" * 60 in row
    got = cpn("get", "cluster", f"c-{s}", "-o", "wide")
    assert got.code == 0 and "r" * 60 in got.out
    drained = cpn("drain", f"c-{s}", "--json")
    assert drained.code == 0 and json.loads(drained.out)["draining"] is True
    back = cpn("uncordon", f"c-{s}")
    assert back.code == 0 and one_line(back.out).startswith(f"cluster c-{s} uncordoned")
    shown = {c["name"]: c for c in admin.clusters()}[f"c-{s}"]
    assert not shown["cordoned"] and not shown["draining"]
    missing = cpn("cordon", f"nowhere-{s}")
    assert missing.code == 1 and one_line(missing.err).startswith("cpn cordon: error: 404 ")
    admin.close()
