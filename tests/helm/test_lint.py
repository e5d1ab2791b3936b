"""`helm lint --strict` (warnings count as errors) is clean for every way the chart installs."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import helm_python
import pytest

from tests.helm import chartkit


def _lint(chart_dir: Path, values: dict[str, Any]) -> dict[str, Any]:
    return helm_python.lint(
        chart_dir,
        values,
        strict=True,
        namespace=chartkit.NAMESPACE,
        kube_version=chartkit.KUBE_VERSION,
    )


@pytest.mark.parametrize("scenario", sorted(chartkit.SCENARIOS))
def test_lint_strict_is_clean(scenario: str) -> None:
    report = _lint(chartkit.CHART_DIR, chartkit.SCENARIOS[scenario])
    assert report["total_charts_linted"] == 1
    assert report["errors"] == []
    # Not even the informational findings (an icon, say) are left.
    assert report["messages"] == []


def test_lint_reports_a_broken_chart(tmp_path: Path) -> None:
    """The lint above can fail: a template calling an unknown function is reported."""
    broken = tmp_path / "cpn"
    shutil.copytree(chartkit.CHART_DIR, broken)
    (broken / "templates" / "broken.yaml").write_text("kind: {{ nosuchfunction . }}\n")
    report = _lint(broken, {})
    assert report["errors"] or any(m["severity"] >= 2 for m in report["messages"])
