"""MkDocs hooks: the reference pages are generated from the code at each build, so none can
fall behind what it documents (`mkdocs build --strict`, run by tests/docs/test_site.py).

- reference/cli.md from the Typer app (typer's own Markdown generator);
- reference/rest.md from the OpenAPI document the server serves;
- reference/settings.md from `api.config.Settings` (every `CPN_*` variable);
- reference/metrics.md from `api.metrics.Metrics`;
- concepts/job-lifecycle.md from `controller/jobs/README.md` and `grammar.states`;
- benchmarks/results/* from `bench/results/` (the tables and their plots).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

REPO = Path(__file__).resolve().parent


def _results() -> list[Path]:
    return sorted((REPO / "bench" / "results").glob("*.md"))


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    """List every benchmark result under Benchmarks, titled by its first heading."""
    pages = []
    for path in _results():
        first = next((x for x in path.read_text().splitlines() if x.startswith("# ")), path.stem)
        pages.append({first.removeprefix("# ").strip(): f"benchmarks/results/{path.name}"})
    for section in config.nav or []:
        if isinstance(section, dict) and "Benchmarks" in section:
            section["Benchmarks"] = [*section["Benchmarks"], *pages]
    return config


def on_files(files: Files, config: MkDocsConfig) -> Files:
    pages = {
        "reference/cli.md": cli_reference(),
        "reference/rest.md": rest_reference(),
        "reference/settings.md": settings_reference(),
        "reference/metrics.md": metrics_reference(),
        "concepts/job-lifecycle.md": job_lifecycle(),
    }
    for uri, content in pages.items():
        files.append(File.generated(config, uri, content=content))
    for path in sorted((REPO / "bench" / "results").iterdir()):
        if path.suffix in (".md", ".png", ".svg"):
            uri = f"benchmarks/results/{path.name}"
            if path.suffix == ".md":
                files.append(File.generated(config, uri, content=path.read_text()))
            else:
                files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files


def cli_reference() -> str:
    import typer
    from typer.cli import get_docs_for_click

    from api.cli import app

    command = typer.main.get_command(app)
    docs = get_docs_for_click(
        obj=command, ctx=typer.Context(command, info_name="cpn"), name="cpn", title="CLI reference"
    )
    intro = (
        "Generated from the `cpn` command's own parsers at each docs build: every command, "
        "option and default here is the one the installed CLI has.\n\n"
    )
    head, _, rest = docs.partition("\n")
    return f"{head}\n\n{intro}{rest.strip()}\n"


def rest_reference() -> str:
    from api.app import create_app
    from api.config import Settings

    with tempfile.TemporaryDirectory() as tmp:
        app = create_app(Settings(database_url=f"sqlite:///{Path(tmp) / 'docs.db'}"))
        spec: dict[str, Any] = app.openapi()
    problem_fields = ", ".join(
        f"`{k}`" for k in spec["components"]["schemas"]["Problem"]["properties"]
    )
    out = [
        "# REST API reference",
        "",
        "Generated from the OpenAPI document the server serves at `/openapi.json` (also "
        "browsable at `/docs` and `/redoc` on a running server). Every error is an RFC 9457 "
        "problem, `application/problem+json`, of the shape below.",
        "",
        f"Problem fields: {problem_fields}.",
        "",
    ]  # fmt: skip
    by_tag: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}
    for path, operations in spec["paths"].items():
        for method, op in operations.items():
            by_tag.setdefault((op.get("tags") or ["other"])[0], []).append((method, path, op))
    for tag, ops in by_tag.items():
        out += [f"## {tag.capitalize()}", ""]
        for method, path, op in ops:
            out += [f"### `{method.upper()} {path}`", ""]
            if op.get("description") or op.get("summary"):
                out += [str(op.get("description") or op.get("summary")).strip(), ""]
            if op.get("security"):
                out += ["Needs a key (`Authorization: Bearer cpn_...`).", ""]
            params = op.get("parameters", [])
            if params:
                out += ["| parameter | in | required | description |", "|---|---|---|---|"]
                for p in params:
                    text = " ".join(str(p.get("description", "")).split()).replace("|", "\\|")
                    required = "yes" if p.get("required") else "no"
                    out.append(f"| `{p['name']}` | {p['in']} | {required} | {text} |")
                out.append("")
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {})
            if body:
                ref = body.get("schema", {}).get("$ref", "")
                out += [f"Body: `{ref.rsplit('/', 1)[-1] or 'JSON'}`.", ""]
            codes = ", ".join(
                f"{code}" + (" (problem)" if int(code) >= 400 else "")
                for code in sorted(op.get("responses", {}))
            )
            out += [f"Answers: {codes}.", ""]
    return "\n".join(out)


def settings_reference() -> str:
    from pydantic_core import PydanticUndefined

    from api.config import Settings

    out = [
        "# Settings reference",
        "",
        "Every setting of `cpn serve` (and the control loop), read from `CPN_*` environment "
        "variables; generated from `api.config.Settings`. A bad value stops `cpn serve` with one "
        "line naming the variable and the fix.",
        "",
        "| variable | default | what |",
        "|---|---|---|",
    ]
    for name, field in Settings.model_fields.items():
        default = "" if field.default is PydanticUndefined else json.dumps(field.default)
        text = " ".join((field.description or "").split()).replace("|", "\\|")
        out.append(f"| `CPN_{name.upper()}` | `{default}` | {text} |")
    return "\n".join(out) + "\n"


def metrics_reference() -> str:
    from prometheus_client import Counter, Histogram

    from api.metrics import Metrics, Scraped

    out = [
        "# Metrics reference",
        "",
        "What `/metrics` exports (Prometheus text format; names and values in base units, "
        "`promtool check metrics` clean); generated from `api.metrics.Metrics`. The Grafana "
        "dashboard `helm/cpn/dashboards/cpn.json` draws them.",
        "",
        "| metric | type | labels | what |",
        "|---|---|---|---|",
    ]
    for metric in vars(Metrics()).values():
        if isinstance(metric, Scraped):
            counter = metric.family.__name__.startswith("Counter")
            name, kind, labels = metric.name, "counter" if counter else "gauge", metric.labels
            doc = metric.documentation
        elif isinstance(metric, Counter | Histogram):
            kind = "counter" if isinstance(metric, Counter) else "histogram"
            name, labels, doc = metric._name, metric._labelnames, metric._documentation
        else:
            continue
        name += "_total" if kind == "counter" and not name.endswith("_total") else ""
        text = " ".join(doc.split()).replace("|", "\\|")
        out.append(f"| `{name}` | {kind} | {', '.join(labels)} | {text} |")
    return "\n".join(out) + "\n"


def job_lifecycle() -> str:
    from grammar.states import TRANSITIONS

    readme = (REPO / "controller" / "jobs" / "README.md").read_text()
    rows = ["| state | may move to |", "|---|---|"]
    for state, moves in TRANSITIONS.items():
        targets = ", ".join(f"`{m}`" for m in sorted(moves)) or "nothing (it has ended)"
        rows.append(f"| `{state}` | {targets} |")
    table = "\n".join(rows)
    return f"{readme.rstrip()}\n\n## The same table\n\n{table}\n"
