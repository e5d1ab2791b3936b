"""One grammar for compression and sync: every layer accepts exactly the same values.

The layers are the API's job schema, `cpn plan`'s job file, the planner's job and models, and
the training runtime. The grammar is shared today; these tests keep a layer from drifting
back to a copy of its own.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from api.plan_files import JobIn
from grammar import (
    COMPRESSION_HELP,
    DOCUMENTED_COMPRESSIONS,
    DOCUMENTED_SYNCS,
    SYNC_HELP,
    parse_compression,
    parse_sync,
)
from scheduler import JobRequest, compressor_model, sync_model
from training.compression import make_compressor
from training.spec import TrainSpec
from wire.spec import JobSpec

REPO = Path(__file__).resolve().parents[2]

_NUMBERS = st.sampled_from(["0", "1", "2", "8", "0.01", "0.5", "1.0", "1.5", "-1", "x", "", "1e-3"])
_COMPRESSION_TEXT = st.one_of(
    st.sampled_from(DOCUMENTED_COMPRESSIONS),
    st.builds(
        lambda head, opts: ":".join([head, *opts]),
        st.sampled_from(
            [
                "auto",
                "none",
                "fp32",
                "fp16",
                "bf16",
                "int8",
                "int4",
                "int2",
                "topk",
                "powersgd",
                "sign",
                "zip",
            ]
        ),
        st.lists(
            st.one_of(
                _NUMBERS,
                st.sampled_from(
                    [
                        "minmax",
                        "stochastic",
                        "fp16",
                        "bf16",
                        "int4",
                        "int2",
                        "m0",
                        "m0.5",
                        "w3",
                        "c64",
                        "c0",
                        "cx",
                    ]
                ),
            ),
            max_size=3,
        ),
    ),
    st.text(max_size=12),
)
_SYNC_TEXT = st.one_of(
    st.sampled_from(DOCUMENTED_SYNCS),
    st.builds(
        lambda head, opts: ":".join([head, *opts]),
        st.sampled_from(
            ["auto", "every-step", "adaptive", "local-sgd", "diloco", "stale", "streaming", "x"]
        ),
        st.lists(
            st.one_of(_NUMBERS, st.sampled_from(["f1", "f2", "f9", "d0", "d3", "dx", "f"])),
            max_size=3,
        ),
    ),
    st.text(max_size=12),
)


def _accepts(check: Callable[[], object]) -> bool:
    try:
        check()
    except (ValueError, ValidationError):
        return False
    return True


def _job(**values: str) -> dict[str, object]:
    return {"name": "j", "task": "builtin:mnist1d-mlp", "gpus": 2, "steps": 10, **values}


def _plan_job(**values: str) -> dict[str, object]:
    return {"gpus": 2, "params": 1000, "flops_per_step": 1e9, "steps": 10, **values}


def _request(compression: str = "auto", sync: str = "auto") -> JobRequest:
    return JobRequest(
        params=1000,
        steps=10,
        min_gpus=2,
        max_gpus=2,
        flops_per_step=1e9,
        compression=compression,
        sync=sync,
    )


@settings(max_examples=300, deadline=None)
@given(text=_COMPRESSION_TEXT)
def test_every_layer_accepts_the_same_compressions(text: str) -> None:
    grammar_ok = _accepts(lambda: parse_compression(text))
    concrete = grammar_ok and not parse_compression(text).is_auto
    assert _accepts(lambda: JobSpec.model_validate(_job(compression=text))) == grammar_ok
    assert _accepts(lambda: JobIn.model_validate(_plan_job(compression=text))) == grammar_ok
    assert _accepts(lambda: _request(compression=text)) == grammar_ok
    # what the planner's model and a compressor take: the concrete values (auto is planned
    # away); a run takes auto too, and decides it itself from what it measures (training.auto)
    assert _accepts(lambda: compressor_model(text, 10_000)) == concrete
    assert _accepts(lambda: make_compressor(text)) == concrete
    assert _accepts(lambda: TrainSpec(compression=text).validate()) == grammar_ok


@settings(max_examples=300, deadline=None)
@given(text=_SYNC_TEXT)
def test_every_layer_accepts_the_same_syncs(text: str) -> None:
    grammar_ok = _accepts(lambda: parse_sync(text))
    concrete = grammar_ok and not parse_sync(text).is_auto
    assert _accepts(lambda: JobSpec.model_validate(_job(sync=text))) == grammar_ok
    assert _accepts(lambda: JobIn.model_validate(_plan_job(sync=text))) == grammar_ok
    assert _accepts(lambda: _request(sync=text)) == grammar_ok
    assert _accepts(lambda: sync_model(text)) == concrete
    assert _accepts(lambda: TrainSpec(sync=text).validate()) == grammar_ok


@pytest.mark.parametrize("text", DOCUMENTED_COMPRESSIONS)
def test_canonical_compressions_print_back_to_themselves(text: str) -> None:
    value = parse_compression(text)
    assert parse_compression(str(value)) == value
    assert str(value) == text


@pytest.mark.parametrize("text", DOCUMENTED_SYNCS)
def test_canonical_syncs_print_back_to_themselves(text: str) -> None:
    value = parse_sync(text)
    assert parse_sync(str(value)) == value
    assert str(value) == text


def test_errors_name_the_field_and_the_fix() -> None:
    with pytest.raises(ValidationError) as raised:
        JobSpec.model_validate(_job(compression="topk:2"))
    (error,) = raised.value.errors()
    assert error["loc"] == ("compression",)
    assert "density 2 must be in (0, 1]" in error["msg"] and "valid forms" in error["msg"]
    with pytest.raises(ValidationError) as raised:
        JobSpec.model_validate(_job(sync="local-sgd:0"))
    (error,) = raised.value.errors()
    assert error["loc"] == ("sync",) and "H must be >= 1" in error["msg"]


def test_the_docs_show_the_grammar() -> None:
    """The API schema documents the grammar's forms; the docs name every documented value."""
    from api.app import create_app

    schema = create_app().openapi()["components"]["schemas"]["JobSpec"]["properties"]
    assert COMPRESSION_HELP in json.dumps(schema["compression"])
    assert SYNC_HELP in json.dumps(schema["sync"])
    readme = (REPO / "docs" / "concepts" / "training.md").read_text()
    for value in (*DOCUMENTED_COMPRESSIONS, *DOCUMENTED_SYNCS):
        if ":" in value:
            value = value.split(":")[0] + ":"
        assert f"`{value}" in readme, f"docs/concepts/training.md does not document {value}"
