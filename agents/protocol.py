"""Wire models between a cluster agent and the control plane.

The only module that both `agents/` and `api/` import: keep it free of I/O.

Flow: an agent POSTs a `Heartbeat` to `/v1/agent/heartbeat` every `heartbeat_interval_s`
(bearer token of role `agent`, bound to its cluster); the `HeartbeatAck` renews its lease and
lists the peer clusters whose probe endpoints it should measure. It POSTs the measurements as a
`LinkReport` to `/v1/agent/links`. Each agent serves `GET /probe/ping` (empty 204) and
`GET /probe/blob?bytes=N` (N bytes, N <= PROBE_MAX_BYTES) for its peers to measure against.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

DiscoverySource = Literal["nvml", "kubernetes", "inventory"]
ClusterState = Literal["READY", "SUSPECT", "DOWN"]

PROBE_MAX_BYTES = 64 * 1024 * 1024
"""Largest blob a probe endpoint serves: a bounded transfer, never an open-ended one."""


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GpuInventory(_Wire):
    """GPUs of one model in a cluster, as discovered by the agent."""

    model: str = Field(
        min_length=1, max_length=128, description="GPU product name, e.g. 'A100-80GB'."
    )
    memory_gib: float = Field(ge=0, le=4096, description="Memory per GPU in GiB.")
    count: int = Field(ge=0, le=1_000_000, description="GPUs present.")
    allocatable: int = Field(ge=0, le=1_000_000, description="GPUs the cluster offers to cpn.")
    utilization: float | None = Field(
        default=None, ge=0, le=1, description="Mean utilisation 0..1, when the source reports it."
    )


class Heartbeat(_Wire):
    """What an agent reports on each beat: it is alive, and what GPUs its cluster has."""

    cluster: str = Field(min_length=1, max_length=63)
    agent_version: str = Field(default="", max_length=64)
    probe_url: str | None = Field(
        default=None, max_length=512, description="Base URL of this agent's probe endpoint."
    )
    discovery: DiscoverySource = "inventory"
    gpus: list[GpuInventory] = Field(default_factory=list, max_length=64)


class PeerProbe(_Wire):
    """Another cluster's probe endpoint, for link measurements."""

    cluster: str
    probe_url: str


class HeartbeatAck(_Wire):
    """The controller's answer to a heartbeat: lease renewed until `lease_expires_at`."""

    cluster: str
    state: ClusterState
    lease_expires_at: datetime
    heartbeat_interval_s: float
    probe_interval_s: float
    probe_bytes: int
    peers: list[PeerProbe] = Field(default_factory=list)


class LinkMeasurement(_Wire):
    """One measured link from the reporting cluster to `dst`."""

    dst: str = Field(min_length=1, max_length=63)
    bandwidth_gbps: float = Field(gt=0, le=100_000, description="Measured throughput, Gbit/s.")
    rtt_ms: float = Field(ge=0, le=600_000, description="Round-trip time, milliseconds.")
    loss: float = Field(default=0.0, ge=0, le=1, description="Fraction of probes that failed.")
    bytes_transferred: int = Field(
        ge=0, description="Size of the transfer the bandwidth came from."
    )
    measured_at: datetime


class LinkReport(_Wire):
    """Link measurements an agent made to its peers since its last report."""

    cluster: str = Field(min_length=1, max_length=63)
    links: list[LinkMeasurement] = Field(max_length=1024)
