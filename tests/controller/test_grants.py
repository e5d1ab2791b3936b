"""Granted priority in the control loop, and what tenants read of other jobs and of errors
(issue 14, items 2 and 3): the real reconcile pass, launcher and settlement over a migrated
database on each backend, without Ray (see `world.py`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.access import scrub
from controller.access.tenancy import check_grant, granted
from controller.store.models import Job, Tenant
from controller.values.errors import Forbidden
from grammar.states import JobState
from tests.controller.world import Net, progress, report, spec
from wire.spec import QoSSpec


@pytest.fixture
def net(db_url: str, tmp_path: Path) -> Iterator[Net]:
    """Clusters east and west, 4 A100 each, joined by a fast link."""
    n = Net(db_url, tmp_path)
    n.cluster("east", gpus=4, price="2.5")
    n.cluster("west", gpus=4, price="3.0")
    n.link("east", "west")
    yield n
    n.close()


def set_ceiling(net: Net, tenant_id: str, ceiling: int) -> None:
    """What PATCH /v1/tenants/{id} {"priority_ceiling": ...} stores."""
    with net.sessions() as s, s.begin():
        tenant = s.get(Tenant, tenant_id)
        assert tenant is not None
        tenant.priority_ceiling = ceiling


def test_check_grant_names_the_field_and_the_grant() -> None:
    tenant = Tenant(name="t", priority_ceiling=3, qos_classes=["standard", "spot"])
    check_grant(tenant, QoSSpec(priority=3))
    check_grant(tenant, QoSSpec(priority=-1000, qos_class="spot"))
    with pytest.raises(Forbidden, match="priority ceiling 3") as high:
        check_grant(tenant, QoSSpec(priority=4))
    assert high.value.field == "qos.priority" and high.value.status == 403
    with pytest.raises(Forbidden, match="may use standard, spot") as cls:
        check_grant(tenant, QoSSpec(qos_class="guaranteed"))
    assert cls.value.field == "qos.qos_class"
    assert granted(9, 5) == 5 and granted(-2, 5) == -2


@pytest.mark.parametrize("change", ["lower the victim's ceiling", "raise the preemptor's"])
def test_preemption_takes_only_a_job_granted_less(net: Net, change: str) -> None:
    """The spot job's tenant was granted 5 and asked 5; the other tenant's job asks for 9 but
    was granted 5: equal, so nothing is preempted, however the jobs' specs read. Once the
    grants differ (either way), the job granted more preempts the one granted less."""
    owner = net.tenant("owner", priority_ceiling=5)
    urgent = net.tenant("urgent", priority_ceiling=5)
    victim = net.submit(owner, spec("victim", gpus=8, qos={"qos_class": "spot", "priority": 5}))
    assert net.place() == [victim]
    run = net.start(victim)
    run.on_progress(progress(30, run.clusters))
    asker = net.submit(urgent, spec("asker", gpus=2, qos={"priority": 9}))

    assert net.place() == []
    assert net.job(victim).preempted_by is None
    assert net.job(asker).reason == "waiting: 0 free GPUs where the job may run; it needs 2"
    net.launcher.tick()
    assert run.stop is None

    if change == "lower the victim's ceiling":
        set_ceiling(net, owner, 4)
    else:
        set_ceiling(net, urgent, 9)
    assert net.place() == []
    assert net.job(victim).preempted_by == asker
    net.launcher.tick()
    done = net.finish(run, report=report(30, run.clusters, stopped=True))
    assert done.state is JobState.PENDING
    assert net.place() == [asker]


def test_reasons_never_name_another_tenants_job(net: Net) -> None:
    owner = net.tenant("owner")
    urgent = net.tenant("urgent", priority_ceiling=10)
    victim = net.submit(owner, spec("victim", gpus=8, qos={"qos_class": "spot"}))
    assert net.place() == [victim]
    run = net.start(victim)
    high = net.submit(urgent, spec("high", gpus=2, qos={"priority": 10}))
    assert net.place() == []
    assert net.job(victim).preempted_by == high  # the control plane knows (and logs) it
    assert net.job(high).reason == "waiting: preempting 1 lower-priority job(s)"
    net.launcher.tick()
    net.finish(run, report=report(30, run.clusters, stopped=True))
    assert net.place() == [high]
    read_by_owner = [net.job(victim).reason, *net.messages(victim)]
    read_by_urgent = [net.job(high).reason, *net.messages(high)]
    assert "preempted by a higher-priority job; checkpointed, resumes later" in read_by_owner
    assert not any(high in text for text in read_by_owner)
    assert not any(victim in text for text in read_by_urgent)


SECRET = "cpn_admin_0123456789abcdef-super-secret"
DB_PASSWORD = "pw-s3cret-xyz"


def test_a_runs_error_reaches_its_tenant_masked_and_bounded(
    net: Net, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CPN_ADMIN_TOKEN", SECRET)
    monkeypatch.setenv("CPN_DATABASE_URL", f"postgresql+psycopg://cpn:{DB_PASSWORD}@db:5432/cpn")
    tenant = net.tenant("acme")
    job_id = net.submit(tenant, spec("leaky", gpus=2))
    assert net.place() == [job_id]
    run = net.start(job_id)
    venv = "/opt/cpn/.venv/lib/python3.11/site-packages/"
    error = ValueError(
        "ray::Worker.setup() (pid=4242, ip=10.1.2.3, actor_id=ab12, repr=<training.worker.Worker"
        " object at 0x7f3a2b>)\nTraceback (most recent call last):\n"
        f'  File "{venv}ray/_private/worker.py", line 9, in main\n'
        f"token={SECRET} password={DB_PASSWORD}\n" + "noise " * 2000 + "\nthe task's own error"
    )
    job = net.finish(run, error=error)
    assert job.state is JobState.FAILED
    with net.sessions() as s:
        reason = s.get(Job, job_id).reason  # type: ignore[union-attr]
    texts = [reason, *net.messages(job_id)]
    message = next(m for m in texts if m.startswith("ValueError: "))
    assert len(message) <= scrub.ERROR_LIMIT and len(reason) <= 512
    assert message.endswith("the task's own error")  # the tail, where the error is, is kept
    assert "token=*** password=***" in message
    assert 'File "worker.py", line 9, in main' in message
    for text in texts:
        for leak in (SECRET, DB_PASSWORD, "10.1.2.3", "pid=4242", "site-packages", "0x7f3a2b"):
            assert leak not in text, (leak, text[:300])
