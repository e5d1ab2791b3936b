"""Spec strings, bad specs, and exact resume from state_dict through a real checkpoint file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from training.compression import Compressor, compressor_specs, make_compressor, packet_to_bytes
from training.compression.cast import CastCompressor
from training.compression.identity import NoCompression
from training.compression.int8 import MinMaxInt8, StochasticInt8
from training.compression.intn import StochasticIntN
from training.compression.powersgd import PowerSGDCompressor
from training.compression.sign import SignCompressor
from training.compression.topk import TopKCompressor


@pytest.mark.parametrize(
    ("spec", "kind"),
    [
        ("none", NoCompression),
        ("fp32", NoCompression),
        ("fp16", CastCompressor),
        ("BF16", CastCompressor),
        ("int8", StochasticInt8),
        ("int8:minmax", MinMaxInt8),
        ("int4", StochasticIntN),
        ("INT2", StochasticIntN),
        (" topk:0.01 ", TopKCompressor),
        ("topk:0.02:m0:c4096:int2", TopKCompressor),
        ("powersgd:4", PowerSGDCompressor),
        ("sign", SignCompressor),
    ],
)
def test_specs_build_their_compressor(spec: str, kind: type) -> None:
    assert isinstance(make_compressor(spec), kind)


def test_topk_options() -> None:
    compressor = make_compressor("topk:0.001:m0.5:w40")
    assert isinstance(compressor, TopKCompressor)
    assert (compressor.density, compressor.momentum, compressor.warmup_rounds) == (0.001, 0.5, 40)
    default = make_compressor("topk:0.01")
    assert isinstance(default, TopKCompressor)
    assert (default.momentum, default.warmup_rounds, default.momentum_correction) == (0.9, 0, True)


def test_flags() -> None:
    assert make_compressor("none").mergeable and make_compressor("fp16").mergeable
    assert not make_compressor("topk:0.01").mergeable
    assert not make_compressor("powersgd:2").momentum_correction
    # what may run in the compressed ring (per-piece state only) and what is all-gathered
    ring = ["none", "fp16", "bf16", "int8", "int8:minmax", "int4", "int2", "topk:0.01:m0"]
    for spec in [*ring, "topk:0.02:m0:c4096:int2"]:
        assert make_compressor(spec).ring, spec
    for spec in ["topk:0.01", "powersgd:2", "sign"]:
        assert not make_compressor(spec).ring, spec


def test_chunked_quantized_topk_options() -> None:
    compressor = make_compressor("topk:0.02:m0:c4096:int2")
    assert isinstance(compressor, TopKCompressor)
    assert (compressor.chunk, compressor.value_bits, compressor.momentum) == (4096, 2, 0.0)


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "gzip",
        "topk",
        "topk:",
        "topk:0",
        "topk:1.5",
        "topk:abc",
        "topk:0.01:x3",
        "topk:0.01:m1",
        "topk:0.01:w-1",
        "topk:0.01:m0.5:m0.4",
        "topk:0.01:c0",
        "topk:0.01:c-3",
        "topk:0.01:int2:fp16",
        "int4:2",
        "int2:minmax",
        "topk:nan",
        "powersgd",
        "powersgd:0",
        "powersgd:2.5",
        "powersgd:2:3",
        "int8:max",
        "fp16:2",
        "sign:1",
        "none:x",
    ],
)
def test_bad_specs_name_the_spec_and_the_valid_forms(spec: str) -> None:
    with pytest.raises(ValueError) as raised:
        make_compressor(spec)
    message = str(raised.value)
    assert repr(spec) in message
    assert "valid forms" in message and "topk:<density" in message and "powersgd:<rank" in message


def test_auto_and_parsed_values() -> None:
    from grammar import parse_compression

    with pytest.raises(ValueError, match=r"'auto'.*concrete value"):
        make_compressor("auto")
    topk = make_compressor(parse_compression("topk:0.01:m0:w3:bf16"))
    assert isinstance(topk, TopKCompressor)
    assert (topk.momentum, topk.warmup_rounds, topk.value_dtype) == (0.0, 3, torch.bfloat16)
    assert isinstance(make_compressor(parse_compression("int8:minmax")), MinMaxInt8)


def _gradients(round_index: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + round_index)
    return {
        "fc": torch.randn(64, 48, generator=generator),
        "conv": torch.randn(8, 4, 3, 3, generator=generator),
        "bias": torch.randn(64, generator=generator),
    }


def _run(compressor: Compressor, rounds: range) -> list[bytes]:
    wire = []
    for r in rounds:
        for key, gradient in _gradients(r).items():
            wire.append(packet_to_bytes(compressor.compress(key, gradient)))
        compressor.step()
    return wire


@pytest.mark.parametrize("spec", [*compressor_specs(), "topk:0.01:m0.9:w6", "int8:minmax"])
def test_state_dict_resumes_to_identical_packets(spec: str, tmp_path: Path) -> None:
    original = make_compressor(spec, seed=9)
    _run(original, range(4))
    checkpoint = tmp_path / "compressor.pt"
    torch.save(original.state_dict(), checkpoint)
    resumed = make_compressor(spec, seed=9)
    resumed.load_state_dict(torch.load(checkpoint))  # weights_only: no pickle of code
    expected = _run(original, range(4, 10))
    assert _run(resumed, range(4, 10)) == expected
    # Control: a fresh compressor (no state) sends different bytes, except for stateless fp32.
    if spec not in ("none",):
        assert _run(make_compressor(spec, seed=9), range(4, 10)) != expected
