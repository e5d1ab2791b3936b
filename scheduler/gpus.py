"""Peak dense throughput of common GPU models and the default efficiency applied to it.

Figures are vendor datasheet dense (no sparsity) BF16/FP16 tensor TFLOPS. Real training reaches
a fraction of peak; `DEFAULT_EFFICIENCY` is that fraction until `calibrate` fits a better one
from observed step times.
"""

from __future__ import annotations

GPU_PEAK_TFLOPS: dict[str, float] = {
    "B200": 2250.0,
    "H200": 989.0,
    "H100": 989.0,
    "H100-PCIE": 756.0,
    "H800": 989.0,
    "H20": 148.0,
    "GH200": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "A10G": 70.0,
    "A10": 125.0,
    "L40S": 362.0,
    "L40": 181.0,
    "L4": 121.0,
    "V100": 125.0,
    "T4": 65.0,
    "MI300X": 1307.0,
    "MI250X": 383.0,
    "RTX4090": 165.0,
    "CPU": 1.0,
}

DEFAULT_EFFICIENCY = 0.4


def peak_tflops(gpu_model: str) -> float | None:
    """Datasheet peak for a model name (case-insensitive), or None when unknown."""
    return _BY_UPPER.get(gpu_model.strip().upper())


_BY_UPPER = {name.upper(): value for name, value in GPU_PEAK_TFLOPS.items()}
