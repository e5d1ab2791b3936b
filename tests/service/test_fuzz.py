"""Property-based fuzzing of the whole OpenAPI schema against a real server (schemathesis).

Every operation gets generated requests (valid and invalid) with an admin key and a tenant
key: no answer may be a 5xx, and every answer must match the schema documented for its status.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok
from schemathesis.specs.openapi.checks import response_schema_conformance

from tests.conftest import LiveServer, clear_tables, start_server
from tests.service.conftest import Network, build_network


@pytest.fixture(scope="module")
def fuzz_network(migrated_url: str) -> Iterator[Network]:
    clear_tables(migrated_url)
    live = start_server(database_url=migrated_url, run_controller=False)
    net = build_network(live)
    yield net
    for c in (net.admin, net.tenant, net.other):
        c.close()
    live.stop()


def _token(client: object) -> str:
    return str(client._http.headers["Authorization"])  # type: ignore[attr-defined]


def test_no_server_error_and_schema_holds(fuzz_network: Network) -> None:
    server: LiveServer = fuzz_network.server
    api = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    tokens = [_token(fuzz_network.admin), _token(fuzz_network.tenant)]
    operations = [r.ok() for r in api.get_all_operations() if isinstance(r, Ok)]
    assert len(operations) >= 30
    checked_negative_skips: list[str] = []
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=8,
                deadline=None,
                suppress_health_check=list(HealthCheck),
                derandomize=True,
                database=None,
            )
            def fuzz(case: schemathesis.Case) -> None:
                for token in tokens:
                    response = case.call(
                        base_url=server.url, headers={"Authorization": token}, timeout=30
                    )
                    case.validate_response(
                        response, checks=[not_a_server_error, response_schema_conformance]
                    )

            try:
                fuzz()
            except Unsatisfiable:
                # Negative generation has nothing to break in an operation without inputs.
                assert mode is GenerationMode.NEGATIVE, operation.label
                checked_negative_skips.append(operation.label)
