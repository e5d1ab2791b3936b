"""`cpn train --slowdown` and `--data` as a user types them: a bad value is one line naming
the flag (a real subprocess; it fails before any worker starts)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--slowdown", "z:4"], "--slowdown: cluster 'z' is not one of the job's clusters"),
        (["--data", "remote"], "--data: 'remote' is not one of shared, local"),
    ],
)
def test_bad_slowdown_or_data_is_one_line_naming_the_flag(args: list[str], needle: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "api.cli", "train", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("cpn train: error:") and needle in lines[0], lines[0]
