"""What a tenant may ask for (issue 14, items 2 and 3), over a real server on each backend.

Priority is granted, not chosen: a tenant's priority ceiling (0) and QoS classes (standard,
spot) are an admin's to raise; a quote or job beyond them is a 403 naming the field and the
grant. `module:function` tasks run only from module prefixes in CPN_TASK_MODULES (none by
default), and the control plane never imports a tenant's module to check it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from api.client import ApiError
from tests.conftest import start_server
from tests.service.conftest import Network, build_network, spec

WORK = {"params": 1000, "flops_per_step": 1e9}


def refused(call: Callable[[], Any], status: int, field: str) -> ApiError:
    """The problem `call` answers, which must name `field`."""
    with pytest.raises(ApiError) as caught:
        call()
    error = caught.value
    assert error.status == status, error
    assert [e["field"] for e in error.errors] == [field], error.errors
    return error


def patch_tenant(net: Network, tenant_id: str, body: dict[str, Any]) -> Any:
    return net.admin.request("PATCH", f"/v1/tenants/{tenant_id}", json=body)


# ---- priority ceilings and QoS classes -----------------------------------------------------


def test_a_new_tenant_is_granted_priority_0_in_standard_and_spot(network: Network) -> None:
    tenant = network.admin.get(f"/v1/tenants/{network.tenant_id}")
    assert tenant["priority_ceiling"] == 0 and tenant["qos_classes"] == ["standard", "spot"]
    listed = {t["id"]: t for t in network.admin.get("/v1/tenants")["items"]}
    assert listed[network.tenant_id]["priority_ceiling"] == 0
    network.tenant.post("/v1/jobs", spec(qos={"priority": 0, "qos_class": "spot"}))


@pytest.mark.parametrize("path", ["/v1/quotes", "/v1/jobs"])
def test_priority_above_the_ceiling_is_refused_until_an_admin_raises_it(
    network: Network, path: str
) -> None:
    body = spec(qos={"priority": 5})
    error = refused(lambda: network.tenant.post(path, body), 403, "qos.priority")
    assert "priority ceiling 0" in error.detail and "ask an admin" in error.detail
    assert network.tenant.get("/v1/jobs")["total"] == 0

    raised = patch_tenant(network, network.tenant_id, {"priority_ceiling": 5})
    assert raised["priority_ceiling"] == 5
    assert network.admin.get(f"/v1/tenants/{network.tenant_id}")["priority_ceiling"] == 5
    created = network.tenant.post(path, body)
    if path == "/v1/jobs":
        assert created["priority"] == 5 and created["state"] == "PENDING"
    error = refused(
        lambda: network.tenant.post(path, spec(qos={"priority": 6})), 403, "qos.priority"
    )
    assert "priority ceiling 5" in error.detail
    audit = network.admin.get("/v1/audit")["items"]
    assert any(
        a["action"] == "tenant.update" and a["detail"].get("priority_ceiling") == 5 for a in audit
    )


def test_guaranteed_is_granted_by_an_admin(network: Network) -> None:
    body = spec(qos={"qos_class": "guaranteed"})
    for path in ("/v1/quotes", "/v1/jobs"):
        error = refused(partial(network.tenant.post, path, body), 403, "qos.qos_class")
        assert "standard, spot" in error.detail
    patch_tenant(network, network.tenant_id, {"qos_classes": ["guaranteed", "standard"]})
    assert network.tenant.post("/v1/jobs", body)["qos_class"] == "guaranteed"
    # spot is no longer granted: a grant is the whole list
    refused(
        lambda: network.tenant.post("/v1/jobs", spec(qos={"qos_class": "spot"})),
        403,
        "qos.qos_class",
    )


def test_lowering_a_ceiling_never_loses_a_job(network: Network) -> None:
    patch_tenant(network, network.tenant_id, {"priority_ceiling": 7})
    job = network.tenant.post("/v1/jobs", spec(qos={"priority": 7}))
    patch_tenant(network, network.tenant_id, {"priority_ceiling": 0})
    assert network.tenant.get(f"/v1/jobs/{job['id']}")["state"] == "PENDING"


def test_the_grant_is_set_at_creation_and_bounded(network: Network) -> None:
    vip = network.admin.post(
        "/v1/tenants",
        {
            "name": "vip",
            "priority_ceiling": 100,
            "qos_classes": ["guaranteed", "standard", "guaranteed"],
        },
    )
    assert vip["priority_ceiling"] == 100 and vip["qos_classes"] == ["guaranteed", "standard"]
    bad: list[tuple[dict[str, Any], str]] = [
        ({"priority_ceiling": None}, "priority_ceiling"),
        ({"priority_ceiling": 5000}, "priority_ceiling"),
        ({"qos_classes": []}, "qos_classes"),
        ({"qos_classes": ["gold"]}, "qos_classes.0"),
    ]
    for body, field in bad:
        refused(partial(patch_tenant, network, vip["id"], body), 422, field)
    assert network.admin.get(f"/v1/tenants/{vip['id']}")["priority_ceiling"] == 100


def test_a_tenant_cannot_grant_itself(network: Network) -> None:
    with pytest.raises(ApiError) as caught:
        network.tenant.request(
            "PATCH", f"/v1/tenants/{network.tenant_id}", json={"priority_ceiling": 1000}
        )
    assert caught.value.status == 403
    assert network.admin.get(f"/v1/tenants/{network.tenant_id}")["priority_ceiling"] == 0


# ---- entrypoints ---------------------------------------------------------------------------


@pytest.fixture
def allowing(db_url: str) -> Iterator[Network]:
    """The priced network, on a server whose admin allows tasks under tests.e2e."""
    live = start_server(database_url=db_url, run_controller=False, task_modules="tests.e2e")
    net = build_network(live)
    yield net
    for c in (net.admin, net.tenant, net.other):
        c.close()
    live.stop()


@pytest.mark.parametrize("path", ["/v1/quotes", "/v1/jobs"])
def test_module_tasks_are_refused_by_default(network: Network, path: str) -> None:
    for task in ("os:abort", "tests.e2e.bad_task:explode"):
        error = refused(partial(network.tenant.post, path, spec(task=task, work=WORK)), 422, "task")
        assert "builtin: tasks only" in error.detail and "CPN_TASK_MODULES" in error.detail
    assert network.tenant.get("/v1/jobs")["total"] == 0


@pytest.mark.parametrize("path", ["/v1/quotes", "/v1/jobs"])
def test_module_tasks_run_only_under_allowed_prefixes(allowing: Network, path: str) -> None:
    net = allowing
    for task in ("os:abort", "tests.e2ex.mod:f", "tests:f", "tests.e2e.bad_task:__import__"):
        error = refused(partial(net.tenant.post, path, spec(task=task, work=WORK)), 422, "task")
        assert "task" in error.detail
    net.tenant.post(path, spec(task="tests.e2e.bad_task:explode", work=WORK))
    net.tenant.post(path, spec(task="tests.e2e:anything", work=WORK))  # the prefix itself


@pytest.fixture
def side_effect_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An importable package whose import writes a file: the proof it was imported."""
    marker = tmp_path / "imported"
    package = tmp_path / "cpn_probe_sidefx"
    package.mkdir()
    (package / "__init__.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('imported')\n"
    )
    (package / "sub.py").write_text("def main():\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return marker


@pytest.mark.parametrize("allowed", [False, True], ids=["refused", "allowed"])
def test_checking_a_task_never_imports_it(
    db_url: str, side_effect_module: Path, allowed: bool
) -> None:
    """Refused or accepted, a tenant's module is never imported by the control plane: not the
    one it names, not its parents (finding a submodule's spec imports its package)."""
    assert "this" not in sys.modules  # `import this` prints the Zen of Python: a side effect
    settings: dict[str, Any] = {"task_modules": "cpn_probe_sidefx"} if allowed else {}
    live = start_server(database_url=db_url, run_controller=False, **settings)
    try:
        net = build_network(live)
        probe = spec(task="cpn_probe_sidefx.sub:main", work=WORK)
        if allowed:
            net.tenant.post("/v1/quotes", probe)
            net.tenant.post("/v1/jobs", probe)
        else:
            refused(lambda: net.tenant.post("/v1/jobs", probe), 422, "task")
        refused(lambda: net.tenant.post("/v1/jobs", spec(task="this.x:f", work=WORK)), 422, "task")
    finally:
        live.stop()
    assert not side_effect_module.exists()
    assert "cpn_probe_sidefx" not in sys.modules and "this" not in sys.modules
