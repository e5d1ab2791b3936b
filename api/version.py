"""cpn's version, in one place: the installed distribution's metadata, which `pyproject.toml`
writes. The API's OpenAPI document, `cpn version` and the agents' reports all read it here."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def _installed() -> str:
    try:
        return version("cpn")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


VERSION = _installed()
