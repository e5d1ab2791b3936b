"""checkov, the infrastructure-as-code scanner, faults nothing in the manifests of any of the
chart's value sets.

What checkov would fault and the chart accepts carries a skip annotation in the chart, with its
reason; the skips allowed, and when, are listed here, so a new one is a reviewed change. checkov
runs from its own virtual environment (`make tools`: it pins packages the project's
constraints exclude) on the manifests Helm's engine renders.
"""

from __future__ import annotations

import copy
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helm import chartkit

CHECKOV = chartkit.REPO / ".venv" / "tools" / "checkov" / "bin" / "checkov"
REQUIREMENTS = Path(__file__).with_name("checkov-requirements.txt")

# The only skips the chart may carry. CKV_K8S_43 (image digest) until image.digest is set;
# CKV_K8S_35 (secrets as files) on pods given a cpn secret, which cpn reads from its environment.
ALLOWED_SKIPS = {"CKV_K8S_43", "CKV_K8S_35"}
DIGEST = "sha256:" + "ab" * 32


@dataclass(frozen=True)
class Finding:
    check_id: str
    name: str
    resource: str
    reason: str


@dataclass(frozen=True)
class Report:
    passed: list[Finding]
    failed: list[Finding]
    skipped: list[Finding]


def _findings(results: list[dict[str, Any]]) -> list[Finding]:
    return [
        Finding(
            r["check_id"],
            r["check_name"],
            r["resource"],
            r["check_result"].get("suppress_comment") or "",
        )
        for r in results
    ]


def scan(value_sets: dict[str, dict[str, Any]], where: Path) -> dict[str, Report]:
    """checkov's Kubernetes checks over each release's rendered manifests.

    One checkov process per release, run side by side: its graph checks (a pod tied to a
    NetworkPolicy) would match one release's pods with another's policies in a shared run.
    """
    if not CHECKOV.is_file():
        pytest.fail(
            f"{CHECKOV} is missing: `make tools` installs checkov "
            f"({REQUIREMENTS.name}) into its own virtual environment"
        )
    procs: dict[str, subprocess.Popen[str]] = {}
    for name, values in value_sets.items():
        manifests = where / f"{name}.yaml"
        manifests.write_text(chartkit.render_text(values))
        procs[name] = subprocess.Popen(
            [
                str(CHECKOV),
                "--file",
                str(manifests),
                "--framework",
                "kubernetes",
                "--output",
                "json",
                "--skip-download",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    reports: dict[str, Report] = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        # 0: nothing failed, 1: something failed; anything else is checkov itself failing.
        assert proc.returncode in (0, 1), f"{name}: {err[-4000:]}"
        report = json.loads(out)
        assert report["summary"]["parsing_errors"] == 0, report["summary"]
        results = report["results"]
        reports[name] = Report(
            *(_findings(results[k]) for k in ("passed_checks", "failed_checks", "skipped_checks"))
        )
        assert (proc.returncode == 1) == bool(reports[name].failed), (name, proc.returncode)
    return reports


# The chart's value sets, a pinned image, and a release with its guards taken off.
PINNED = "pinned-image"
UNGUARDED = "unguarded"
VALUE_SETS: dict[str, dict[str, Any]] = {
    **chartkit.SCENARIOS,
    PINNED: copy.deepcopy(chartkit.RAY_VALUES) | {"image": {"digest": DIGEST}},
    UNGUARDED: copy.deepcopy(chartkit.AGENT_VALUES)
    | {"networkPolicy": {"enabled": False}, "image": {"pullPolicy": "IfNotPresent"}},
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Report]:
    return scan(VALUE_SETS, tmp_path_factory.mktemp("checkov"))


def _failures(report: Report) -> str:
    return "\n".join(f"{f.check_id} {f.name}: {f.resource}" for f in report.failed)


@pytest.mark.parametrize("scenario", sorted(chartkit.SCENARIOS))
def test_checkov_faults_nothing(scenario: str, reports: dict[str, Report]) -> None:
    report = reports[scenario]
    assert not report.failed, f"checkov faults {scenario}:\n{_failures(report)}"
    assert {f.resource.split(".")[0] for f in report.passed} >= {"Deployment", "Pod"}
    # Every pod is tied to a NetworkPolicy (checkov's graph check over the pod templates).
    assert any(f.check_id == "CKV2_K8S_6" for f in report.passed)
    for skip in report.skipped:
        assert skip.check_id in ALLOWED_SKIPS, f"unreviewed skip {skip}"
        assert len(skip.reason) > 40, f"a skip says why: {skip}"


def test_a_pinned_image_needs_no_digest_skip(reports: dict[str, Report]) -> None:
    report = reports[PINNED]
    assert not report.failed, _failures(report)
    assert not [s for s in report.skipped if s.check_id == "CKV_K8S_43"]
    pinned = {f.resource for f in report.passed if f.check_id == "CKV_K8S_43"}
    assert pinned == {
        "Deployment.cpn-system.cpn-control-plane",
        "Deployment.cpn-system.cpn-agent",
        "Job.cpn-system.cpn-control-plane-migrate",
    }


def test_checkov_faults_what_the_chart_guards_against(reports: dict[str, Report]) -> None:
    """The scan can fail: without NetworkPolicies, and with a tag pulled only when absent,
    checkov reports both."""
    failed = {f.check_id for f in reports[UNGUARDED].failed}
    assert {"CKV2_K8S_6", "CKV_K8S_15"} <= failed, failed
