"""The console's approvals page: an operator approves or rejects, once, with their name."""

from __future__ import annotations

import re

from fastapi.testclient import TestClient

from outbox import schema
from outbox.api import create_app
from outbox.service import Outbox
from tests.mcp import support

REFUND = {"customer": "c-7", "amount_cents": 900}


def _csrf(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found, html
    return found.group(1)


def _signed_in(box: Outbox, token: str) -> TestClient:
    client = TestClient(create_app(box), base_url="https://testserver")
    page = client.get("/console/sign-in")
    signed = client.post(
        "/console/sign-in",
        data={"csrf": _csrf(page.text), "token": token, "name": "Grace", "next": ""},
        follow_redirects=False,
    )
    assert signed.status_code == 303, signed.text
    return client


def test_approve_and_reject_from_the_console(box: Outbox, operator_token: str):
    box.execute("acme", "refund-a", "issue_refund", REFUND)
    box.execute("acme", "refund-b", "issue_refund", REFUND)
    with _signed_in(box, operator_token) as client:
        page = client.get("/console/approvals")
        assert page.status_code == 200
        assert "refund-a" in page.text and "refund-b" in page.text
        assert "refund 900 to c-7" in page.text  # what it would send
        csrf = _csrf(page.text)
        for _ in range(2):  # a double click decides once
            done = client.post(
                "/console/approvals/decide",
                data={"csrf": csrf, "operation_id": "refund-a", "decision": "approve"},
            )
            assert done.status_code == 200
        assert "refund-a was already approved" in done.text
        refused = client.post(
            "/console/approvals/decide",
            data={"csrf": csrf, "operation_id": "refund-b", "decision": "reject"},
        )
        assert refused.status_code == 422 and "a rejection needs a reason" in refused.text
        rejected = client.post(
            "/console/approvals/decide",
            data={
                "csrf": csrf,
                "operation_id": "refund-b",
                "decision": "reject",
                "reason": "duplicate claim",
            },
        )
        assert "refund-b rejected" in rejected.text
        conflict = client.post(
            "/console/approvals/decide",
            data={"csrf": csrf, "operation_id": "refund-b", "decision": "approve"},
        )
        assert conflict.status_code == 409
        forged = client.post(
            "/console/approvals/decide",
            data={"csrf": "forged", "operation_id": "refund-b", "decision": "approve"},
        )
        assert forged.status_code == 403
        decided = client.get("/console/approvals?status=approved")
        # The audit's actor is the signed-in token; the typed name is only a note.
        assert "token:" in decided.text and "note: Grace" in decided.text
    a = box.show_approval("acme", "refund-a")
    b = box.show_approval("acme", "refund-b")
    assert (a["status"], b["status"]) == ("approved", "rejected")
    assert a["decision"]["actor"].startswith("token:")
    assert a["decision"]["actor"].endswith("; note: Grace")
    assert support.count(box, schema.approval_actions) == 2
