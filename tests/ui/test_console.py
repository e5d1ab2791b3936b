"""The web console in a real browser (Debian's Chromium) against a live `cpn serve`."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, expect

from api.processes import wait_until
from tests.service.conftest import spec
from tests.ui.conftest import Console, Tab, open_tab, sign_in

pytestmark = pytest.mark.slow

ADMIN_PAGES = ("network", "jobs", "usage", "pricing", "provider", "admin/providers",
               "admin/clusters", "admin/tenants", "admin/keys", "admin/audit")  # fmt: skip
TENANT_PAGES = ("network", "jobs", "quote", "usage", "pricing")


def shot(tab: Tab, console: Console, name: str) -> Path:
    path = console.shots / f"{name}.png"
    tab.page.screenshot(path=str(path), full_page=True)
    return path


def test_every_admin_page_loads_without_console_errors(tab: Tab, console: Console) -> None:
    sign_in(tab, console.admin_key)
    page = tab.page
    for path in ADMIN_PAGES:
        page.goto(f"/ui/{path}")
        expect(page.locator("nav a[aria-current=page]")).to_have_count(1)
        if path in ("network", "admin/clusters", "admin/tenants", "admin/keys", "admin/audit"):
            expect(page.locator("main tbody tr").first).to_be_visible()
        if path == "network":
            expect(page.locator("#graph g.node")).to_have_count(3)
            expect(page.locator("#graph line.link")).to_have_count(3)
            expect(page.locator("#clusters tbody")).to_contain_text("A100 8/8")
        if path == "pricing":
            expect(page.locator("#gpu-prices tbody tr")).to_have_count(9)
        shot(tab, console, path.replace("/", "-"))
    assert tab.errors == []


def test_admin_actions_cordon_mint_and_bad_input(tab: Tab, console: Console) -> None:
    sign_in(tab, console.admin_key)
    page = tab.page
    page.goto("/ui/network")  # the map follows the network without a reload
    expect(page.locator("#graph g.node.cordoned")).to_have_count(0)
    console.net.admin.post("/v1/clusters/eu-west/cordon")
    expect(page.locator("#graph g.node.cordoned")).to_have_attribute("data-cluster", "eu-west")
    expect(page.locator("#clusters tbody")).to_contain_text("cordoned")
    console.net.admin.post("/v1/clusters/eu-west/uncordon")
    # a declared uplink shows in the ports table and on the map, without a reload
    labels = console.net.admin.get("/v1/clusters/us-east")["labels"]
    patch = {"labels": {**labels, "uplink_gbps": "10"}}
    console.net.admin.request("PATCH", "/v1/clusters/us-east", json=patch)
    expect(page.locator("#ports tbody")).to_contain_text("uplink")
    expect(page.locator("#ports tbody")).to_contain_text("10 Gb/s")
    expect(page.locator('#graph g.node[data-cluster="us-east"] .node-ports')).to_have_text("↑ 0%")
    # a declared link has a capacity only: what is free now is the agents' to measure
    expect(page.locator("#links thead")).to_contain_text("Free now")
    expect(page.locator("#links tbody tr").first.locator("td").nth(3)).to_have_text("-")
    console.net.admin.request("PATCH", "/v1/clusters/us-east", json={"labels": labels})
    page.goto("/ui/admin/clusters")
    page.get_by_role("button", name="Cordon ap-south").click()
    expect(page.get_by_role("button", name="Uncordon ap-south")).to_be_visible()
    assert console.net.admin.get("/v1/clusters/ap-south")["cordoned"] is True
    page.get_by_role("button", name="Uncordon ap-south").click()
    expect(page.get_by_role("button", name="Cordon ap-south")).to_be_visible()

    page.goto("/ui/admin/keys")
    page.get_by_label("Role").select_option("tenant")
    page.get_by_label("Scope (tenant, cluster or provider)").fill("no-such-tenant")
    page.get_by_role("button", name="Mint").click()  # the problem's detail, by its field
    expect(page.locator("#scope-error")).to_contain_text("existing tenant's id or name")
    page.get_by_label("Scope (tenant, cluster or provider)").fill(console.net.other_tenant_id)
    page.get_by_label("Name", exact=True).fill("minted-in-ui")
    page.get_by_role("button", name="Mint").click()
    expect(page.locator("#minted-token")).to_have_text(re.compile(r"^cpn_"))
    token = page.locator("#minted-token").inner_text()
    with console.net.server.client(token) as minted:
        assert minted.get("/v1/jobs")["total"] >= 0
    page.get_by_role("button", name="Revoke minted-in-ui").click()
    expect(page.locator("#keys tbody")).not_to_contain_text("Revoke minted-in-ui")

    page.goto("/ui/admin/tenants")
    page.get_by_label("Tenant", exact=True).select_option(label="globex")
    page.get_by_label("Budget (empty: none)").fill("-5")
    page.get_by_role("button", name="Save").click()
    expect(page.locator("#budget-error")).not_to_be_empty()
    page.get_by_label("Budget (empty: none)").fill("250")
    page.get_by_role("button", name="Save").click()
    expect(page.locator("#saved")).to_have_text("saved")
    assert console.net.admin.get(f"/v1/tenants/{console.net.other_tenant_id}")["budget"] == 250
    # Filled in above: a 422 is logged by the browser as a failed resource load, and only that.
    assert all("422" in e for e in tab.errors), tab.errors


def test_tenant_pages_quote_and_submit(tab: Tab, console: Console) -> None:
    sign_in(tab, console.tenant_key)
    page = tab.page
    for path in TENANT_PAGES:
        page.goto(f"/ui/{path}")
        expect(page.locator("nav a[aria-current=page]")).to_have_count(1)
        expect(page.locator(".who")).to_contain_text("tenant · acme")  # its name, not its id
        if path == "network":  # what it can buy, and nothing of what others use
            expect(page.locator("#graph g.node")).to_have_count(3)
            expect(page.locator("#graph line.link")).to_have_count(3)
            expect(page.locator("#offer tbody tr")).to_have_count(3)
            expect(page.locator("#offer tbody")).to_contain_text("$")
            expect(page.locator("#clusters")).to_be_hidden()
            expect(page.locator("#ports")).to_be_hidden()
        shot(tab, console, f"tenant-{path}")
    assert tab.errors == []
    for path in ("admin/clusters", "admin/keys"):  # a tenant gets the API's 404, not a 403
        response = page.goto(f"/ui/{path}")
        assert response is not None and response.status == 404
    page.goto("/ui/quote")
    page.get_by_label("Steps").fill("0")
    page.get_by_role("button", name="Get a quote").click()
    expect(page.locator("#steps-error")).to_contain_text("greater than or equal to 1")
    page.get_by_label("Steps").fill("500")
    page.get_by_role("button", name="Get a quote").click()
    expect(page.locator("#options article")).to_have_count(2)
    shot(tab, console, "tenant-quote-options")
    page.locator("#options article").last.get_by_role("button").click()
    page.wait_for_url(re.compile(r"/ui/jobs/[0-9a-f-]+$"))
    expect(page.locator("#job-state")).to_have_text("PENDING")
    job_id = page.url.rsplit("/", 1)[1]
    assert console.net.tenant.get(f"/v1/jobs/{job_id}")["quote_id"] is not None
    console.net.tenant.post(f"/v1/jobs/{job_id}/cancel")


def test_sign_in_out_and_csrf(tab: Tab, console: Console) -> None:
    page = tab.page
    page.goto("/ui/jobs")
    page.wait_for_url("**/ui/login?next=/ui/jobs")
    page.get_by_label("API key").fill("cpn_wrong-key")
    page.get_by_role("button", name="Sign in").click()
    expect(page.locator("#key-error")).to_contain_text("unknown, revoked or expired")
    sign_in(tab, console.tenant_key)
    cookie = next(c for c in tab.context.cookies() if c["name"] == "cpn_session")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/"
    assert console.tenant_key not in cookie["value"]
    assert "cpn_session" not in page.evaluate("document.cookie")
    assert console.tenant_key not in page.content()
    # The cookie reads; it changes nothing without the page's CSRF token.
    job = console.net.tenant.post("/v1/jobs", spec(name="csrf", gpus=1))
    status = page.evaluate(
        "id => fetch(`/v1/jobs/${id}/cancel`, {method: 'POST'}).then(r => r.status)", job["id"]
    )
    assert status == 403
    assert console.net.tenant.get(f"/v1/jobs/{job['id']}")["state"] == "PENDING"
    page.get_by_role("button", name="Sign out").click()
    page.wait_for_url("**/ui/login")
    after = page.request.get("/v1/jobs", headers={"Cookie": f"cpn_session={cookie['value']}"})
    assert after.status == 401  # the old cookie signs nobody in
    page.goto("/ui/jobs")
    page.wait_for_url("**/ui/login?next=/ui/jobs")
    console.net.tenant.post(f"/v1/jobs/{job['id']}/cancel")


def test_a_tenant_does_not_see_another_tenants_job(tab: Tab, console: Console) -> None:
    theirs = console.net.other.post("/v1/jobs", spec(name="globex-secret", gpus=1))
    mine = console.net.tenant.post("/v1/jobs", spec(name="acme-own", gpus=1))
    sign_in(tab, console.tenant_key)
    page = tab.page
    expect(page.locator("#jobs tbody")).to_contain_text("acme-own")
    expect(page.locator("#jobs tbody")).not_to_contain_text("globex-secret")
    response = page.goto(f"/ui/jobs/{theirs['id']}")
    assert response is not None and response.status == 404
    expect(page.get_by_role("heading", level=1)).to_have_text("Not found")
    expect(page.locator("main")).not_to_contain_text("globex-secret")
    for job, client in ((theirs, console.net.other), (mine, console.net.tenant)):
        client.post(f"/v1/jobs/{job['id']}/cancel")


def test_admin_pages_name_tenants_not_uuids(tab: Tab, console: Console) -> None:
    """Jobs, a job's page and keys say which tenant by its name (issue 51, item 2)."""
    job = console.net.tenant.post("/v1/jobs", spec(name="named-tenant", gpus=1))
    sign_in(tab, console.admin_key)
    page = tab.page
    row = page.locator("#jobs tbody tr", has_text="named-tenant")
    expect(row).to_contain_text("acme")
    expect(row).not_to_contain_text(console.net.tenant_id[:8])
    page.goto(f"/ui/jobs/{job['id']}")
    expect(page.locator("#summary")).to_contain_text("acme")
    page.goto("/ui/admin/keys")
    expect(page.locator("#keys tbody")).to_contain_text("acme")
    expect(page.locator("#keys tbody")).not_to_contain_text(console.net.tenant_id[:8])
    console.net.tenant.post(f"/v1/jobs/{job['id']}/cancel")
    assert tab.errors == []


def test_cancel_from_the_ui(tab: Tab, console: Console) -> None:
    job = console.net.tenant.post("/v1/jobs", spec(name="to-cancel", gpus=1))
    sign_in(tab, console.tenant_key)
    page = tab.page
    page.goto("/ui/jobs?state=PENDING")
    page.get_by_role("link", name=re.compile("to-cancel")).click()
    expect(page.locator("#job-state")).to_have_text("PENDING")
    expect(page.locator("#job-reason")).to_contain_text("Why it waits")
    page.get_by_role("button", name="Cancel job").click()
    expect(page.locator("#job-state")).to_have_text("CANCELLED")
    expect(page.locator("#timeline")).to_contain_text("CANCELLED")
    assert console.net.tenant.get(f"/v1/jobs/{job['id']}")["state"] == "CANCELLED"
    assert tab.errors == []


@pytest.fixture
def narrow_tab(browser: Browser, console: Console) -> Iterator[Tab]:
    yield from open_tab(browser, console, width=390)


def test_every_page_fits_a_phone(narrow_tab: Tab, console: Console) -> None:
    """At 390 px no page scrolls sideways and no table is cut: a row becomes a card of
    labelled cells ("Cluster  us-east"), so a reader needs no header to read it."""
    long_name = spec(name="a-rather-long-job-name-on-a-phone", gpus=1)
    job = console.net.tenant.post("/v1/jobs", long_name)
    tab = narrow_tab
    sign_in(tab, console.admin_key)
    page = tab.page
    for path in ADMIN_PAGES:
        page.goto(f"/ui/{path}")
        if path in ("jobs", "network", "admin/clusters", "admin/tenants", "admin/keys"):
            expect(page.locator("main tbody tr").first).to_be_visible()
        overflow = page.evaluate(
            """() => [document.documentElement, ...document.querySelectorAll('.scroll')]
                .filter((n) => n.scrollWidth > n.clientWidth + 1)
                .map((n) => `${n.tagName}.${n.className}: ${n.scrollWidth} > ${n.clientWidth}`)"""
        )
        assert overflow == [], f"/ui/{path}: {overflow}"
        first = page.locator("main tbody td[data-label]").first
        if first.count():
            label = first.evaluate("(n) => getComputedStyle(n, '::before').content")
            assert label.strip('"') == first.get_attribute("data-label")
        shot(tab, console, "phone-" + path.replace("/", "-"))
    console.net.tenant.post(f"/v1/jobs/{job['id']}/cancel")
    assert tab.errors == []


def test_a_training_jobs_charts_update_live(
    narrow_tab: Tab, console: Console, tmp_path: Path
) -> None:
    """Progress goes through the control plane's own path (a run handle's reports, flushed
    by `controller.loop.progress.flush` as the loop does), without Ray: the browser must redraw
    its charts from the live event stream as each report is stored, and show the log lines
    that came with it."""
    import time

    from controller.loop.progress import flush
    from tests.controller.world import Net
    from training import Progress, WanBytes
    from training.logs import LogLine

    job = console.net.tenant.post("/v1/jobs", spec(name="live-mlp", gpus=2, steps=300))
    world = Net(console.database_url, tmp_path / "ckpt")
    try:
        assert world.place() == [job["id"]]
        handle = world.start(job["id"])
        tab = narrow_tab
        sign_in(tab, console.tenant_key)
        page = tab.page
        page.goto(f"/ui/jobs/{job['id']}")
        expect(page.locator("#job-state")).to_have_text("RUNNING")
        expect(page.locator("#placement")).to_contain_text("Clusters")
        ends = page.locator("#summary dt:text-is('Expected end') + dd")  # its `ends_at`
        expect(ends).not_to_have_text("—")
        expect(ends).not_to_be_empty()
        for n in range(1, 4):
            step = 100 * n
            handle.on_progress(
                Progress(
                    step=step,
                    total_steps=300,
                    loss=2.0 / n,
                    accuracy=0.3 * n,
                    wall_s=0.5 * n,
                    compute_s=0.3 * n,
                    comm_s=0.1 * n,
                    wan_bytes=WanBytes({("us-east", "eu-west"): 5_000_000 * n}),
                    wan_bytes_total=5_000_000 * n,
                    compression_ratio=8.0,
                    compression="topk",
                    logs=[LogLine(time.time(), "us-east/0", "stdout", f"at step {step}")],
                )
            )
            flush(world.sessions, handle)
            expect(page.locator("#chart-loss polyline.loss")).to_have_attribute(
                "data-points", str(n)
            )
            expect(page.locator("#chart-wan polyline.wan")).to_have_attribute("data-points", str(n))
            expect(page.locator("#loss-last")).to_contain_text(f"step {step}/300")
            expect(page.locator("#logs")).to_contain_text(f"us-east/0 | at step {step}")
        expect(page.locator("#wan-last")).to_contain_text("15.0 MB")
        shot(tab, console, "job-live-narrow")
        page.set_viewport_size({"width": 1280, "height": 900})
        shot(tab, console, "job-live")
        assert tab.errors == []
        console.net.tenant.post(f"/v1/jobs/{job['id']}/cancel")
        wait_until(
            lambda: console.net.tenant.get(f"/v1/jobs/{job['id']}")["state"] == "CANCELLED",
            10,
            "the live job to be cancelled",
        )
    finally:
        world.close()


def test_keyboard_sign_in_and_a_revoked_key_ends_the_session(tab: Tab, console: Console) -> None:
    """Signed in with the keyboard alone (the key field has focus, Enter submits); revoking
    the key ends its console session at once: its pages go back to the sign-in page."""
    made = console.net.admin.create_api_key("tenant", console.net.tenant_id, "short-lived")
    page = tab.page
    page.goto("/ui/login")
    expect(page.get_by_label("API key")).to_be_focused()
    page.keyboard.type(made["token"])
    page.keyboard.press("Enter")
    page.wait_for_url("**/ui/jobs")
    page.keyboard.press("Tab")  # the skip link comes first, then the navigation
    expect(page.get_by_role("link", name="Skip to content")).to_be_focused()
    console.net.admin.request("DELETE", f"/v1/api-keys/{made['id']}")
    page.goto("/ui/usage")
    page.wait_for_url("**/ui/login?next=/ui/usage")
    assert page.request.get("/v1/jobs").status == 401
    assert tab.errors == []


def test_api_docs_render_without_internet(tab: Tab, console: Console) -> None:
    """/docs and /redoc draw every operation with no request leaving the server: the browser
    refuses any other origin, as a machine without internet would."""
    page = tab.page
    elsewhere: list[str] = []

    def offline(route: object) -> None:
        request = route.request  # type: ignore[attr-defined]
        if request.url.startswith(console.url):
            route.continue_()  # type: ignore[attr-defined]
        else:
            elsewhere.append(request.url)
            route.abort()  # type: ignore[attr-defined]

    tab.context.route("**/*", offline)
    page.goto("/docs")
    expect(page.locator(".opblock-summary-path").first).to_be_visible()
    assert page.locator(".opblock").count() >= 40
    page.locator(".opblock-summary-path", has_text="/v1/jobs/{job_id}/cancel").first.click()
    expect(page.locator(".responses-table").first).to_contain_text("412")
    expect(page.locator(".responses-table").first).to_contain_text("application/problem+json")
    shot(tab, console, "api-docs")
    page.goto("/redoc")
    expect(page.get_by_text("/v1/jobs/{job_id}/logs").first).to_be_attached()
    # ReDoc's "powered by" badge is an image on its CDN: without internet, a missing picture
    # in the sidebar's corner; nothing the page needs.
    assert [u for u in elsewhere if not u.startswith("https://cdn.redoc.ly/redoc/logo")] == []
    # The badge's refused request is the one error the page may log.
    assert [e for e in tab.errors if "net::ERR_FAILED" not in e or not elsewhere] == []


def test_a_provider_sees_its_own_books_and_offers_from_the_console(
    tab: Tab, console: Console
) -> None:
    """A provider's key signs in to its own page: its cluster's use, its offers (and posts
    one, a bad price refused at the field), its statement; the tenants' pages are 404s to
    it. The admin's market view lists it, and refuses a payout over what it is owed."""
    admin = console.net.admin
    made = admin.post("/v1/providers", {"name": "dc-south", "clusters": ["ap-south"]})
    key = admin.create_api_key("provider", made["id"])["token"]
    sign_in(tab, key, home="provider")
    page = tab.page
    expect(page.locator(".who")).to_contain_text("provider · dc-south")
    expect(page.locator("#provider-clusters tbody")).to_contain_text("ap-south")
    expect(page.locator("#offers tbody tr")).to_have_count(3)  # the operator's, until replaced
    expect(page.locator("#earnings")).to_contain_text("$0.000000")
    assert tab.errors == []
    page.get_by_label("GPU model").fill("L4")
    page.get_by_label("Per GPU-hour ($)").fill("-1")
    page.get_by_role("button", name="Offer").click()
    expect(page.locator("#price_per_gpu_hour-error")).to_contain_text("greater than or equal to 0")
    page.get_by_label("Per GPU-hour ($)").fill("0.65")
    page.get_by_role("button", name="Offer").click()
    expect(page.locator("#offers tbody")).to_contain_text("dc-south")
    shot(tab, console, "provider")
    for path in ("jobs", "usage", "admin/providers"):
        response = page.goto(f"/ui/{path}")
        assert response is not None and response.status == 404
    page.goto("/ui/pricing")
    expect(page.locator("#gpu-prices tbody")).to_contain_text("dc-south")
    # the refused offer and the pages refused on purpose, and nothing else
    assert all(re.search(r"status of (422|404)", e) for e in tab.errors), tab.errors
    current = [
        g for g in console.net.tenant.get("/v1/pricing")["gpu"]
        if g["cluster"] == "ap-south" and g["qos_class"] == "standard"
    ]  # fmt: skip
    assert [(g["price_per_gpu_hour"], g["provider"]) for g in current] == [(0.65, "dc-south")]

    page.context.clear_cookies()  # a tenant's quote names dc-south's part of its price
    sign_in(tab, console.tenant_key)
    page.goto("/ui/quote")
    page.get_by_label("GPUs").fill("20")  # more than us-east and eu-west have: ap-south too
    page.get_by_role("button", name="Get a quote").click()
    expect(page.locator("#options article").first).to_contain_text("dc-south $")
    expect(page.locator("#options article").first).to_contain_text("operator $")

    page.context.clear_cookies()
    sign_in(tab, console.admin_key)
    page.goto("/ui/admin/providers")
    expect(page.locator("#providers tbody")).to_contain_text("dc-south")
    tab.errors.clear()
    page.get_by_label("Amount ($, exact)").fill("5")
    page.get_by_role("button", name="Record").click()
    expect(page.locator("#form-error, #amount-error").first).to_contain_text("exceeds")
    page.locator("#providers tbody a", has_text="dc-south").click()
    page.wait_for_url("**/ui/provider?p=dc-south")
    expect(page.locator("#provider-clusters tbody")).to_contain_text("ap-south")
    shot(tab, console, "admin-provider")
    assert all("status of 409" in e for e in tab.errors), tab.errors  # the refused payout
