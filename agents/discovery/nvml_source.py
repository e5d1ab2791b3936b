"""GPU discovery through NVML, when this host has an NVIDIA driver.

Talks to the pynvml module (package nvidia-ml-py); any object with the same functions
works, which is how tests replay recorded answers on machines without a GPU.
"""

from __future__ import annotations

import logging
import statistics
from typing import Any, Literal

from agents.discovery import DiscoveryError
from agents.protocol import GpuInventory

log = logging.getLogger(__name__)

_GIB = 1024**3


def _load_pynvml() -> Any:
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def open_nvml(nvml: Any = None) -> NvmlSource | None:
    """An NVML source, or None when no driver answers (the library is missing or fails)."""
    module = _load_pynvml() if nvml is None else nvml
    if module is None:
        return None
    try:
        module.nvmlInit()
    except module.NVMLError as exc:
        log.debug("NVML not available: %s", exc)
        return None
    except OSError as exc:  # a broken libnvidia-ml can fail before pynvml wraps the error
        log.debug("NVML not available: %s", exc)
        return None
    return NvmlSource(module)


def _text(value: str | bytes) -> str:
    # pynvml returned bytes before nvidia-ml-py 11.5; str since.
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


class NvmlSource:
    source: Literal["nvml"] = "nvml"

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml

    def collect(self) -> list[GpuInventory]:
        nv = self._nvml
        groups: dict[tuple[str, float], list[float | None]] = {}
        try:
            for index in range(nv.nvmlDeviceGetCount()):
                handle = nv.nvmlDeviceGetHandleByIndex(index)
                name = _text(nv.nvmlDeviceGetName(handle)).strip() or "unknown"
                memory_gib = round(nv.nvmlDeviceGetMemoryInfo(handle).total / _GIB, 2)
                try:
                    util: float | None = nv.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
                except nv.NVMLError:  # not supported on some boards and MIG instances
                    util = None
                groups.setdefault((name, memory_gib), []).append(util)
        except nv.NVMLError as exc:
            raise DiscoveryError(f"--discovery: nvml: query failed: {exc}") from None
        out = []
        for (name, memory_gib), utils in sorted(groups.items()):
            known = [u for u in utils if u is not None]
            out.append(
                GpuInventory(
                    model=name[:128],
                    memory_gib=memory_gib,
                    count=len(utils),
                    allocatable=len(utils),
                    utilization=min(1.0, statistics.fmean(known)) if known else None,
                )
            )
        return out

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError as exc:
            log.debug("nvmlShutdown failed: %s", exc)
