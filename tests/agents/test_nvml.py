"""NVML discovery on recorded answers.

RecordedNvml is a FAKE standing in for the pynvml module: NVML needs an NVIDIA driver and
GPU, and neither exists on the machines that run this suite. The values are what NVML
reports on such hosts (names and total memory as nvidia-smi shows them); the error classes
are pynvml's real ones, so the agent's error handling runs unchanged.
"""

from types import SimpleNamespace

import pynvml
import pytest

from agents.discovery import DiscoveryError
from agents.discovery.nvml_source import open_nvml
from agents.protocol import GpuInventory

MIB = 1024 * 1024

# One host, recorded device by device: (name, memory total bytes, utilization % or None).
DGX_MIXED = [
    ("NVIDIA H100 80GB HBM3", 81559 * MIB, 30),
    ("NVIDIA H100 80GB HBM3", 81559 * MIB, 50),
    (b"NVIDIA A100-SXM4-40GB", 40960 * MIB, None),  # older pynvml returned bytes
]


class RecordedNvml:
    NVMLError = pynvml.NVMLError

    def __init__(self, devices, init_error: int | None = None, fail_count: bool = False):
        self.devices = devices
        self.init_error = init_error
        self.fail_count = fail_count
        self.calls: list[str] = []

    def nvmlInit(self):
        self.calls.append("init")
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)

    def nvmlShutdown(self):
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self):
        if self.fail_count:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i):
        return SimpleNamespace(index=i)

    def nvmlDeviceGetName(self, h):
        return self.devices[h.index][0]

    def nvmlDeviceGetMemoryInfo(self, h):
        total = self.devices[h.index][1]
        return SimpleNamespace(total=total, free=total, used=0)

    def nvmlDeviceGetUtilizationRates(self, h):
        util = self.devices[h.index][2]
        if util is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(gpu=util, memory=0)


def test_groups_devices_by_model_and_memory():
    nvml = RecordedNvml(DGX_MIXED)
    src = open_nvml(nvml)
    assert src is not None and src.source == "nvml"
    assert src.collect() == [
        GpuInventory(
            model="NVIDIA A100-SXM4-40GB", memory_gib=40.0, count=1, allocatable=1, utilization=None
        ),
        GpuInventory(
            model="NVIDIA H100 80GB HBM3", memory_gib=79.65, count=2, allocatable=2, utilization=0.4
        ),
    ]
    src.close()
    assert nvml.calls == ["init", "shutdown"]


def test_no_driver_means_not_applicable():
    assert open_nvml(RecordedNvml([], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)) is None
    assert open_nvml(RecordedNvml([], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)) is None


def test_query_failure_is_a_discovery_error():
    src = open_nvml(RecordedNvml(DGX_MIXED, fail_count=True))
    assert src is not None
    with pytest.raises(DiscoveryError, match="nvml: query failed"):
        src.collect()


def test_real_pynvml_without_a_driver_is_not_applicable():
    """The real library, on this machine: no driver, so NVML must step aside (not crash)."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        assert open_nvml() is None
    else:  # a machine with a GPU: the real NVML must then report at least one device
        pynvml.nvmlShutdown()
        src = open_nvml()
        assert src is not None and sum(g.count for g in src.collect()) >= 1
        src.close()
