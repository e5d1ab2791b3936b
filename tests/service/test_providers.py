"""Resource providers (issue 52): offers on their own clusters, double-entry settlement, exact
statements and payouts, on a real server over SQLite and PostgreSQL."""

from __future__ import annotations

import json
import re
import threading
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import httpx
import pytest
from sqlalchemy import select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from api.client import ApiError, Client
from controller.jobs import lifecycle
from controller.money import settlement
from controller.money.amounts import q6
from controller.money.metering import meter_allocations, meter_wan, price_usage
from controller.network.allocations import Slot, release, reserve
from controller.store.db import make_engine, make_sessionmaker
from controller.store.models import (
    Allocation,
    Cluster,
    ClusterTransition,
    Job,
    LedgerEntry,
    Payout,
    Posting,
)
from grammar.states import ClusterState, JobState
from tests.service.conftest import Network, spec
from tests.service.test_metrics import samples, value


def refused(call: Any, status: int) -> ApiError:
    with pytest.raises(ApiError) as caught:
        call()
    assert caught.value.status == status, caught.value
    return caught.value


def names(err: ApiError, field: str) -> bool:
    """The problem names `field` (in its errors, or its detail)."""
    return field in json.dumps(err.errors) or field in err.detail


def _provider(network: Network, name: str, clusters: list[str], fee: float) -> tuple[str, Client]:
    made = network.admin.post(
        "/v1/providers", {"name": name, "fee_rate": fee, "clusters": clusters}
    )
    token = network.admin.create_api_key("provider", name)["token"]
    return made["id"], network.server.client(token)


@pytest.mark.parametrize("migrated_url", ["sqlite"], indirect=True)  # API logic alone
def test_a_provider_prices_its_own_clusters_and_no_one_elses(network: Network) -> None:
    pid, prov = _provider(network, "dc-east", ["us-east"], 0.1)
    try:
        # the operator no longer prices a provider's cluster; the provider does
        err = refused(
            lambda: network.admin.post(
                "/v1/pricing/gpu",
                {
                    "cluster": "us-east",
                    "gpu_model": "A100",
                    "qos_class": "standard",
                    "price_per_gpu_hour": 1.0,
                },
            ),
            409,
        )
        assert "dc-east" in err.detail
        offer = prov.post(
            "/v1/pricing/gpu",
            {
                "cluster": "us-east",
                "gpu_model": "A100",
                "qos_class": "standard",
                "price_per_gpu_hour": 2.25,
            },
        )
        assert offer["provider"] == "dc-east"
        refused(
            lambda: prov.post(
                "/v1/pricing/gpu",
                {
                    "cluster": "eu-west",
                    "gpu_model": "H100",
                    "qos_class": "standard",
                    "price_per_gpu_hour": 0.01,
                },
            ),
            404,
        )
        # egress leaves its own uplink only; the way back is eu-west's owner's to price
        err = refused(
            lambda: prov.post(
                "/v1/pricing/egress", {"src": "us-east", "dst": "eu-west", "price_per_gb": 0.03}
            ),
            422,
        )
        assert names(err, "symmetric")
        prov.post(
            "/v1/pricing/egress",
            {"src": "us-east", "dst": "eu-west", "price_per_gb": 0.03, "symmetric": False},
        )
        pricing = network.tenant.get("/v1/pricing")
        rows = {(p["cluster"], p["qos_class"]): p for p in pricing["gpu"]}
        assert rows[("us-east", "standard")]["price_per_gpu_hour"] == 2.25
        assert rows[("us-east", "standard")]["provider"] == "dc-east"
        assert rows[("eu-west", "standard")]["provider"] is None
        offers = prov.get(f"/v1/providers/{pid}/offers")
        assert {o["cluster"] for o in offers["gpu"]} == {"us-east"}
        # its own offer replaced the operator's price to eu-west; the one to ap-south stays
        assert sorted((e["src"], e["dst"], e["provider"]) for e in offers["egress"]) == [
            ("us-east", "ap-south", None),
            ("us-east", "eu-west", "dc-east"),
        ]
        clusters = prov.get(f"/v1/providers/{pid}/clusters")
        assert [(c["name"], c["gpus"][0]["allocatable"], c["utilization"]) for c in clusters] == [
            ("us-east", 8, 0.0)
        ]
        # a cluster has one owner
        err = refused(
            lambda: network.admin.post(
                "/v1/providers", {"name": "dc-two", "clusters": ["us-east"]}
            ),
            409,
        )
        assert names(err, "clusters")
    finally:
        prov.close()


def _launch(
    network: Network, wan_kbps: dict[str, int] | None = None
) -> tuple[str, sessionmaker[Session]]:
    """A 4-GPU job RUNNING (billed from now) on the provider's us-east (3 A100) and the
    operator's eu-west (1 H100), holding `wan_kbps` on their ports."""
    job_out = network.tenant.post("/v1/jobs", spec(gpus=4, qos={"qos_class": "standard"}))
    sessions = make_sessionmaker(make_engine(network.server.database_url))
    with sessions() as s, s.begin():
        job = s.get(Job, job_out["id"])
        assert job is not None
        reserve(s, job, [Slot("us-east", "A100", 3), Slot("eu-west", "H100", 1)], wan_kbps)
        lifecycle.transition(s, job, JobState.SCHEDULED, "placed")
        lifecycle.transition(s, job, JobState.RUNNING, "launched")
    return str(job_out["id"]), sessions


def _run_and_bill(network: Network) -> str:
    """A job on the provider's us-east (3 A100) and the operator's eu-west (1 H100), billed
    for a second, with WAN bytes both ways: what settlement splits."""
    job_id, sessions = _launch(network)
    started = datetime.now(UTC)
    while datetime.now(UTC) < started + timedelta(seconds=0.5):
        threading.Event().wait(0.05)
    with sessions() as s, s.begin():
        job = s.get(Job, job_id)
        assert job is not None
        meter_wan(
            s,
            job,
            {("us-east", "eu-west"): 3_000_000_007, ("eu-west", "us-east"): 1_500_003},
            started,
            datetime.now(UTC),
        )
        assert release(s, job) == 4
        meter_allocations(s, job)
        price_usage(s, job.id)
    return job_id


def test_every_charge_is_split_exactly_between_provider_and_platform(network: Network) -> None:
    pid, prov = _provider(network, "dc-east", ["us-east"], 0.125)
    try:
        prov.post(
            "/v1/pricing/egress",
            {"src": "us-east", "dst": "eu-west", "price_per_gb": 0.037, "symmetric": False},
        )
        job_id = _run_and_bill(network)
        sessions = make_sessionmaker(make_engine(network.server.database_url))
        with sessions() as s:
            assert settlement.unbalanced(s) == []
            entries = s.scalars(select(LedgerEntry).where(LedgerEntry.job_id == job_id)).all()
            theirs = [e for e in entries if e.description.endswith("on us-east (standard)")]
            theirs += [e for e in entries if e.description == "WAN us-east -> eu-west"]
            assert len(theirs) == 2 and len(entries) == 4
            credits = s.scalars(
                select(Posting).where(Posting.account == "provider", Posting.party_id == pid)
            ).all()
            assert sorted(p.ledger_id for p in credits) == sorted(e.id for e in theirs)
            for e in theirs:  # the provider's part: the charge less the fee, to the micro-dollar
                net = next(Decimal(str(p.amount)) for p in credits if p.ledger_id == e.id)
                assert net == q6(Decimal(str(e.amount)) * Decimal("0.875"))
            gross = sum((q6(Decimal(str(e.amount))) for e in theirs), Decimal(0))
            earned = sum((q6(Decimal(str(p.amount))) for p in credits), Decimal(0))
        st = prov.get(f"/v1/providers/{pid}/statement")
        assert Decimal(st["gross"]) == gross and Decimal(st["net"]) == earned
        assert Decimal(st["fee"]) == gross - earned and Decimal(st["balance"]) == earned
        assert {(x["cluster"], x["kind"]) for x in st["lines"]} == {
            ("us-east", "gpu"),
            ("us-east", "egress"),
        }
        # the operator's eu-west charges and the platform's fee make up the rest
        ledger = network.tenant.get(f"/v1/tenants/{network.tenant_id}/ledger")
        assert Decimal(ledger["total"]) > gross
        # a period before the job holds nothing, its balance is still what is owed
        early = prov.get(
            f"/v1/providers/{pid}/statement",
            end=(datetime.now(UTC) - timedelta(hours=1)).isoformat(),
        )
        assert early["lines"] == [] and Decimal(early["balance"]) == earned

        refused(
            lambda: network.admin.post(
                f"/v1/providers/{pid}/payouts", {"amount": str(earned + Decimal("0.000001"))}
            ),
            409,
        )
        half = q6(earned / 2)
        paid = network.admin.post(
            f"/v1/providers/{pid}/payouts", {"amount": str(half), "reference": "wire 1"}
        )
        assert Decimal(paid["amount"]) == half
        after = prov.get(f"/v1/providers/{pid}/statement")
        assert Decimal(after["balance"]) == earned - half and Decimal(after["paid"]) == half
        assert [p["reference"] for p in prov.get(f"/v1/providers/{pid}/payouts")["items"]] == [
            "wire 1"
        ]
        listed = network.admin.get("/v1/providers")["items"]
        assert [(p["name"], Decimal(p["balance"])) for p in listed] == [("dc-east", earned - half)]
        m = samples(httpx.get(f"{network.server.url}/metrics").text)
        owed = value(m, "cpn_provider_dollars", provider="dc-east", kind="owed")
        assert owed == pytest.approx(float(earned - half), abs=1e-6)
        assert value(m, "cpn_provider_dollars", provider="dc-east", kind="paid") == float(half)
    finally:
        prov.close()


def test_postings_and_payouts_are_append_only(network: Network) -> None:
    pid, prov = _provider(network, "dc-east", ["us-east"], 0.1)
    prov.close()
    _run_and_bill(network)
    network.admin.post(f"/v1/providers/{pid}/payouts", {"amount": "0.000001"})
    engine = make_engine(network.server.database_url)
    for table in ("postings", "payouts"):
        for statement in (f"UPDATE {table} SET amount = 0", f"DELETE FROM {table}"):
            with pytest.raises(DBAPIError, match="append-only"), engine.begin() as conn:
                conn.execute(text(statement))
    engine.dispose()


def test_concurrent_payouts_never_pay_more_than_is_owed(network: Network) -> None:
    """Two admins pay out at once, each more than half of the balance: one is refused (409),
    on PostgreSQL by the provider's row lock, on SQLite by its write lock."""
    pid, prov = _provider(network, "dc-east", ["us-east"], 0.1)
    prov.close()
    _run_and_bill(network)
    owed = Decimal(network.admin.get(f"/v1/providers/{pid}")["balance"])
    amount = q6(owed * Decimal("0.6"))
    barrier = threading.Barrier(2)
    statuses: list[int] = []

    def pay() -> None:
        with network.server.client(network.server.admin_token) as admin:
            barrier.wait()
            try:
                admin.post(f"/v1/providers/{pid}/payouts", {"amount": str(amount)})
                statuses.append(201)
            except ApiError as exc:
                statuses.append(exc.status)

    threads = [threading.Thread(target=pay) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(statuses) == [201, 409]
    sessions = make_sessionmaker(make_engine(network.server.database_url))
    with sessions() as s:
        paid = [Decimal(str(a)) for a in s.scalars(select(Payout.amount))]
        assert paid == [amount]
        assert settlement.balance(s, pid) == owed - amount


@pytest.mark.parametrize("migrated_url", ["sqlite"], indirect=True)  # API logic alone
def test_bad_offers_and_providers_are_refused_naming_the_field(network: Network) -> None:
    for body, field in (
        ({"name": "Bad Name"}, "name"),
        ({"name": "ok", "fee_rate": 1.0}, "fee_rate"),
        ({"name": "ok", "fee_rate": -0.1}, "fee_rate"),
        ({"name": "ok", "clusters": ["nowhere"]}, "cluster"),
    ):
        status = 404 if field == "cluster" else 422
        err = refused(lambda b=body: network.admin.post("/v1/providers", b), status)
        assert names(err, field), (body, err)
    pid, prov = _provider(network, "dc-east", ["us-east"], 0.1)
    try:
        for amount in ("-1", "1.0000001", "abc", "0"):
            err = refused(
                lambda a=amount: network.admin.post(f"/v1/providers/{pid}/payouts", {"amount": a}),
                422,
            )
            assert names(err, "amount")
        err = refused(
            lambda: prov.post(
                "/v1/pricing/gpu",
                {
                    "cluster": "us-east",
                    "gpu_model": "A100",
                    "qos_class": "standard",
                    "price_per_gpu_hour": -2,
                },
            ),
            422,
        )
        assert names(err, "price_per_gpu_hour")
    finally:
        prov.close()


@pytest.mark.parametrize("migrated_url", ["sqlite"], indirect=True)  # API logic alone
def test_the_cli_serves_admins_and_providers(network: Network) -> None:
    """`cpn providers`: an admin creates one and pays it; the provider reads its own
    statement, clusters and offers as `me`; a bad payout is one line naming the problem."""
    from tests.service.test_cli_jobs import cpn

    made = cpn(network, network.admin, "providers", "create", "dc-east", "--fee", "0.2",
               "--cluster", "us-east", "--json")  # fmt: skip
    assert made.returncode == 0, made.stderr
    pid = json.loads(made.stdout)["id"]
    token = network.admin.create_api_key("provider", "dc-east")["token"]
    _run_and_bill(network)
    with network.server.client(token) as prov:
        st = cpn(network, prov, "providers", "statement", "--json")
        assert st.returncode == 0, st.stderr
        owed = Decimal(json.loads(st.stdout)["balance"])
        assert owed > 0
        table = cpn(network, prov, "providers", "statement")
        assert "us-east" in table.stdout and str(owed) in table.stdout
        shown = cpn(network, prov, "providers", "clusters")
        assert "us-east" in shown.stdout and "8x A100" in shown.stdout
        assert "us-east" in cpn(network, prov, "providers", "offers").stdout
        other = cpn(network, prov, "providers", "statement", "nobody")
        assert other.returncode == 1 and other.stderr.count("\n") == 1
        assert other.stderr.startswith("cpn providers statement: error: 404")
    too_much = cpn(network, network.admin, "providers", "pay", "dc-east", str(owed + 1))
    assert too_much.returncode == 1 and "409" in too_much.stderr
    paid = cpn(network, network.admin, "providers", "pay", "dc-east", str(owed), "--reference", "x")
    assert paid.returncode == 0, paid.stderr
    listed = cpn(network, network.admin, "providers", "list", "--json")
    assert [(p["id"], p["balance"]) for p in json.loads(listed.stdout)] == [(pid, "0.000000")]


@pytest.mark.parametrize("migrated_url", ["sqlite"], indirect=True)  # API logic alone
def test_a_quote_names_each_providers_part(network: Network) -> None:
    """The cheapest option of an 8-GPU job on a provider's L4s: its GPU lines name the
    provider, and the parts add up to the total."""
    _provider(network, "dc-south", ["ap-south"], 0.1)[1].close()
    quote = network.tenant.post("/v1/quotes", spec(gpus=8, steps=200))
    for option in quote["options"]:
        price = option["price"]
        owners = {g["cluster"]: g.get("provider") for g in price["gpu"]}
        assert all((p == "dc-south") == (c == "ap-south") for c, p in owners.items()), owners
        parts = {p["provider"]: p["amount"] for p in price["parties"]}
        assert set(parts) == set(owners.values()) | {e.get("provider") for e in price["egress"]}
        assert abs(sum(parts.values()) - price["total"]) < 1e-5
    cheapest = next(o for o in quote["options"] if o["objective"] == "cost")
    assert "dc-south" in {p["provider"] for p in cheapest["price"]["parties"]}


def test_a_missed_uptime_promise_refunds_the_tenant_from_the_provider(network: Network) -> None:
    """dc-east promises us-east up 99 % of the time, 25 % of a run's charges back if not.
    us-east is DOWN for a fifth of a run (0.2 s of about 1 s): the run's end refunds a
    quarter of its us-east charges (none of eu-west's, the operator's), once; the books still
    balance, and the provider's statement carries the refund."""
    pid, prov = _provider(network, "dc-east", ["us-east"], 0.1)
    try:
        sla = prov.post(
            "/v1/providers/me/slas", {"cluster": "us-east", "uptime": 0.99, "credit_rate": 0.25}
        )
        assert sla["cluster"] == "us-east" and prov.get("/v1/providers/me/slas") == [sla]
        job_id, sessions = _launch(network)
        with sessions() as s, s.begin():
            start = s.scalars(select(Allocation.billed_from)).first()
            assert start is not None
            cluster = s.scalars(select(Cluster).where(Cluster.name == "us-east")).one()
            # what the lease monitor writes when the agent goes silent, and its return
            s.add_all(
                [
                    ClusterTransition(cluster_id=cluster.id, from_state=ClusterState.READY,
                                      to_state=ClusterState.DOWN, reason="lease expired",
                                      at=start + timedelta(seconds=0.2)),
                    ClusterTransition(cluster_id=cluster.id, from_state=ClusterState.DOWN,
                                      to_state=ClusterState.READY, reason="heartbeat",
                                      at=start + timedelta(seconds=0.4)),
                ]
            )  # fmt: skip
        while datetime.now(UTC) < start + timedelta(seconds=1):  # a run of a second
            threading.Event().wait(0.05)
        with sessions() as s, s.begin():
            job = s.get(Job, job_id)
            assert job is not None
            lifecycle.end_run(s, job)
            lifecycle.end_run(s, job)  # once only
        with sessions() as s:
            entries = s.scalars(select(LedgerEntry).where(LedgerEntry.job_id == job_id)).all()
            refunds = [e for e in entries if e.kind == "sla_credit"]
            assert len(refunds) == 1, [e.description for e in entries]
            east = sum(
                (q6(Decimal(str(e.amount))) for e in entries if "on us-east" in e.description
                 and e.kind == "gpu"), Decimal(0),
            )  # fmt: skip
            assert east > 0 and -Decimal(str(refunds[0].amount)) == q6(east * Decimal("0.25"))
            assert re.search(
                r"uptime (7\d|80)\.\d\d% against 99\.00% promised", refunds[0].description
            )
            assert settlement.unbalanced(s) == []
            got_back = s.scalars(
                select(Posting.amount).where(
                    Posting.ledger_id == refunds[0].id, Posting.account == "provider"
                )
            ).one()
            assert Decimal(str(got_back)) == -q6(q6(east * Decimal("0.25")) * Decimal("0.9"))
        st = prov.get(f"/v1/providers/{pid}/statement")
        kinds = {x["kind"]: Decimal(x["net"]) for x in st["lines"]}
        assert kinds["sla_credit"] == Decimal(str(got_back))
        ledger = network.tenant.get(f"/v1/tenants/{network.tenant_id}/ledger")
        assert any(e["kind"] == "sla_credit" for e in ledger["items"])
    finally:
        prov.close()


@pytest.mark.parametrize("migrated_url", ["sqlite"], indirect=True)  # API logic alone
def test_a_kept_promise_refunds_nothing(network: Network) -> None:
    _, prov = _provider(network, "dc-east", ["us-east"], 0.1)
    prov.post("/v1/providers/me/slas", {"cluster": "us-east", "uptime": 0.9, "credit_rate": 1})
    prov.close()
    job_id = _run_and_bill(network)
    sessions = make_sessionmaker(make_engine(network.server.database_url))
    with sessions() as s, s.begin():
        job = s.get(Job, job_id)
        assert job is not None
        lifecycle.end_run(s, job)
        kinds = s.scalars(select(LedgerEntry.kind).where(LedgerEntry.job_id == job_id)).all()
        assert "sla_credit" not in kinds and kinds


def test_two_replicas_settling_one_run_at_once_post_it_once(network: Network) -> None:
    """Two controllers end the same run at the same moment (a retry racing a cancel, each in
    its own transaction): every usage row is priced once and every entry posted once, and
    the books balance; on PostgreSQL the rows are claimed with SKIP LOCKED, on SQLite the
    writes take turns."""
    pid, prov = _provider(network, "dc-east", ["us-east"], 0.1)
    prov.close()
    job_id, sessions = _launch(network)
    with sessions() as s, s.begin():
        job = s.get(Job, job_id)
        assert job is not None
        meter_wan(s, job, {("us-east", "eu-west"): 10**9}, datetime.now(UTC), datetime.now(UTC))
    barrier = threading.Barrier(2)
    failures: list[BaseException] = []

    def settle() -> None:
        try:
            barrier.wait()
            with sessions() as s, s.begin():
                job = s.get(Job, job_id, with_for_update=True)
                assert job is not None
                lifecycle.end_run(s, job)
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    threads = [threading.Thread(target=settle) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    with sessions() as s:
        entries = s.scalars(select(LedgerEntry).where(LedgerEntry.job_id == job_id)).all()
        usage_ids = [e.usage_id for e in entries]
        assert len(usage_ids) == len(set(usage_ids)) == 3  # GPUs on each cluster, WAN bytes
        postings = s.scalars(
            select(Posting).where(Posting.ledger_id.in_([e.id for e in entries]))
        ).all()
        assert len(postings) == 3 + 3 + 2  # us-east GPUs and egress: a provider; eu-west: none
        assert settlement.unbalanced(s) == []
        assert settlement.balance(s, pid) > 0


def test_the_bandwidth_a_job_holds_is_priced_billed_and_credited(network: Network) -> None:
    """dc-east prices WAN rate on us-east's ports at $2 per Gbit/s-hour. A quote whose plan
    crosses the WAN from us-east names that line and adds it to its total; a run holding
    0.5 Gbit/s there for about a second is billed exactly that (eu-west's ports, unpriced,
    cost nothing), and dc-east is credited it less the fee."""
    pid, prov = _provider(network, "dc-east", ["us-east"], 0.1)
    try:
        made = prov.post(
            "/v1/pricing/bandwidth", {"cluster": "us-east", "price_per_gbps_hour": 2.0}
        )
        assert made["provider"] == "dc-east"
        refused(
            lambda: prov.post(
                "/v1/pricing/bandwidth", {"cluster": "eu-west", "price_per_gbps_hour": 0}
            ),
            404,
        )
        assert [b["cluster"] for b in network.tenant.get("/v1/pricing")["bandwidth"]] == ["us-east"]
        assert prov.get(f"/v1/providers/{pid}/offers")["bandwidth"][0]["price_per_gbps_hour"] == 2
    finally:
        prov.close()
    quote = network.tenant.post("/v1/quotes", spec(gpus=20, steps=2000))
    crossing = [
        o for o in quote["options"]
        if "us-east" in {p["cluster"] for p in o["placement"]} and len(o["placement"]) > 1
    ]  # fmt: skip
    assert crossing, quote["options"]
    for option in crossing:
        price = option["price"]
        (line,) = price["bandwidth"]
        assert line["cluster"] == "us-east" and line["provider"] == "dc-east"
        gbps = option["wan_kbps"]["us-east"] / 1e6
        hours = option["estimate"]["total_time_s"] / 3600
        assert line["amount"] == pytest.approx(gbps * hours * 2.0, abs=2e-6)
        # the lines add up to the total (to 1e-4: the egress lines split the model's WAN
        # bytes evenly over the ring's edges, each rounded; the model prices them as it runs)
        parts = sum(x["amount"] for x in (*price["gpu"], *price["egress"], *price["bandwidth"]))
        assert price["total"] == pytest.approx(parts, abs=1e-4)
        assert option["estimate"]["cost"] == pytest.approx(price["total"], abs=1e-5)

    job_id, sessions = _launch(network, {"us-east": 500_000, "eu-west": 500_000})
    with sessions() as s:
        start = s.scalars(select(Allocation.billed_from)).first()
    assert start is not None
    while datetime.now(UTC) < start + timedelta(seconds=1):
        threading.Event().wait(0.05)
    with sessions() as s, s.begin():
        job = s.get(Job, job_id)
        assert job is not None
        lifecycle.end_run(s, job)
    with sessions() as s:
        entries = s.scalars(select(LedgerEntry).where(LedgerEntry.job_id == job_id)).all()
        (held,) = [e for e in entries if e.kind == "bandwidth"]
        end = s.scalars(select(Allocation.ended_at)).first()
        assert end is not None
        seconds = Decimal(str((end - start).total_seconds()))
        assert Decimal(str(held.amount)) == q6(
            q6(Decimal("0.5") * seconds) * Decimal(2) / Decimal(3600)
        )
        assert "us-east" in held.description
        credit = s.scalars(
            select(Posting.amount).where(
                Posting.ledger_id == held.id, Posting.account == "provider"
            )
        ).one()
        assert Decimal(str(credit)) == q6(Decimal(str(held.amount)) * Decimal("0.9"))
        assert settlement.unbalanced(s) == []


@pytest.mark.parametrize("migrated_url", ["sqlite"], indirect=True)  # API logic alone
def test_an_offer_sells_at_most_its_gpus_and_closes_at_its_end(network: Network) -> None:
    """dc-east offers 3 of us-east's 8 A100 at the standard class, for 1.5 s: the planner's
    world has 3 of them free at that class (the spot class, the operator's price, still has
    8), and none once the offer closed."""
    from controller.network.snapshot import build_world

    _, prov = _provider(network, "dc-east", ["us-east"], 0.1)
    until = datetime.now(UTC) + timedelta(seconds=1.5)
    try:
        err = refused(
            lambda: prov.post(
                "/v1/pricing/gpu",
                {"cluster": "us-east", "gpu_model": "A100", "qos_class": "standard",
                 "price_per_gpu_hour": 2.0, "until": "2020-01-01T00:00:00Z"},
            ),
            422,
        )  # fmt: skip
        assert names(err, "until")
        made = prov.post(
            "/v1/pricing/gpu",
            {"cluster": "us-east", "gpu_model": "A100", "qos_class": "standard",
             "price_per_gpu_hour": 2.0, "gpus": 3, "until": until.isoformat()},
        )  # fmt: skip
        assert made["gpus"] == 3
    finally:
        prov.close()
    sessions = make_sessionmaker(make_engine(network.server.database_url))

    def free(qos: str) -> int | None:
        with sessions() as s:
            world = build_world(s, qos)
        found = [c.gpus_free for c in world.snapshot.clusters if c.name.startswith("us-east")]
        return found[0] if found else None

    assert free("standard") == 3
    assert free("spot") == 8
    quote = network.tenant.post("/v1/quotes", spec(gpus=6, steps=200))
    for option in quote["options"]:
        assert all(p["gpus"] <= 3 for p in option["placement"] if p["cluster"] == "us-east")
    while datetime.now(UTC) <= until:
        threading.Event().wait(0.05)
    assert free("standard") is None  # the offer closed: no new placements at its price
    assert free("spot") == 8


@pytest.mark.parametrize("migrated_url", ["sqlite"], indirect=True)  # API logic alone
def test_an_offers_minimum_term_is_quoted_and_billed_once(network: Network) -> None:
    """dc-east sells us-east's A100 for at least an hour a run: a short quote's us-east line
    counts an hour of each GPU, and a run of about a second there is billed 3 GPU-hours in all
    (what it held, and the rest as the minimum term), once, credited to dc-east."""
    _, prov = _provider(network, "dc-east", ["us-east"], 0.1)
    try:
        prov.post(
            "/v1/pricing/gpu",
            {"cluster": "us-east", "gpu_model": "A100", "qos_class": "standard",
             "price_per_gpu_hour": 2.0, "min_hours": 1},
        )  # fmt: skip
    finally:
        prov.close()
    quote = network.tenant.post("/v1/quotes", spec(gpus=8, steps=50))
    for option in quote["options"]:
        for line in option["price"]["gpu"]:
            if line["cluster"] == "us-east":
                assert line["gpu_hours"] >= line["gpus"] * 1.0 - 1e-9
                assert line["amount"] == pytest.approx(line["gpu_hours"] * 2.0, abs=1e-6)
    job_id, sessions = _launch(network)
    with sessions() as s, s.begin():
        job = s.get(Job, job_id)
        assert job is not None
        lifecycle.end_run(s, job)
        lifecycle.end_run(s, job)
    with sessions() as s:
        entries = s.scalars(select(LedgerEntry).where(LedgerEntry.job_id == job_id)).all()
        east = [e for e in entries if "A100 on us-east" in e.description]
        assert len(east) == 2 and any(e.description.startswith("minimum term") for e in east)
        hours = sum(Decimal(str(e.quantity)) for e in east)
        assert abs(hours - Decimal(3)) <= Decimal("0.000002")  # two entries, each to 6 places
        assert sum(Decimal(str(e.amount)) for e in east) == pytest.approx(
            Decimal(6), abs=Decimal("0.00001")
        )
        assert settlement.unbalanced(s) == []
