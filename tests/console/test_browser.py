"""The operator console in a real headless Chromium, against a real dropped reply.

Every test starts from the state ``conftest.console`` builds through the real
dispatcher and sweeps: two lost replies at a provider that ignores keys and
cannot be asked, waiting for a person. Each test saves screenshots in its
``tmp_path``.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.console.conftest import PHONE, Console

pytestmark = pytest.mark.browser


def test_operator_resolves_a_dropped_reply(console: Console, browser: Any) -> None:
    first, second = console.unknown_ids
    page = console.new_page(browser)
    console.sign_in(page, console.alice, "Alice")

    # The queue: both lost replies, oldest first, with counts and the oldest age.
    assert page.get_by_test_id("count-awaiting_review").inner_text() == "2"
    assert page.get_by_test_id("count-awaiting_lookup").inner_text() == "0"
    rows = page.locator("table.queue tbody tr")
    assert [r.get_attribute("data-effect-id") for r in rows.all()] == [str(first), str(second)]
    assert "Parcel" not in page.content()  # the queue lists effects, not payloads
    console.screenshot(page, "console-queue", readme=True, full=False)

    # The item: the request, the task, the key and the attempt that lost its reply.
    page.get_by_role("link", name=f"Effect #{first}").click()
    page.wait_for_url(f"**/console/items/{first}")
    effect_key = page.get_by_test_id("effect-key").inner_text()
    assert effect_key == console.effect(first).effect_key
    attempts = page.get_by_test_id("attempts").locator("tbody tr")
    assert attempts.count() == 1
    attempt = attempts.first.inner_text()
    assert "dispatcher-a" in attempt and "ambiguous" in attempt
    assert "RemoteProtocolError" in attempt  # the dropped connection, as the adapter saw it
    assert "Parcel 4417 arrived damaged" in page.locator("#task-h + dl").inner_text()
    assert "cannot look effects up" in page.content()
    console.screenshot(page, "console-item", readme=True)

    # Resolve: the operator found the ticket at the provider under the effect key.
    ticket = console.ticket_for(effect_key)
    page.get_by_label("It happened", exact=True).check()
    page.get_by_label("Provider reference").fill(ticket)
    page.get_by_label("Reason").fill(f"Found {ticket} in the helpdesk, created at the drop.")
    page.get_by_role("button", name="Review this decision").click()

    # The confirmation step says exactly what will happen; nothing has changed yet.
    assert page.get_by_role("heading", name=f"Confirm: effect #{first}").is_visible()
    assert f"provider reference {ticket}" in page.locator(".consequences").inner_text()
    assert console.effect(first).status == "outcome_unknown"
    confirm_form = {
        el.get_attribute("name"): el.get_attribute("value")
        for el in page.locator("form.confirm-actions input[type=hidden]").all()
    }
    console.screenshot(page, "confirm")
    page.get_by_role("button", name="Confirm").click()
    page.wait_for_url(re.compile(rf".*/console/items/{first}\?done="))

    # The audit entry, on the page and in the database.
    assert "Recorded:" in page.get_by_test_id("recorded").inner_text()
    audit = page.get_by_test_id("audit").inner_text()
    assert "Alice (token:" in audit and f"Found {ticket}" in audit and "succeeded" in audit
    assert page.get_by_test_id("status").inner_text() == "succeeded"
    assert page.get_by_role("button", name="Review this decision").count() == 0
    row = console.effect(first)
    assert (row.status, row.provider_ref, row.effect_key) == ("succeeded", ticket, effect_key)
    console.screenshot(page, "resolved")

    # The same confirmation posted again (a double click that got through, a
    # resubmitted form): replayed, not acted on twice.
    again = page.request.post(f"/console/items/{first}/resolve", form=confirm_form, max_redirects=0)
    assert again.status == 303 and "replayed=1" in again.headers["location"]
    assert len(console.actions(first)) == 1

    # The queue shrank.
    page.get_by_role("navigation").get_by_role("link", name="Queue").click()
    assert page.get_by_test_id("count-awaiting_review").inner_text() == "1"
    assert page.locator("table.queue tbody tr").count() == 1
    console.screenshot(page, "queue-after")


def test_a_stale_form_shows_what_someone_else_did(console: Console, browser: Any) -> None:
    first = console.unknown_ids[0]
    alice = console.new_page(browser)
    bob = console.new_page(browser)
    console.sign_in(alice, console.alice, "Alice")
    console.sign_in(bob, console.bob, "Bob")

    # Alice gets as far as the confirmation page...
    alice.goto(f"/console/items/{first}")
    alice.get_by_label("It did not happen: deliver it again").check()
    alice.get_by_label("Reason").fill("Nothing in the helpdesk; send it again.")
    alice.get_by_role("button", name="Review this decision").click()
    assert alice.get_by_role("heading", name=f"Confirm: effect #{first}").is_visible()

    # ...while Bob, in his own tab, abandons it.
    bob.goto(f"/console/items/{first}")
    bob.get_by_label("It did not happen, and must not").check()
    bob.get_by_label("Reason").fill("Customer withdrew the request by phone.")
    bob.get_by_role("button", name="Review this decision").click()
    bob.get_by_role("button", name="Confirm").click()
    bob.wait_for_url(re.compile(r".*\?done="))

    # Alice confirms her stale form: nothing happens, and she is told what did.
    alice.get_by_role("button", name="Confirm").click()
    conflict = alice.get_by_test_id("conflict").inner_text()
    assert "Someone else resolved it" in conflict
    assert "Bob (token:" in conflict and "Customer withdrew the request by phone." in conflict
    assert "failed" in conflict
    console.screenshot(alice, "conflict")
    row = console.effect(first)
    assert row.status == "failed" and row.reason == "operator_abandon"
    # The actor is Bob's token; the name he signed in with is only a note.
    [action] = console.actions(first)
    assert action.actor.startswith("token:") and action.actor_note == "Bob"


def test_an_agent_token_cannot_sign_in(console: Console, browser: Any) -> None:
    page = console.new_page(browser)
    page.goto("/console/queue")
    page.wait_for_url("**/console/sign-in?next=*")
    page.get_by_label("Operator token").fill(console.agent)
    page.get_by_role("button", name="Sign in").click()
    assert "Agent tokens cannot sign in" in page.get_by_role("alert").inner_text()
    console.screenshot(page, "agent-refused")
    cookies = {c["name"] for c in page.context.cookies()}
    assert "outbox_console" not in cookies
    page.goto("/console/queue")
    assert "/console/sign-in" in page.url

    page.get_by_label("Operator token").fill("obx_not-a-token")
    page.get_by_role("button", name="Sign in").click()
    assert "That token is unknown to this deployment" in page.get_by_role("alert").inner_text()


def test_the_session_cookie_is_http_only_and_a_revoked_token_stops_working(
    console: Console, browser: Any
) -> None:
    page = console.new_page(browser)
    console.sign_in(page, console.alice, "Alice")
    (cookie,) = [c for c in page.context.cookies() if c["name"] == "outbox_console"]
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/console"
    assert console.alice not in cookie["value"]  # the token itself never leaves the server
    assert page.evaluate("document.cookie") == ""  # nothing readable by scripts

    console.box.revoke_token(console.alice)
    page.goto(f"/console/items/{console.unknown_ids[0]}")
    assert "/console/sign-in" in page.url


def test_a_form_without_its_csrf_token_is_refused(console: Console, browser: Any) -> None:
    first = console.unknown_ids[0]
    page = console.new_page(browser)
    console.sign_in(page, console.alice, "Alice")
    page.goto(f"/console/items/{first}")
    page.get_by_label("It did not happen, and must not").check()
    page.get_by_label("Reason").fill("Trying without the token.")
    page.locator("form.stack input[name=csrf]").evaluate("el => el.remove()")
    page.get_by_role("button", name="Review this decision").click()
    assert page.get_by_role("heading", name="Form refused").is_visible()
    console.screenshot(page, "csrf-refused")

    # Nor with a token from another session, on the final step.
    confirm = page.request.post(
        f"/console/items/{first}/resolve",
        form={
            "csrf": "forged",
            "action_id": "console_forged",
            "expected_status": "outcome_unknown",
            "expected_attempts": "1",
            "choice": "not_happened_abandon",
            "reason": "forged",
            "confirm": "yes",
        },
    )
    assert confirm.status == 403
    assert console.effect(first).status == "outcome_unknown"
    assert console.actions(first) == []


def test_keyboard_only_sign_in_and_the_overview(console: Console, browser: Any) -> None:
    page = console.new_page(browser)
    page.goto("/console/sign-in")
    order = []
    for _ in range(5):
        page.keyboard.press("Tab")
        order.append(
            page.evaluate("document.activeElement.id || document.activeElement.textContent")
        )
    # Natural order: skip link, home link, token, name, the button.
    assert order[2:] == ["token", "name", "Sign in"], order
    page.keyboard.press("Shift+Tab")
    page.keyboard.press("Shift+Tab")
    page.keyboard.type(console.alice)
    page.keyboard.press("Enter")
    page.wait_for_url("**/console/queue")

    page.goto("/console/overview")
    assert page.get_by_test_id("awaiting-review").inner_text() == "2"
    assert page.get_by_test_id("unknown").inner_text() == "2"
    assert page.get_by_test_id("outcome-ambiguous").text_content() == "2"
    assert page.get_by_test_id("outcome-delivered").text_content() == "1"
    assert page.locator("figure.chart svg rect").count() == 7
    console.screenshot(page, "overview")


def test_the_queue_filters_and_reads_on_a_phone(console: Console, browser: Any) -> None:
    page = console.new_page(browser, viewport=PHONE)
    console.sign_in(page, console.alice, "Alice")
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
    console.screenshot(page, "queue-phone")

    # The filter is a GET form: wait for the new page, not for the click (the URL
    # changes before the page loads, and page.content() does not wait).
    page.get_by_label("Older than").fill("1d")
    page.get_by_role("button", name="Filter").click()
    page.wait_for_url(re.compile(r".*[?&]min_age=1d(&|$)"))
    assert "Nothing is waiting that matches these filters" in page.content()
    assert page.get_by_test_id("count-awaiting_review").inner_text() == "0"

    page.get_by_label("Older than").fill("soon")
    page.get_by_role("button", name="Filter").click()
    page.get_by_text("Write an age like").first.wait_for()

    page.goto("/console/queue?adapter=helpdesk&group=awaiting_review&min_age=0s")
    assert page.locator("table.queue tbody tr").count() == 2
    page.goto(f"/console/items/{console.unknown_ids[0]}")
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
    console.screenshot(page, "item-phone")
