"""`cpn` itself: a bare `cpn` prints its help, `--version` the version (issue 51)."""

from __future__ import annotations

import pytest

from api.cli import main
from api.version import VERSION


def test_a_bare_cpn_prints_its_help_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([])
    out, err = capsys.readouterr()
    assert exc.value.code == 0 and "Usage: cpn" in out and "submit" in out
    assert "error" not in err


def test_version_flag_and_command_print_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--version"], ["version"]):
        try:
            main(argv)
        except SystemExit as exc:
            assert exc.code in (0, None)
        assert capsys.readouterr().out.strip() == VERSION


@pytest.mark.parametrize(
    ("env", "named", "hidden"),
    [
        ({"CPN_KEY_RATE_LIMIT": "lots"}, ["CPN_KEY_RATE_LIMIT='lots'", "valid number"], None),
        (
            {"CPN_DATABASE_URL": "postgres://me:hunter2@db/cpn"},
            ["CPN_DATABASE_URL='postgres://me:***@db/cpn'", "postgresql+psycopg://"],
            "hunter2",
        ),
        (
            {"CPN_DATABASE_URL": "sqlite:///x.db", "CPN_REPLICA_TTL_S": "-1"},
            ["CPN_REPLICA_TTL_S='-1'"],
            None,
        ),
    ],
)
def test_a_bad_setting_is_one_line_naming_the_variable(
    env: dict[str, str],
    named: list[str],
    hidden: str | None,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for argv in (["serve"], ["db", "upgrade"], ["db", "current"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err.strip()
        assert exc.value.code == 2 and len(err.splitlines()) == 1, err
        assert err.startswith(f"cpn {' '.join(argv)}: error: CPN_")
        assert all(n in err for n in named), err
        assert hidden is None or hidden not in err


def test_an_unreachable_database_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CPN_DATABASE_URL", "postgresql+psycopg://cpn@127.0.0.1:9/cpn")
    for argv in (["serve"], ["db", "upgrade"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err.strip()
        assert exc.value.code == 1 and len(err.splitlines()) == 1, err
        assert "CPN_DATABASE_URL" in err and ("unreachable" in err or "cannot reach" in err)


def test_shell_completion_completes_commands_and_flags() -> None:
    """`cpn --show-completion bash` prints the script; the script's calls complete (issue 51)."""
    import os
    import subprocess
    import sys

    def complete(words: str) -> list[str]:
        env = {
            **os.environ,
            "_CPN_COMPLETE": "complete_bash",
            "COMP_WORDS": words,
            "COMP_CWORD": str(len(words.split()) - 1),
        }
        ran = subprocess.run(
            [sys.executable, "-m", "api.cli"], env=env, capture_output=True, text=True, timeout=60
        )
        assert ran.returncode == 0, ran.stderr
        return ran.stdout.split()

    assert complete("cpn su") == ["submit"]
    assert {"--follow", "--tail", "--worker"} <= set(complete("cpn logs --"))
    script = subprocess.run(
        [sys.executable, "-m", "api.cli", "--show-completion", "bash"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert script.returncode == 0 and "_cpn_completion" in script.stdout
