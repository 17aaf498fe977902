"""Property-based requests generated from ``/openapi.json`` (schemathesis), in process over ASGI.

Every answer must pass schemathesis' built-in checks (no 5xx; the status, the
content type, the required headers and the body are the ones the document
declares) and ours (errors are problem+json that leak nothing). Seeded and
bounded by count; authenticated with real tokens so the routes behind
authentication are exercised, plus a share of unauthenticated and operator
calls. A failure is reported for every operation at once, with the request
that shows it, instead of stopping (and shrinking) at the first."""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.failures import FailureGroup
from schemathesis.core.result import Ok

from outbox.api import create_app
from outbox.service import Outbox
from tests.api.conftest import PROBLEM, Tokens, written

MAX_EXAMPLES = 15  # per operation and generation mode: under a minute on a busy 2-core box
SEED = 20260101
BUILT_IN_CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


@pytest.fixture
def db_url(sqlite_url: str) -> str:
    # The generated requests test the HTTP layer; the contract suite covers both databases.
    return sqlite_url


def check_problem(response: Any, case: Any) -> None:
    status = response.status_code
    assert status < 500, f"{case.method} {case.formatted_path} -> {status}: {response.text}"
    if status >= 400:
        assert response.headers["content-type"][0] == PROBLEM, (status, response.headers)
        doc = response.json()
        assert {"type", "title", "status", "detail", "retry"} <= doc.keys(), doc
        assert doc["status"] == status
        assert doc["retry"] in ("same_key", "never", "after_fix", "reconcile")
        for leak in ("Traceback", "sqlalchemy", "SELECT ", "INSERT "):
            assert leak not in response.text


# Bounded by count (MAX_EXAMPLES); the timeout only guards against a hang on a slow machine.
@pytest.mark.timeout(900)
def test_generated_requests_pass_the_built_in_checks_and_errors_are_problem_json(
    box: Outbox, tokens: Tokens
) -> None:
    app = create_app(box)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = []
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), result  # an Err means our OpenAPI document is broken
        operations.append(result.ok())
    assert {op.path for op in operations} >= {
        "/v1/tasks",
        "/v1/tools/{tool}",
        "/v1/operations/{operation_id}",
        "/v1/tasks/{task_id}",
    }
    calls = 0
    failures: dict[str, str] = {}
    unsatisfiable: list[str] = []
    statuses: set[int] = set()
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            strategy = operation.as_strategy(generation_mode=mode)

            @seed(SEED)
            @settings(
                max_examples=MAX_EXAMPLES,
                derandomize=True,
                database=None,
                deadline=None,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=strategy, who=st.sampled_from(["agent", "agent", "operator", "none"]))
            def run(case: Any, who: str) -> None:
                nonlocal calls
                token = {"agent": tokens.acme, "operator": tokens.acme_operator}.get(who)
                headers = {"Authorization": f"Bearer {token}"} if token else {}
                response = case.call(headers=headers)
                calls += 1
                statuses.add(response.status_code)
                try:
                    case.validate_response(response, checks=BUILT_IN_CHECKS, headers=headers)
                    check_problem(response, case)
                except (FailureGroup, AssertionError) as failure:
                    # run() is called in this iteration: the loop variables are the current ones.
                    where = f"{operation.label} ({mode.value})"  # noqa: B023
                    failures.setdefault(where, str(failure))

            try:
                run()
            except Unsatisfiable:
                # Nothing to make invalid (no parameters, no body): /healthz, /readyz, ...
                assert mode is GenerationMode.NEGATIVE, operation.path
                unsatisfiable.append(operation.path)
    assert not failures, "\n\n".join(f"{where}: {text}" for where, text in failures.items())
    assert calls >= 100
    assert set(unsatisfiable) <= {"/healthz", "/readyz", "/problems", "/problems/{slug}"}, (
        unsatisfiable
    )
    # The generator reached past authentication: created (or replayed) and validation answers.
    assert 201 in statuses
    assert statuses & {400, 422}
    assert 401 in statuses
    # Whatever was created is the agent's own tenant's.
    assert written(box)["operations"] >= 1
