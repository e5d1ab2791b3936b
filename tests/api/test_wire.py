"""The tenant wire and the Python client are light: importing them loads no control plane."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("controller", "sqlalchemy", "fastapi", "starlette", "torch", "ray", "numpy", "training")


def test_the_client_and_the_wire_import_no_control_plane() -> None:
    code = (
        "import json, sys; import api.client, wire; "
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout))
    assert {"wire", "api", "httpx", "pydantic"} <= loaded
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))
