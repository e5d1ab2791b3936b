"""Throughput and real compression ratio of every gradient compressor.

    .venv/bin/python -m bench.compressors [--repeats N] [--json]

For each compressor and each gradient set (one 1M-float matrix, one 10M-float matrix, and the
layers of a small CNN + MLP), measures in steady state (residuals, momentum and warm starts
already in place; the best of --repeats rounds, wall clock):
- codec MB/s: MB of fp32 gradient per second through compress + decompress;
- wire MB/s: the same plus packet_to_bytes + packet_from_bytes (what the runtime really does);
- ratio: fp32 bytes / serialized bytes, on the real wire bytes.
`compressor_throughput_table()` returns the rows for bench/training.py.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch

from training.compression import (
    compressor_specs,
    make_compressor,
    packet_from_bytes,
    packet_to_bytes,
)

MB = 1e6

# name -> shapes. The layer set is a small CNN + MLP: conv kernels, a wide linear layer, a
# classifier and their biases (tensors that PowerSGD sends uncompressed).
GRADIENT_SETS: dict[str, list[tuple[int, ...]]] = {
    "1M (1000x1000)": [(1000, 1000)],
    "10M (2500x4000)": [(2500, 4000)],
    "conv+linear set (3.1M)": [
        (64, 3, 3, 3),
        (64,),
        (128, 64, 3, 3),
        (128,),
        (256, 128, 3, 3),
        (256,),
        (256, 256, 3, 3),
        (256,),
        (512, 4096),
        (512,),
        (10, 512),
        (10,),
    ],
}


def _gradients(shapes: list[tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {f"g{i}": torch.randn(shape, generator=generator) for i, shape in enumerate(shapes)}


def _measure(spec: str, shapes: list[tuple[int, ...]], repeats: int) -> dict[str, Any]:
    compressor = make_compressor(spec, seed=1)
    decoder = make_compressor(spec)  # receivers decode with their own instance
    fp32_bytes = 4 * sum(torch.Size(s).numel() for s in shapes)
    codec_s, wire_s, wire_bytes = float("inf"), float("inf"), 0
    for round_index in range(repeats + 1):  # round 0 warms residuals and warm starts up
        gradients = _gradients(shapes, round_index)
        t0 = time.perf_counter()
        packets = [compressor.compress(k, g) for k, g in gradients.items()]
        t1 = time.perf_counter()
        blobs = [packet_to_bytes(p) for p in packets]
        restored = [packet_from_bytes(b) for b in blobs]
        t2 = time.perf_counter()
        for packet in restored:
            decoder.decompress(packet)
        t3 = time.perf_counter()
        compressor.step()
        if round_index:
            codec_s = min(codec_s, (t1 - t0) + (t3 - t2))
            wire_s = min(wire_s, t3 - t0)
            wire_bytes = sum(len(b) for b in blobs)
    return {
        "compressor": spec,
        "fp32_mb": fp32_bytes / MB,
        "codec_mb_s": fp32_bytes / MB / codec_s,
        "wire_mb_s": fp32_bytes / MB / wire_s,
        "wire_bytes": wire_bytes,
        "ratio": fp32_bytes / wire_bytes,
    }


def compressor_throughput_table(
    specs: list[str] | None = None, repeats: int = 3, threads: int | None = 1
) -> list[dict[str, Any]]:
    """One row per (compressor, gradient set): MB/s and the real compression ratio.

    `threads` sets torch's intra-op threads for the measurement (1: per-core cost, steadier on
    a shared machine; None: leave torch's setting), restored afterwards.
    """
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _table(specs or compressor_specs(), repeats)
    finally:
        torch.set_num_threads(previous)


def _table(specs: list[str], repeats: int) -> list[dict[str, Any]]:
    rows = []
    for set_name, shapes in GRADIENT_SETS.items():
        for spec in specs:
            rows.append({"gradients": set_name, **_measure(spec, shapes, repeats)})
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    header = (
        f"{'gradients':<24} {'compressor':<22} {'codec MB/s':>11} {'wire MB/s':>10} "
        f"{'wire bytes':>12} {'ratio':>8}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{row['gradients']:<24} {row['compressor']:<22} {row['codec_mb_s']:>11.0f} "
            f"{row['wire_mb_s']:>10.0f} {row['wire_bytes']:>12,} {row['ratio']:>7.1f}x"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (best is kept)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats: must be >= 1")
    if args.threads < 1:
        parser.error("--threads: must be >= 1")
    start = time.perf_counter()
    rows = compressor_throughput_table(repeats=args.repeats, threads=args.threads)
    if args.json:
        print(json.dumps(rows))
        return
    print(format_table(rows))
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"\n{args.threads} torch thread(s), torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"load average {load}; MB = 1e6 bytes of fp32 gradient; best of {args.repeats} "
        f"rounds; took {time.perf_counter() - start:.1f} s"
    )


if __name__ == "__main__":
    main()
