"""What tenant code and tenants see of the control plane: no secret, no internals.

Workers run tenant code, so Ray starts them with the control plane's secrets withheld
(`scrubbed_environ`, `worker_env_vars`), and error text that comes back from them is masked
and bounded before it is stored where a tenant reads it (`tenant_error`).

With the embedded Ray the workers run as the same OS user as `cpn serve`; a process of that
user can read another's initial environment under /proc. Run tenants' code on a Ray cluster of
its own (`CPN_RAY_ADDRESS`, KubeRay in the Helm chart) where that matters.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from urllib.parse import urlsplit

WORKER_CPN_VARS = frozenset({"CPN_CACHE_DIR", "CPN_GLOO_IFNAME"})
"""The CPN_* variables workers use; every other CPN_* variable is withheld from them."""

WITHHELD_VARS = frozenset({"PGPASSWORD", "DATABASE_URL", "PROMETHEUS_MULTIPROC_DIR"})
"""Other variables of the control plane that workers never need (under `cpn serve --workers`
the last is where its workers keep their counters: Ray's own processes, which use
prometheus_client too, would write theirs there and show in cpn's /metrics)."""

OBJECT_STORE_PREFIX = "AWS_"
"""The S3 client's settings and credentials (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...): workers
get them only when checkpoints go to an object store (`object_store=True`), where they write."""

RAY_TOKEN_VARS = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
"""Ray's own token: workers need it under token authentication (what a local Ray uses unless
told otherwise), so it is withheld only where authentication is off (`RAY_AUTH_MODE=disabled`)."""

ERROR_LIMIT = 2048
"""Characters of an error a tenant may see (job events; reasons keep a shorter cut)."""

MASK = "***"
MIN_SECRET_LEN = 6
"""Shorter values are not masked: they would blot out ordinary words and numbers."""

_SECRET_NAME = re.compile(
    r"TOKEN|SECRET|PASSW|CREDENTIAL|PRIVATE|_KEY$|_URL$|URI$|DATABASE|DSN|AUTH", re.IGNORECASE
)
_remembered: set[str] = set()
_environ_lock = threading.Lock()


def withheld(environ: Mapping[str, str], object_store: bool = False) -> list[str]:
    """Names in `environ` that workers must not see (the S3 settings too, unless
    `object_store`: checkpoints go to an object store the workers write)."""
    names = [
        name
        for name in environ
        if (name.startswith("CPN_") and name not in WORKER_CPN_VARS)
        or name in WITHHELD_VARS
        or (name.startswith(OBJECT_STORE_PREFIX) and not object_store)
    ]
    if environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        names += [name for name in RAY_TOKEN_VARS if name in environ]
    return sorted(names)


def worker_env_vars(
    environ: Mapping[str, str] | None = None, object_store: bool = False
) -> dict[str, str]:
    """A Ray `runtime_env` `env_vars` that blanks every withheld variable in workers.

    Workers inherit the environment of the raylet that starts them, not the driver's; this
    covers a Ray whose nodes were started with the secrets in their environment."""
    env = os.environ if environ is None else environ
    return dict.fromkeys(withheld(env, object_store), "")


@contextmanager
def scrubbed_environ(object_store: bool = False) -> Iterator[None]:
    """This process's environment without the withheld variables, for as long as it starts
    child processes that must not inherit them (a local Ray's GCS and raylet, whose workers
    run tenant code); restored afterwards. Values are remembered for `mask` first."""
    with _environ_lock:
        saved = {name: os.environ[name] for name in withheld(os.environ, object_store)}
        remember(*(v for n, v in saved.items() if _SECRET_NAME.search(n)))
        for name in saved:
            del os.environ[name]
        try:
            yield
        finally:
            os.environ.update(saved)


def remember(*values: str | None) -> None:
    """Secrets this process holds outside its environment (settings given as arguments)."""
    for value in values:
        if value and len(value) >= MIN_SECRET_LEN:
            _remembered.add(value)


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """Every secret value to mask, longest first (so no part of one survives another's mask):
    secret-named variables, remembered values, and the password inside any URL among them."""
    env = os.environ if environ is None else environ
    values = {v for n, v in env.items() if _SECRET_NAME.search(n) and len(v) >= MIN_SECRET_LEN}
    values |= _remembered
    for value in list(values):
        password = _url_password(value)
        if password and len(password) >= MIN_SECRET_LEN:
            values.add(password)
    return sorted(values, key=len, reverse=True)


def _url_password(value: str) -> str | None:
    if "://" not in value:
        return None
    try:
        return urlsplit(value).password
    except ValueError:
        return None


def mask(text: str, environ: Mapping[str, str] | None = None) -> str:
    """`text` with every secret value replaced by ***."""
    for value in secret_values(environ):
        text = text.replace(value, MASK)
    return text


_FRAME_FILE = re.compile(r'File "(?:[^"\n]*[/\\])?([^"/\\\n]+)"')
_SITE_PACKAGES = re.compile(r"(?:[A-Za-z]:)?[^\s'\"()]*[/\\]site-packages[/\\]")
_RAY_WHERE = re.compile(r"\s*\((?:pid=\d+|ip=)[^()\n]*(?:\([^()\n]*\)[^()\n]*)*\)")
_ADDRESS = re.compile(r"\bat 0x[0-9a-f]+\b")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_MARKERS = re.compile(r"^[ \t]*[\^~]+[ \t]*\n", re.MULTILINE)


def strip_internals(text: str) -> str:
    """Tracebacks without the control plane's paths (a frame keeps its file's name, line and
    function), Ray's process and node details, object addresses, terminal colours or the
    ^^^ lines under a frame's code."""
    text = _MARKERS.sub("", _ANSI.sub("", text))
    text = _FRAME_FILE.sub(r'File "\1"', text)
    text = _SITE_PACKAGES.sub("", text)
    for prefix in {sys.prefix, sys.exec_prefix, sys.base_prefix, os.getcwd()}:
        if len(prefix) > 1:
            text = text.replace(prefix + os.sep, "")
    text = _RAY_WHERE.sub("", text)
    return _ADDRESS.sub("at 0x…", text)


def bound(text: str, limit: int = ERROR_LIMIT) -> str:
    """At most `limit` characters: the head and the tail (where a traceback names the error)."""
    if len(text) <= limit:
        return text
    cut = "\n…\n"
    head = limit // 4
    tail = limit - head - len(cut)
    return text[:head] + cut + text[len(text) - tail :]


def tenant_error(error: BaseException, limit: int = ERROR_LIMIT) -> str:
    """How a run's error reads where its tenant sees it: masked, without internals, bounded.

    Masked first, so a cut never leaves part of a secret behind."""
    text = mask(f"{error.__class__.__name__}: {error}")
    return bound(strip_internals(text), limit)
