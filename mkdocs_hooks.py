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
import re
import subprocess
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
                out += [f"Body: {_schema_type(body.get('schema', {}))}.", ""]
            answers = []
            for code, answer in sorted(op.get("responses", {}).items()):
                if int(code) >= 400:
                    answers.append(f"{code} (problem)")
                    continue
                content = answer.get("content", {}).get("application/json", {})
                shape = _schema_type(content["schema"]) if content.get("schema") else ""
                answers.append(f"{code} {shape}".strip())
            out += [f"Answers: {', '.join(answers)}.", ""]
    return "\n".join(out + _schemas_reference(spec["components"]["schemas"]))


def _schemas_reference(schemas: dict[str, Any]) -> list[str]:
    out = ["## Schemas", "", "The bodies the operations above take and answer.", ""]
    for name, schema in sorted(schemas.items()):
        out += [f"### {name}", ""]
        if schema.get("description"):
            out += [" ".join(str(schema["description"]).split()), ""]
        if schema.get("enum"):
            out += ["One of " + ", ".join(f"`{v}`" for v in schema["enum"]) + ".", ""]
        fields = schema.get("properties", {})
        if fields:
            out += ["| field | type | required | description |", "|---|---|---|---|"]
            for field, sub in fields.items():
                text = " ".join(str(sub.get("description", "")).split()).replace("|", "\\|")
                required = "yes" if field in schema.get("required", ()) else "no"
                out.append(f"| `{field}` | {_schema_type(sub)} | {required} | {text} |")
            out.append("")
    return out


def _schema_type(schema: dict[str, Any]) -> str:
    """A schema as a reader says it: `integer`, `list of Job`, `Quote or null`, linked."""
    if "$ref" in schema:
        name = str(schema["$ref"]).rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            return " or ".join(_schema_type(x) for x in schema[key])
    kind = schema.get("type")
    if kind == "array":
        return "list of " + _schema_type(schema.get("items", {}))
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return "map to " + _schema_type(schema["additionalProperties"])
    if "enum" in schema and kind is None:
        return " / ".join(f"`{v}`" for v in schema["enum"])
    return str(kind or "any")


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


_MERMAID = re.compile(r"```mermaid\n(stateDiagram-v2\n.*?)```\n", re.S)


def state_diagram_dot(mermaid: str) -> str:
    """The Graphviz source of a Mermaid `stateDiagram-v2` as the READMEs write them (`A --> B`,
    `A --> B: label`, `name: description`, `[*]`, `direction LR`): GitHub draws the Mermaid,
    the offline site draws this."""
    lines = [
        "digraph states {",
        'node [shape=box style="rounded,filled" fillcolor="#edf2f7" fontname="sans-serif"];',
        'edge [fontname="sans-serif" fontsize=9];',
    ]
    ends = 0
    for raw in mermaid.splitlines()[1:]:
        line = raw.strip()
        if line.startswith("direction "):
            lines.append(f"rankdir={line.split()[1]};")
        elif "-->" in line:
            left, _, right = line.partition("-->")
            target, _, label = right.partition(":")
            a, b = left.strip(), target.strip()
            if a == "[*]":
                a = "start"
                lines.append('start [shape=point width=0.15 label=""];')
            if b == "[*]":
                ends += 1
                b = f"end{ends}"
                lines.append(f'{b} [shape=doublecircle width=0.1 label="" fillcolor=black];')
            lines.append(f"{json.dumps(a)} -> {json.dumps(b)} [label={json.dumps(label.strip())}];")
        elif ":" in line:
            name, _, text = line.partition(":")
            lines.append(f"{json.dumps(name.strip())} [label={json.dumps(text.strip())}];")
    return "\n".join([*lines, "}"])


def draw_state_diagrams(markdown: str) -> str:
    """Each Mermaid state diagram drawn as an inline SVG by Graphviz's `dot` (no script, no CDN),
    its source kept below it, folded."""

    def draw(match: re.Match[str]) -> str:
        dot = subprocess.run(
            ["dot", "-Tsvg"], input=state_diagram_dot(match[1]), capture_output=True,
            text=True, check=True,
        )  # fmt: skip
        svg = dot.stdout[dot.stdout.index("<svg") :]
        return (f'<div class="state-diagram">\n{svg}\n</div>\n\n<details markdown><summary>Mermaid '
                f"source</summary>\n\n```text\n{match[1]}```\n\n</details>\n")  # fmt: skip

    return _MERMAID.sub(draw, markdown)


def job_lifecycle() -> str:
    from grammar.states import TRANSITIONS

    readme = draw_state_diagrams((REPO / "controller" / "jobs" / "README.md").read_text())
    rows = ["| state | may move to |", "|---|---|"]
    for state, moves in TRANSITIONS.items():
        targets = ", ".join(f"`{m}`" for m in sorted(moves)) or "nothing (it has ended)"
        rows.append(f"| `{state}` | {targets} |")
    table = "\n".join(rows)
    return f"{readme.rstrip()}\n\n## The same table\n\n{table}\n"
