"""All settings of the control plane, read once from `CPN_*` environment variables."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_DB_PATH = Path("var") / "cpn.db"


class Settings(BaseSettings):
    """Control-plane settings; every field maps to `CPN_<FIELD>` in the environment."""

    model_config = SettingsConfigDict(env_prefix="CPN_", extra="ignore")

    database_url: str = Field(
        default=f"sqlite:///{DEFAULT_DB_PATH}",
        description="SQLAlchemy URL: SQLite file by default, postgresql+psycopg://... to scale.",
    )
    admin_token: str | None = Field(
        default=None, description="First admin bearer key; generated and printed once if unset."
    )
    ray_address: str | None = Field(default=None, description="Existing Ray cluster to launch on.")
    heartbeat_interval_s: float = Field(default=10.0, gt=0, le=3600)
    lease_grace_s: float = Field(default=40.0, gt=0, le=86400)
    monitor_interval_s: float | None = Field(
        default=None, gt=0, description="How often the lease monitor runs; default interval/4."
    )
    probe_interval_s: float = Field(default=60.0, gt=0, le=86400)
    probe_bytes: int = Field(default=4 * 1024 * 1024, gt=0, le=64 * 1024 * 1024)
    quote_ttl_s: float = Field(default=900.0, gt=0, le=7 * 86400, description="Quote lifetime.")
    max_body_bytes: int = Field(default=1024 * 1024, gt=0)
    run_controller: bool = Field(default=True, description="Run the background loops in serve.")
    launch_jobs: bool = Field(
        default=True,
        description="Run placed jobs on Ray; false = placement and reservation only (dry run).",
    )
    reconcile_interval_s: float = Field(default=1.0, gt=0, le=3600, description="Loop period.")
    replica_ttl_s: float = Field(
        default=15.0, gt=0, le=3600, description="A replica unseen this long loses its jobs."
    )
    checkpoint_root: str = Field(default="var/checkpoints", description="Per-job checkpoints.")
    max_attempts: int = Field(default=3, ge=1, le=100, description="Runs before a job FAILS.")
    ray_num_cpus: int | None = Field(default=None, ge=1, description="CPUs of a local Ray.")

    def monitor_period(self) -> float:
        """Seconds between lease checks: a quarter beat, so SUSPECT shows soon after a miss."""
        return self.monitor_interval_s or max(0.05, min(self.heartbeat_interval_s / 4, 5.0))


@lru_cache
def get_settings() -> Settings:
    return Settings()
