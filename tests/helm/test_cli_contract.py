"""The commands and flags the chart's containers run exist in the real `cpn` CLI.

Read from the rendered manifests (not from a list kept here), run as `cpn <subcommand> --help`
with the installed console script, and checked against the CLI's own option definitions.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from typing import Any

import pytest
import typer

from tests.helm import chartkit

CPN = chartkit.REPO / ".venv" / "bin" / "cpn"


@dataclass(frozen=True)
class Invocation:
    where: str
    subcommand: tuple[str, ...]
    flags: dict[str, str | None]
    args: tuple[str, ...]
    env: dict[str, dict[str, Any]]


def _invocations() -> list[Invocation]:
    found: dict[tuple[str, ...], Invocation] = {}  # one per distinct command line
    for scenario, values in chartkit.SCENARIOS.items():
        for workload, container in chartkit.cpn_containers(chartkit.render(values)):
            args: list[str] = container["args"]
            split = next((i for i, a in enumerate(args) if a.startswith("-")), len(args))
            flags: dict[str, str | None] = {}
            rest = args[split:]
            i = 0
            while i < len(rest):
                assert rest[i].startswith("--"), f"positional {rest[i]!r} after flags: {args}"
                if i + 1 < len(rest) and not rest[i + 1].startswith("--"):
                    flags[rest[i]] = rest[i + 1]
                    i += 2
                else:
                    flags[rest[i]] = None
                    i += 1
            where = f"{scenario}: {workload['kind']}/{workload['metadata']['name']}"
            invocation = Invocation(
                where, tuple(args[:split]), flags, tuple(rest), chartkit.env_of(container)
            )
            found.setdefault(tuple(args), invocation)
    return list(found.values())


INVOCATIONS = _invocations()


def test_the_chart_runs_serve_db_upgrade_and_agent() -> None:
    assert {i.subcommand for i in INVOCATIONS} == {("serve",), ("db", "upgrade"), ("agent",)}


def _help(subcommand: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "300", "NO_COLOR": "1", "TERM": "dumb"}
    return subprocess.run(
        [str(CPN), *subcommand, "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("invocation", INVOCATIONS, ids=lambda i: i.where)
def test_help_lists_every_flag_the_chart_passes(invocation: Invocation) -> None:
    result = _help(invocation.subcommand)
    assert result.returncode == 0, (
        f"{invocation.where}: `cpn {' '.join(invocation.subcommand)} --help` failed: "
        f"{result.stderr.strip()}"
    )
    words = set(result.stdout.replace("│", " ").replace(",", " ").split())
    for flag in invocation.flags:
        assert flag in words, f"{invocation.where}: {flag} is not in the help of the command"


def _command(subcommand: tuple[str, ...]) -> Any:
    """The Typer/click command object behind `cpn <subcommand>`."""
    from api.cli import app

    command: Any = typer.main.get_command(app)
    for word in subcommand:
        command = command.commands[word]
    return command


@pytest.mark.parametrize("invocation", INVOCATIONS, ids=lambda i: i.where)
def test_the_chart_arguments_parse(invocation: Invocation, monkeypatch: pytest.MonkeyPatch) -> None:
    """The exact argument list, with the container's environment, passes the CLI's own parser:
    types, ranges, choices, URL checks and required options (from flags or env)."""
    for name, entry in invocation.env.items():
        monkeypatch.setenv(name, entry.get("value", "value-from-a-secret"))
    command = _command(invocation.subcommand)
    prog = " ".join(("cpn", *invocation.subcommand))
    try:
        with command.make_context(prog, list(invocation.args)) as ctx:
            parsed = ctx.params
    except Exception as exc:  # click/typer usage errors carry the reason
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        pytest.fail(f"{invocation.where}: `{prog}` rejects the chart's arguments: {message}")
    for flag, value in invocation.flags.items():
        name = flag.lstrip("-").replace("-", "_")
        assert name in parsed, f"{invocation.where}: {flag} parsed into nothing"
        if value is not None:
            assert str(parsed[name]).rstrip("/") == value.rstrip("/"), (flag, parsed[name])


def test_agent_token_comes_from_the_environment_the_cli_reads() -> None:
    token = next(p for p in _command(("agent",)).params if "--token" in p.opts)
    assert token.envvar == "CPN_AGENT_TOKEN"
    agents = [i for i in INVOCATIONS if i.subcommand == ("agent",)]
    assert agents
    for agent in agents:
        assert "secretKeyRef" in agent.env["CPN_AGENT_TOKEN"]["valueFrom"]
        assert "--token" not in agent.flags
