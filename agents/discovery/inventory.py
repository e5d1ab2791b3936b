"""A declared GPU inventory file: the source for clusters without NVML or Kubernetes.

Format (YAML)::

    gpus:
      - model: A100-80GB
        memory_gib: 80
        count: 8
        allocatable: 6     # optional, defaults to count
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from agents.discovery import DiscoveryError
from agents.protocol import GpuInventory

_FLAG = "--inventory"


class _GpuEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=128)
    memory_gib: float = Field(ge=0, le=4096)
    count: int = Field(ge=0, le=1_000_000)
    allocatable: int | None = Field(default=None, ge=0, le=1_000_000)
    utilization: float | None = Field(default=None, ge=0, le=1)

    @model_validator(mode="after")
    def _allocatable_within_count(self) -> _GpuEntry:
        if self.allocatable is not None and self.allocatable > self.count:
            raise ValueError(
                f"allocatable ({self.allocatable}) exceeds count ({self.count}); "
                "a cluster cannot offer more GPUs than it has"
            )
        return self


class _InventoryFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    gpus: list[_GpuEntry] = Field(max_length=64)


def _where(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def parse_inventory(text: str, path: str = "<inventory>") -> list[GpuInventory]:
    """Parse inventory YAML; errors name the file and the field, e.g. `gpus[0].count`."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise DiscoveryError(f"{_FLAG}: {path}: not valid YAML{at}; fix the syntax") from None
    if not isinstance(data, dict):
        raise DiscoveryError(
            f"{_FLAG}: {path}: expected a mapping with a 'gpus' list, "
            "e.g. 'gpus: [{model: A100-80GB, memory_gib: 80, count: 8}]'"
        )
    try:
        parsed = _InventoryFile.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        msg = str(err["msg"]).removeprefix("Value error, ")
        raise DiscoveryError(f"{_FLAG}: {path}: {_where(tuple(err['loc']))}: {msg}") from None
    seen: dict[str, int] = {}
    for i, entry in enumerate(parsed.gpus):
        if entry.model in seen:
            raise DiscoveryError(
                f"{_FLAG}: {path}: gpus[{i}].model: duplicate model {entry.model!r} "
                f"(also gpus[{seen[entry.model]}]); list each model once"
            )
        seen[entry.model] = i
    return [
        GpuInventory(
            model=e.model,
            memory_gib=e.memory_gib,
            count=e.count,
            allocatable=e.count if e.allocatable is None else e.allocatable,
            utilization=e.utilization,
        )
        for e in parsed.gpus
    ]


class InventorySource:
    """Re-reads the file on each collect so an edited ConfigMap takes effect without restart."""

    source: Literal["inventory"] = "inventory"

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def load(cls, path: Path) -> InventorySource:
        """Open and validate once, so a bad file fails at startup rather than on a beat."""
        src = cls(path)
        src.collect()
        return src

    def collect(self) -> list[GpuInventory]:
        try:
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = getattr(exc, "strerror", None) or type(exc).__name__
            raise DiscoveryError(
                f"{_FLAG}: {self.path}: cannot read ({reason}); pass an existing YAML file"
            ) from None
        return parse_inventory(text, str(self.path))

    def close(self) -> None:
        return None
