"""What can be checked of the image without a Docker engine: the Dockerfile's instructions agree
with the project and the chart, and its build context installs into a `cpn` whose commands run
outside the source tree."""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from tests.helm import chartkit

REPO = chartkit.REPO
DOCKERFILE = REPO / "Dockerfile"


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = pending + stripped
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


INSTRUCTIONS = _instructions(DOCKERFILE.read_text())


def _stages() -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for instruction in INSTRUCTIONS:
        if instruction[0] == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(instruction)
    return stages


def _args(stage: list[tuple[str, str]], word: str) -> list[str]:
    return [rest for w, rest in stage if w == word]


def _arg_defaults() -> dict[str, str]:
    defaults = {}
    for word, rest in INSTRUCTIONS:
        if word == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            defaults[name] = value
    return defaults


def _pyproject() -> dict[str, object]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _pin(requirement_file: Path, name: str) -> str:
    match = re.search(rf"^{name}==(\S+)$", requirement_file.read_text(), re.MULTILINE)
    assert match, f"{name} is not pinned in {requirement_file.name}"
    return match.group(1)


def test_multi_stage_on_one_configurable_base() -> None:
    stages = _stages()
    assert len(stages) >= 2, "build tools and caches stay in the build stage"
    preamble = INSTRUCTIONS[: INSTRUCTIONS.index(stages[0][0])]
    assert any(w == "ARG" and r.startswith("BASE_IMAGE=") for w, r in preamble)
    for stage in stages:
        assert stage[0][1].startswith("${BASE_IMAGE}"), stage[0]
    base = _arg_defaults()["BASE_IMAGE"]
    version = re.match(r"python:(\d+\.\d+)", base)
    assert version, f"default base {base} is not a python image"
    requires = SpecifierSet(str(_pyproject()["project"]["requires-python"]))  # type: ignore[index]
    assert f"{version.group(1)}.0" in requires


def test_cpu_torch_by_default_at_the_projects_pin() -> None:
    defaults = _arg_defaults()
    assert defaults["TORCH_INDEX_URL"].endswith("/whl/cpu")
    assert defaults["TORCH_VERSION"] == _pin(REPO / "constraints.txt", "torch")
    build = _stages()[0]
    installs = " ".join(_args(build, "RUN"))
    assert '--index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"' in installs
    assert "-c constraints.txt" in installs, "the rest installs at the project's pins"


def test_runtime_is_non_root_with_the_charts_uid() -> None:
    runtime = _stages()[-1]
    (user,) = _args(runtime, "USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0, "numeric, so runAsNonRoot can be verified"
    pod = chartkit.values_yaml()["podSecurityContext"]
    assert (int(uid), int(gid or uid)) == (pod["runAsUser"], pod["runAsGroup"])
    assert pod["runAsNonRoot"] is True


def test_entrypoint_is_the_cpn_console_script() -> None:
    runtime = _stages()[-1]
    (entrypoint,) = _args(runtime, "ENTRYPOINT")
    assert entrypoint == '["cpn"]', "exec form, so a container's args are cpn's arguments"
    assert _pyproject()["project"]["scripts"]["cpn"] == "api.cli:main"  # type: ignore[index]
    assert any("/opt/venv" in r and "--from=build" in r for r in _args(runtime, "COPY"))
    assert any("PATH=/opt/venv/bin" in r for r in _args(runtime, "ENV"))


def _ignored(path: str) -> bool:
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    return any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(path.split("/")[0], p) for p in patterns)


def _copied_sources() -> list[str]:
    sources = []
    for rest in _args(_stages()[0], "COPY"):
        if rest.startswith("--from"):
            continue
        sources.extend(rest.split()[:-1])
    return sources


def test_build_copies_every_package_and_nothing_ignored() -> None:
    sources = _copied_sources()
    for source in sources:
        assert (REPO / source).exists(), f"COPY {source}: not in the repository"
        assert not _ignored(source), f"COPY {source}: excluded by .dockerignore"
    project = _pyproject()
    packages = project["tool"]["setuptools"]["packages"]["find"]["include"]  # type: ignore[index]
    for package in packages:
        assert package.rstrip("*") in sources, f"package {package} is not copied"
    assert project["project"]["readme"] in sources  # type: ignore[index]
    # Local state never reaches the image.
    for path in (".venv", ".git", "var", "tests", "cpn.db"):
        assert _ignored(path), path


def _project_packages() -> list[str]:
    return sorted(d.name for d in REPO.iterdir() if (d / "__init__.py").is_file())


def test_every_package_cpn_imports_ships_in_the_wheel_and_the_image() -> None:
    """Whatever `cpn` imports, at the top or inside a command, is a package the wheel and the
    image carry; bench/ and tests/ are neither (the testbed once lived in bench/, so
    `cpn testbed` broke wherever cpn was installed rather than run from a checkout)."""
    import grimp

    graph = grimp.build_graph(*_project_packages())
    needed = {m.split(".")[0] for m in graph.find_upstream_modules("api", as_package=True)}
    needed.add("api")
    assert "testbed" in needed, "cpn testbed imports the testbed package"
    assert not needed & {"bench", "tests"}, f"cpn imports {needed & {'bench', 'tests'}}"
    include = _pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]  # type: ignore[index]
    installed = {pattern.rstrip("*") for pattern in include}
    assert needed <= installed, f"not in the wheel: {sorted(needed - installed)}"
    copied = set(_copied_sources())
    assert needed <= copied, f"not in the image: {sorted(needed - copied)}"


@pytest.mark.slow
def test_the_build_context_installs_a_working_cpn(tmp_path: Path) -> None:
    """Install what the build stage copies, as the image does (not editable), and run the
    image's commands from that copy, outside the source tree."""
    context = tmp_path / "src"
    context.mkdir()
    for source in _copied_sources():
        src = REPO / source
        if src.is_dir():
            shutil.copytree(
                src, context / source, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
            )
        else:
            shutil.copy2(src, context / source)
    site = tmp_path / "site"
    # Dependencies come from this virtualenv; the image installs them at the same pins.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            str(context),
        ],
        check=True,
        timeout=300,
        capture_output=True,
    )
    shutil.rmtree(context)
    workdir = tmp_path / "home"
    workdir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CPN_")}
    env.update(
        PYTHONPATH=str(site),
        CPN_DATABASE_URL=f"sqlite:///{tmp_path}/data.db",
        HOME=str(workdir),
        COLUMNS="200",
    )

    def cpn(*args: str) -> subprocess.CompletedProcess[str]:
        code = "import sys; from api.cli import main; sys.argv[0] = 'cpn'; main()"
        return subprocess.run(
            [sys.executable, "-c", code, *args],
            env=env,
            cwd=workdir,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    where = subprocess.run(
        [
            sys.executable,
            "-c",
            "import api, migrations, testbed; "
            "print(api.__file__); print(migrations.__file__); "
            "print(testbed.__file__)",
        ],
        env=env,
        cwd=workdir,
        capture_output=True,
        text=True,
        check=True,
    )
    assert all(line.startswith(str(site)) for line in where.stdout.split()), where.stdout
    top = cpn("--help")
    assert top.returncode == 0, top.stderr
    for command in ("serve", "agent", "db", "testbed"):
        assert command in top.stdout
    testbed = cpn("testbed", "up", "--dcs", "Bad!")  # checked before anything needs root
    assert testbed.returncode == 2, testbed.stderr
    assert testbed.stderr.startswith("cpn testbed up: error: --dcs: "), testbed.stderr
    upgraded = cpn("db", "upgrade")
    assert upgraded.returncode == 0, upgraded.stderr  # the migrations ship in the package
    current = cpn("db", "current")
    assert current.returncode == 0 and "up to date" in current.stdout, current
