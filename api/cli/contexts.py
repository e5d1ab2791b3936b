"""Where the CLI finds its control plane and key: flags, the environment, a config file with
contexts (kubectl's), or the admin key a local `cpn serve` generated.

    cpn login --url https://cpn.example.com --token-file ~/acme.key --context acme
    cpn config get-contexts
    cpn config use-context acme

The config file (`$CPN_CONFIG`, else `$XDG_CONFIG_HOME/cpn/config.yaml`, else
`~/.config/cpn/config.yaml`) names each context's URL and the file holding its key, never the
key itself; `cpn login --token-stdin` writes the key to a file of its own (mode 0600) beside
it. Every command resolves in one order: `--url`/`--token` (or CPN_URL/CPN_TOKEN), then the
current context (its key only for its own URL), then, for a server on this machine
(127.0.0.1, localhost), the key a `cpn serve` run here wrote to `var/admin-token`
(CPN_ADMIN_TOKEN_FILE) in the working directory.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from api.cli.errors import FAILED, fail
from api.cli.output import OutputOpt, chosen, emit

if TYPE_CHECKING:
    from api.client import Client

CONFIG_ENV = "CPN_CONFIG"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


@dataclass(frozen=True)
class Context:
    name: str
    url: str
    token_file: str | None = None


@dataclass
class Config:
    current: str | None = None
    contexts: dict[str, Context] = field(default_factory=dict)


class ConfigError(Exception):
    """The config file cannot be read or is malformed: the message says where and how."""


def config_path() -> Path:
    given = os.environ.get(CONFIG_ENV)
    if given:
        return Path(given).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "cpn" / "config.yaml"


def load(path: Path | None = None) -> Config:
    """The config file, or an empty one when there is none."""
    import yaml

    path = path or config_path()
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return Config()
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read it ({' '.join(str(exc).split())})") from None
    if data is None:
        return Config()
    if not isinstance(data, dict) or not isinstance(data.get("contexts", {}), dict):
        raise ConfigError(f"{path}: expected `current-context` and a `contexts` mapping")
    contexts = {}
    for name, entry in data.get("contexts", {}).items():
        if not isinstance(entry, dict) or not isinstance(entry.get("url"), str):
            raise ConfigError(f"{path}: contexts.{name}: needs a `url`")
        token_file = entry.get("token-file")
        contexts[str(name)] = Context(str(name), entry["url"], str(token_file or "") or None)
    current = data.get("current-context")
    return Config(str(current) if current else None, contexts)


def save(config: Config, path: Path | None = None) -> Path:
    """Write the config file whole (a temporary file renamed over it: never half-written)."""
    import yaml

    path = path or config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {
        "current-context": config.current,
        "contexts": {
            c.name: {"url": c.url, **({"token-file": c.token_file} if c.token_file else {})}
            for c in config.contexts.values()
        },
    }
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".config-", suffix=".yaml")
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        yaml.safe_dump(data, out, sort_keys=False)
    os.replace(tmp, path)
    return path


def _read_key(path: str) -> str | None:
    try:
        key = Path(path).expanduser().read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return key or None


def _same_url(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


def resolve(url: str | None, token: str | None) -> tuple[str, str | None]:
    """The URL and key a command uses (the order is the module's docstring)."""
    from api.client import DEFAULT_URL

    try:
        config = load()
    except ConfigError as exc:
        print(f"cpn: warning: {exc}; ignoring it", file=sys.stderr)
        config = Config()
    context = config.contexts.get(config.current or "")
    url = url or (context.url if context is not None else DEFAULT_URL)
    if token:
        return url, token
    if context is not None and _same_url(url, context.url):
        return url, _read_key(context.token_file) if context.token_file else None
    if _loopback(url):
        local = os.environ.get("CPN_ADMIN_TOKEN_FILE") or str(Path("var") / "admin-token")
        return url, _read_key(local)
    return url, None


def _loopback(url: str) -> bool:
    """A server on this machine: where a `cpn serve` run here may have written its key."""
    from urllib.parse import urlparse

    return urlparse(url).hostname in ("127.0.0.1", "localhost", "::1")


def client(url: str | None, token: str | None) -> Client:
    """A client for the command's control plane and key (`resolve`)."""
    from api.client import Client

    return Client(*resolve(url, token))


def login(
    url: str = typer.Option(..., "--url", help="The control plane's URL."),
    token_file: Path | None = typer.Option(
        None, "--token-file", help="A file holding the API key (its path is remembered)."
    ),
    token_stdin: bool = typer.Option(
        False, "--token-stdin", help="Read the key from stdin and keep it in a 0600 file."
    ),
    context: str | None = typer.Option(
        None, "--context", help="The context's name (default: the URL's host)."
    ),
) -> None:
    """Check a key against a control plane and make it the current context."""
    from urllib.parse import urlparse

    from api.client import ApiError, Client

    if (token_file is None) == (not token_stdin):
        raise fail("login", "--token-file", "give the key with --token-file F or --token-stdin")
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise fail("login", "--url", f"{url!r} is not an http(s) URL; e.g. http://127.0.0.1:8000")
    name = context or parsed.hostname or "default"
    if not NAME.match(name):
        raise fail("login", "--context", f"{name!r}: use letters, digits, '.', '_' or '-'")
    if token_stdin:
        key = sys.stdin.readline().strip()
    else:
        assert token_file is not None
        if not token_file.expanduser().is_file():
            raise fail("login", "--token-file", f"{token_file}: no such file")
        key = _read_key(str(token_file)) or ""
    if not key:
        raise fail("login", "--token-stdin" if token_stdin else "--token-file", "the key is empty")
    try:
        with Client(url, key) as probe:
            probe.get("/v1/jobs", limit=1)
    except ApiError as exc:
        if exc.status != 403:  # an agent key may log in; it reads no jobs
            raise fail("login", None, f"{url} refused the key: {exc}", FAILED) from None
    try:
        config = load()
    except ConfigError as exc:
        raise fail("login", CONFIG_ENV, str(exc)) from None
    path = config_path()
    if token_stdin:
        keys = path.parent / "keys"
        keys.mkdir(parents=True, exist_ok=True, mode=0o700)
        stored = keys / name
        fd = os.open(stored, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(key + "\n")
        kept = str(stored)
    else:
        assert token_file is not None
        kept = str(token_file.expanduser().resolve())
    config.contexts[name] = Context(name, url.rstrip("/"), kept)
    config.current = name
    save(config, path)
    print(f"logged in to {url} as context {name!r} (now current; {path})")


def _config_or_fail(cmd: str) -> Config:
    try:
        return load()
    except ConfigError as exc:
        raise fail(cmd, CONFIG_ENV, str(exc)) from None


def get_contexts(output: str | None = OutputOpt) -> None:
    """List the contexts; `*` marks the current one."""
    from rich.console import Console
    from rich.table import Table

    fmt = chosen("config get-contexts", output, False)
    config = _config_or_fail("config get-contexts")
    contexts = list(config.contexts.values())
    if fmt not in ("table", "wide"):
        emit(
            [
                {"current": c.name == config.current, "name": c.name, "url": c.url,
                 "token_file": c.token_file}
                for c in contexts
            ],
            fmt,
        )  # fmt: skip
        return
    table = Table(title=f"Contexts ({config_path()})")
    for col in ("current", "name", "url", "key file"):
        table.add_column(col)
    for c in contexts:
        current = "*" if c.name == config.current else ""
        table.add_row(current, c.name, c.url, c.token_file or "")
    Console().print(table)


def use_context(name: str = typer.Argument(..., help="A context `cpn login` made.")) -> None:
    """Make a context the current one."""
    config = _config_or_fail("config use-context")
    if name not in config.contexts:
        known = ", ".join(sorted(config.contexts)) or "none yet: run `cpn login`"
        raise fail("config use-context", "NAME", f"no context {name!r} (known: {known})")
    config.current = name
    save(config)
    print(f"switched to context {name!r}")


def current_context() -> None:
    """Print the current context's name and URL."""
    config = _config_or_fail("config current-context")
    context = config.contexts.get(config.current or "")
    if context is None:
        raise fail("config current-context", None, "no current context: run `cpn login`", FAILED)
    print(f"{context.name} {context.url}")


def delete_context(name: str = typer.Argument(..., help="The context to forget.")) -> None:
    """Forget a context (a key file `cpn login --token-stdin` wrote is deleted with it)."""
    config = _config_or_fail("config delete-context")
    gone = config.contexts.pop(name, None)
    if gone is None:
        raise fail("config delete-context", "NAME", f"no context {name!r}")
    if config.current == name:
        config.current = None
    owned = config_path().parent / "keys" / name
    if gone.token_file and Path(gone.token_file) == owned:
        owned.unlink(missing_ok=True)
    save(config)
    print(f"deleted context {name!r}")


def register(app: typer.Typer) -> None:
    """Attach `cpn login` and `cpn config ...`."""
    app.command("login")(login)
    config = typer.Typer(help="Contexts: which control plane and key commands use.")
    config.command("get-contexts")(get_contexts)
    config.command("use-context")(use_context)
    config.command("current-context")(current_context)
    config.command("delete-context")(delete_context)
    app.add_typer(config, name="config", no_args_is_help=True)
