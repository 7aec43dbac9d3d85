"""The OpenAPI document is the truth about the API: schemathesis generates requests from it
(valid and invalid, every operation) against a live server and checks every answer.

Bounded and repeatable: a fixed number of examples per operation, derandomized. The checks
are the ones the farm promises for any input: never a server error, never a status the
document does not list, content types and bodies as documented.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.api_helpers import LiveServer, live_server

EXAMPLES_PER_OPERATION = 12
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server("sqlite", tmp_path_factory.mktemp("fuzz"), max_upload_bytes=1 << 20) as s:
        yield s


@pytest.fixture(scope="module")
def member_key(fuzzed: LiveServer) -> str:
    """A team member's key (not an admin's: the fuzzer must not revoke it)."""
    return fuzzed.new_key()


def fuzz_operation(operation: Any, key: str) -> None:
    """Hypothesis over one operation's generated cases; raises on the first failed check."""

    @given(case=operation.as_strategy())
    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        derandomize=True,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def run(case: Any) -> None:
        case.call_and_validate(headers={"Authorization": f"Bearer {key}"}, checks=CHECKS)

    run()


def test_every_operation_answers_only_documented_statuses_and_never_a_server_error(
    fuzzed: LiveServer, member_key: str
) -> None:
    api = schemathesis.openapi.from_url(f"{fuzzed.url}/openapi.json")
    failures: dict[str, str] = {}
    operations = [result.ok() for result in api.get_all_operations()]  # type: ignore[union-attr]
    assert len(operations) >= 25
    for operation in operations:
        try:
            fuzz_operation(operation, member_key)
        except Exception as exc:  # noqa: BLE001 - every operation's failure is reported
            failures[operation.label] = str(exc)[:2000]
    assert not failures, "\n\n".join(f"{k}:\n{v}" for k, v in failures.items())


def test_every_v1_operation_documents_the_shared_errors_and_bodies_forbid_extra_fields(
    fuzzed: LiveServer,
) -> None:
    import httpx

    document = httpx.get(f"{fuzzed.url}/openapi.json").json()
    for path, operations in document["paths"].items():
        if not path.startswith("/v1/"):
            continue
        for method, operation in operations.items():
            statuses = set(operation["responses"])
            assert {"401", "422", "503"} <= statuses, (method, path, statuses)
            if "{" in path:
                assert "404" in statuses, (method, path)
    job = document["components"]["schemas"]["JobCreate"]
    assert job["additionalProperties"] is False
    assert job["not"] == {"required": ["options", "flags"]}


def test_a_method_a_path_does_not_take_is_405_naming_every_method_it_does(
    fuzzed: LiveServer,
) -> None:
    import httpx

    answer = httpx.request("DELETE", f"{fuzzed.url}/v1/models")
    assert answer.status_code == 405 and answer.json()["code"] == "method_not_allowed"
    assert set(answer.headers["allow"].split(", ")) >= {"GET", "POST"}
