"""The docs site (issue 51, item 6): `mkdocs build --strict` passes (no broken link, no page
left out of the navigation), nothing is fetched from elsewhere, and the generated reference
pages cover the code they document."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from api.config import Settings


def test_the_site_builds_strict_and_offline(repo_root: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=repo_root, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-4000:]
    pages = list(site.rglob("*.html"))
    assert len(pages) > 30
    remote = re.compile(r"<(?:script|link|img)[^>]*(?:src|href)=\"https?://")
    for page in pages:
        assert not remote.search(page.read_text()), f"{page} loads something from elsewhere"

    def text(name: str) -> str:
        return (site / "reference" / name).read_text()

    cli = text("cli.html")
    for command in ("cpn serve", "cpn submit", "cpn logs", "cpn login", "cpn config use-context"):
        assert command in cli, command
    settings = text("settings.html")
    for name in Settings.model_fields:
        assert f"CPN_{name.upper()}" in settings, name
    metrics = text("metrics.html")
    assert "cpn_tenant_jobs" in metrics and "cpn_link_rtt_seconds" in metrics
    rest = text("rest.html")
    for route in ("/v1/jobs/{job_id}/logs", "/v1/tenants/{tenant_id}/usage", "/v1/agent/heartbeat"):
        assert route in rest, route
    assert (site / "benchmarks" / "results" / "fault-testbed.html").exists()
    # a job's life is drawn (by Graphviz, inline: no script), from the same source as GitHub's
    life = (site / "concepts" / "job-lifecycle.html").read_text()
    from grammar.states import TRANSITIONS

    start = life.index('<div class="state-diagram">')
    drawn = life[start : life.index("</svg>", start)]
    for state in TRANSITIONS:
        assert f">{state}</text>" in drawn, state
    assert life.count('<div class="state-diagram">') == 2 and "Mermaid source" in life
