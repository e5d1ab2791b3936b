"""The version is written once (pyproject.toml); the chart's appVersion and the API follow it."""

from __future__ import annotations

import tomllib
from pathlib import Path

import yaml

from api.version import VERSION
from tests.helm import chartkit

ROOT = Path(__file__).resolve().parents[2]


def test_the_installed_version_is_pyprojects() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert VERSION == project["version"]


def test_the_charts_app_version_is_the_packages() -> None:
    chart = yaml.safe_load((chartkit.CHART_DIR / "Chart.yaml").read_text())
    assert chart["appVersion"] == VERSION


def test_the_openapi_document_says_the_version(tmp_path: Path) -> None:
    from api.app import create_app
    from api.config import Settings

    url = f"sqlite:///{tmp_path / 'cpn.db'}"
    app = create_app(Settings(admin_token="x" * 32, database_url=url, run_controller=False))
    assert app.openapi()["info"]["version"] == VERSION
