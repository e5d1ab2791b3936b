"""All settings of the control plane, read once from `CPN_*` environment variables."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError

from controller.values.tasks import parse_task_modules

DEFAULT_DB_PATH = Path("var") / "cpn.db"
MIN_ADMIN_TOKEN_CHARS = 32
"""A bearer key given through CPN_ADMIN_TOKEN must be at least this long (generated keys have
over 50 characters): a short one can be guessed, and one admin key opens everything."""


def admin_token_problem(token: str | None) -> str | None:
    """Why `token` cannot be the admin key (None: it can, or it is unset and one is generated).

    The message never contains the token."""
    if not token:
        return None
    if len(token) < MIN_ADMIN_TOKEN_CHARS:
        return (
            f"CPN_ADMIN_TOKEN has {len(token)} characters, fewer than the "
            f"{MIN_ADMIN_TOKEN_CHARS} required; set a longer random secret (e.g. the output "
            "of `openssl rand -hex 32`) or unset it to have one generated"
        )
    return None


class Settings(BaseSettings):
    """Control-plane settings; every field maps to `CPN_<FIELD>` in the environment."""

    model_config = SettingsConfigDict(env_prefix="CPN_", extra="ignore")

    database_url: str = Field(
        default=f"sqlite:///{DEFAULT_DB_PATH}",
        description="SQLAlchemy URL: SQLite file by default, postgresql+psycopg://... to scale.",
    )
    db_pool_timeout_s: float = Field(
        default=30.0,
        gt=0,
        le=600,
        description="How long a request waits for a free connection before a 503 with Retry-After.",
    )
    db_request_slots: int | None = Field(
        default=None,
        ge=1,
        le=1000,
        description="Requests that may use the database at once; the rest wait their turn "
        "(at most db_pool_timeout_s, then a 503). Keep it below the pool's size, so the "
        "controller and key lookups find connections too. Default: db_pool_size (20 on "
        "PostgreSQL); 2 on SQLite, whose reads get slower, not faster, with more at once.",
    )
    sqlite_synchronous: Literal["FULL", "NORMAL"] = Field(
        default="FULL",
        description="SQLite durability: FULL survives power loss; NORMAL (WAL) is faster but may "
        "lose the last commits (an acknowledged job or ledger row) on power loss.",
    )
    admin_token: str | None = Field(
        default=None,
        description="First admin bearer key (at least 32 characters); if unset, one is generated "
        "into admin_token_file. A new value revokes the key the old one made.",
    )
    ray_address: str | None = Field(default=None, description="Existing Ray cluster to launch on.")
    heartbeat_interval_s: float = Field(default=10.0, gt=0, le=3600)
    lease_grace_s: float = Field(default=40.0, gt=0, le=86400)
    monitor_interval_s: float | None = Field(
        default=None, gt=0, description="How often the lease monitor runs; default interval/4."
    )
    heartbeat_batch_window_s: float = Field(
        default=0.002,
        ge=0,
        le=1,
        description="Group commit: how long a heartbeat batch that has a writer still waits "
        "for more beats before its one transaction (0: only beats that queued for a writer).",
    )
    heartbeat_batch_max: int = Field(
        default=500, ge=1, le=10_000, description="Most heartbeats in one group commit."
    )
    probe_interval_s: float = Field(default=60.0, gt=0, le=86400)
    probe_bytes: int = Field(default=4 * 1024 * 1024, gt=0, le=64 * 1024 * 1024)
    quote_ttl_s: float = Field(default=900.0, gt=0, le=7 * 86400, description="Quote lifetime.")
    max_body_bytes: int = Field(default=1024 * 1024, gt=0)
    run_controller: bool = Field(default=True, description="Run the background loops in serve.")
    workers_dir: str | None = Field(
        default=None,
        description="Set by `cpn serve --workers N` for its worker processes (not by hand): "
        "the folder where they elect the one that runs the background loops.",
    )
    launch_jobs: bool = Field(
        default=True,
        description="Run placed jobs on Ray; false = placement and reservation only (dry run).",
    )
    reconcile_interval_s: float = Field(default=1.0, gt=0, le=3600, description="Loop period.")
    replica_ttl_s: float = Field(
        default=15.0, gt=0, le=3600, description="A replica unseen this long loses its jobs."
    )
    checkpoint_root: str = Field(
        default="var/checkpoints",
        description="Per-job checkpoints: a directory every worker reaches (a shared mount) or "
        "an object-store URI such as s3://bucket/prefix (S3 settings from AWS_* variables).",
    )
    max_attempts: int = Field(default=3, ge=1, le=100, description="Runs before a job FAILS.")
    ray_num_cpus: int | None = Field(default=None, ge=1, description="CPUs of a local Ray.")
    key_rate_limit: float = Field(
        default=50.0,
        ge=0,
        description="Requests/s per API key (burst twice that), per replica; 0 = no limit.",
    )
    agent_rate_limit: float = Field(
        default=100.0,
        ge=0,
        description="Requests/s per agent key on /v1/agent/*, a bucket apart from tenant "
        "traffic (burst twice that), per replica; 0 = no limit.",
    )
    auth_fail_limit: int = Field(
        default=20,
        ge=0,
        description="Failed authentications of one key from one client address a minute; "
        "beyond, that key gets 429 there before any lookup, and past ten times it (all keys "
        "together) every unknown key from that address does. Per replica; 0 = no limit.",
    )
    max_queued_jobs: int = Field(
        default=10_000,
        ge=0,
        description="Most PENDING jobs one tenant may have; beyond, submissions get 429. "
        "0 = no limit.",
    )
    quote_rate_limit: int = Field(
        default=60,
        ge=0,
        description="Quotes per tenant a minute (all its keys together), per replica; "
        "0 = no limit.",
    )

    max_streams_per_key: int = Field(
        default=4,
        ge=1,
        le=10_000,
        description="Event streams one API key may hold open at once (per replica); beyond, "
        "a 429 problem with Retry-After.",
    )
    stream_max_s: float = Field(
        default=300.0,
        gt=0,
        le=86400,
        description="An event stream ends after this long with an `event: resume`; clients "
        "reconnect with Last-Event-ID and lose nothing.",
    )
    db_pool_size: int | None = Field(
        default=None,
        ge=1,
        le=1000,
        description="Connections kept by the API's pool (tenant and admin requests, the "
        "controller); default 20 on PostgreSQL, 5 on SQLite. Agents and the lease monitor "
        "use a small pool of their own.",
    )
    db_max_overflow: int | None = Field(
        default=None,
        ge=0,
        le=1000,
        description="Connections the API's pool may open beyond db_pool_size under load; "
        "default 20 on PostgreSQL, 10 on SQLite.",
    )
    admin_token_file: str = Field(
        default=str(Path("var") / "admin-token"),
        description="Where a generated first admin key is written (mode 0600) when "
        "CPN_ADMIN_TOKEN is unset; the key is never printed.",
    )

    task_modules: str = Field(
        default="",
        description="Comma-separated module prefixes whose `module:function` tasks jobs may "
        "name (`mycorp.training` allows mycorp.training and mycorp.training.*); empty: "
        "builtin: tasks only. Workers import them; the control plane never does.",
    )
    link_discovery: bool = Field(
        default=False,
        description="Let agents report links between clusters no admin declared a link "
        "between; off, an agent measures only declared links (a report of another is a 422).",
    )
    cookie_secure: bool = Field(
        default=False,
        description="Mark the console's session cookie Secure even where the request reads "
        "http (behind a TLS-terminating proxy); https requests always get it.",
    )
    protect_docs: bool = Field(
        default=False,
        description="Serve /docs, /redoc and /openapi.json to authenticated callers only.",
    )
    protect_metrics: bool = Field(
        default=False, description="Serve /metrics to admin keys only (Prometheus: a bearer key)."
    )

    @field_validator("database_url")
    @classmethod
    def _database_url(cls, value: str) -> str:
        try:
            url = make_url(value)
            url.get_dialect()
        except (ArgumentError, NoSuchModuleError, ValueError):
            url = None
        if url is None or url.get_backend_name() not in ("sqlite", "postgresql"):
            raise ValueError(
                "not a database cpn runs on; write sqlite:///path/to/cpn.db or "
                "postgresql+psycopg://user@host:5432/db (postgres:// is not a SQLAlchemy name)"
            )
        return value

    @field_validator("task_modules")
    @classmethod
    def _task_modules(cls, value: str) -> str:
        parse_task_modules(value)  # a bad prefix stops `cpn serve` with the reason
        return value

    def task_prefixes(self) -> tuple[str, ...]:
        """CPN_TASK_MODULES as module prefixes."""
        return parse_task_modules(self.task_modules)

    def monitor_period(self) -> float:
        """Seconds between lease checks: a quarter beat, so SUSPECT shows soon after a miss."""
        return self.monitor_interval_s or max(0.05, min(self.heartbeat_interval_s / 4, 5.0))


def load_settings() -> Settings:
    """The settings from the environment; ValueError, one line naming each bad `CPN_*`
    variable, what it was given, what is wrong (the value of a secret is never shown)."""
    try:
        return Settings()
    except ValidationError as exc:
        raise ValueError(settings_problem(exc)) from None


def settings_problem(exc: ValidationError) -> str:
    """`CPN_X='given': what is wrong; CPN_Y=...`: the variables, not the fields' names."""
    parts = []
    for error in exc.errors():
        name = str(error["loc"][0]) if error["loc"] else ""
        variable = f"CPN_{name.upper()}" if name else "CPN_*"
        given = "" if "token" in name or "secret" in name else f"={error.get('input')!r}"
        if name == "database_url":  # a URL's password is not printed
            given = "=" + repr(re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", str(error.get("input"))))
        message = str(error["msg"]).removeprefix("Value error, ")
        parts.append(f"{variable}{given}: {message}")
    return "; ".join(parts)
