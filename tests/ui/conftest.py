"""A live `cpn serve` with a priced network and two tenants, and Debian's Chromium to drive it.

The browser is the system's (`/usr/bin/chromium`, installed by `make test`'s set-up), never one
that `playwright install` downloads. Screenshots go to a temporary folder, or to
CPN_UI_SCREENSHOTS when it is set (the docs' picture is taken that way).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.conftest import LiveServer, start_server
from tests.service.conftest import Network, build_network

if TYPE_CHECKING:
    from playwright.sync_api import Browser, BrowserContext, ConsoleMessage, Page

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@dataclass
class Console:
    """The server, its network, and where this run's screenshots go."""

    net: Network
    url: str
    database_url: str
    shots: Path
    admin_key: str
    tenant_key: str
    """Tenant A's (acme's) key."""
    other_key: str
    """Tenant B's (globex's) key."""


@pytest.fixture(scope="module")
def console(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    from controller.store.migrate import upgrade

    url = f"sqlite:///{tmp_path_factory.mktemp('uidb') / 'cpn.db'}"
    upgrade(url)
    live: LiveServer = start_server(database_url=url, run_controller=False)
    net = build_network(live)
    shots = Path(os.environ.get("CPN_UI_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    shots.mkdir(parents=True, exist_ok=True)
    tenant_key = net.admin.create_api_key("tenant", net.tenant_id)["token"]
    other_key = net.admin.create_api_key("tenant", net.other_tenant_id)["token"]
    yield Console(net, live.url, url, shots, live.admin_token, tenant_key, other_key)
    for c in (net.admin, net.tenant, net.other):
        c.close()
    live.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not shutil.which(CHROMIUM):
        message = f"{CHROMIUM} is missing: `make browser` installs it (`make test` does)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@dataclass
class Tab:
    """One signed-out browser tab, and every console error it has seen."""

    context: BrowserContext
    page: Page
    errors: list[str]


@pytest.fixture
def tab(browser: Browser, console: Console) -> Iterator[Tab]:
    yield from open_tab(browser, console)


def open_tab(browser: Browser, console: Console, width: int = 1280) -> Iterator[Tab]:
    context = browser.new_context(base_url=console.url, viewport={"width": width, "height": 900})
    context.set_default_timeout(10_000)  # a broken page fails in seconds, not 30
    page = context.new_page()
    errors: list[str] = []

    def on_console(message: ConsoleMessage) -> None:
        if message.type == "error":
            errors.append(f"{page.url}: {message.text}")

    page.on("console", on_console)
    page.on("pageerror", lambda exc: errors.append(f"{page.url}: {exc}"))
    yield Tab(context, page, errors)
    context.close()


def sign_in(tab: Tab, key: str, home: str = "jobs") -> None:
    """Sign in with `key` and wait for the role's first page (`/ui` takes it there)."""
    page = tab.page
    page.goto("/ui/login")
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(f"**/ui/{home}")
