"""Each tool of the app is its own operation, ``POST /v1/tools/<name>``, in /openapi.json,
with its arguments' schema as the request body and an example from its model."""

from __future__ import annotations

from collections import Counter
from typing import Any

import httpx
import pytest
from pydantic import BaseModel, ConfigDict

from outbox import Outbox, tools
from outbox.api import create_app
from outbox.app import App


def document(box: Outbox) -> dict[str, Any]:
    app = create_app(box, load_entry_points=False)
    return app.openapi()


def write_operation(doc: dict[str, Any], tool: str) -> dict[str, Any]:
    operation: dict[str, Any] = doc["paths"][f"/v1/tools/{tool}"]["post"]
    return operation


def test_the_default_app_documents_create_support_task_with_schema_and_example(db_url):
    with Outbox(db_url) as box:
        doc = document(box)
    operation = write_operation(doc, "create_support_task")
    assert operation["operationId"] == "call_tool_create_support_task"
    body = operation["requestBody"]
    assert body["required"] is True
    content = body["content"]["application/json"]
    assert content["schema"]["properties"]["subject"]["maxLength"] == 200
    assert content["schema"]["required"] == ["subject"]
    assert content["schema"]["additionalProperties"] is False
    example = content["example"]
    assert example["subject"]
    # The example is valid arguments: the model itself accepts it.
    tools.SupportTaskArgs.model_validate(example)
    assert "201" in operation["responses"] and "422" in operation["responses"]
    assert [p["name"] for p in operation["parameters"]] == ["Idempotency-Key"]
    # The generic route stays, and no operation id is used twice.
    assert "/v1/tools/{tool}" in doc["paths"]
    ids = Counter(op["operationId"] for path in doc["paths"].values() for op in path.values())
    assert ids and max(ids.values()) == 1, ids


def test_the_example_apps_tools_each_have_an_operation(db_url, refunds_app):
    with Outbox(db_url, app=refunds_app, check_schema=False) as box:
        doc = document(box)
    for name, model in (("issue_refund", "IssueRefundArgs"), ("notify_customer", None)):
        content = write_operation(doc, name)["requestBody"]["content"]["application/json"]
        refunds_app.tools.get(name).arguments.model_validate(content["example"])
        if model:
            assert content["schema"]["title"] == model
    assert "/v1/tools/create_support_task" not in doc["paths"]
    assert "/v1/tasks" not in doc["paths"]  # the demo's shortcut goes with the demo's tool


class Address(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str


class Shipment(BaseModel):
    model_config = ConfigDict(
        extra="forbid", json_schema_extra={"examples": [{"to": {"city": "Ghent"}}]}
    )
    to: Address


def test_nested_argument_models_are_components_the_schema_refers_to(db_url):
    tool = tools.Tool("ship", 1, Shipment, lambda ctx, args: tools.ToolOutput({}))
    with Outbox(db_url, app=App("ships", tools=[tool]), check_schema=False) as box:
        doc = document(box)
    schema = write_operation(doc, "ship")["requestBody"]["content"]["application/json"]["schema"]
    assert schema["properties"]["to"] == {"$ref": "#/components/schemas/Address"}
    assert doc["components"]["schemas"]["Address"]["properties"]["city"]["type"] == "string"
    assert "$defs" not in schema


@pytest.mark.anyio
async def test_an_unknown_tool_lists_the_known_ones(db_url, refunds_app):
    with Outbox(db_url, app=refunds_app, check_schema=False) as box:
        box.create_tenant("shop")
        token = box.create_token("shop", "agent")
        transport = httpx.ASGITransport(app=create_app(box, load_entry_points=False))
        async with httpx.AsyncClient(transport=transport, base_url="http://outbox") as client:
            response = await client.post(
                "/v1/tools/issue_refunds",
                json={},
                headers={"Authorization": f"Bearer {token}", "Idempotency-Key": "k"},
            )
    assert response.status_code == 404
    problem = response.json()
    assert problem["type"] == "/problems/unknown-tool"
    assert problem["known_tools"] == ["issue_refund", "notify_customer"]
    assert "known tools: issue_refund, notify_customer" in problem["detail"]
