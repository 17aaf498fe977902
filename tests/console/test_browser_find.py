"""Finding things in the console, in a real Chromium: search, deep links, the
time series, and an error that is seen first.

Same starting state as ``test_browser``: two lost replies waiting for a
person and one delivered ticket, made by the real dispatcher against the fake
helpdesk. A second tenant, with its own operator, checks that nothing of the
first leaks through a search, a pasted link or a plot.
"""

from __future__ import annotations

import random
import re
from datetime import timedelta
from typing import Any

import pytest

import adapters
from adapters import DeliveryRequest, DeliveryResult
from adapters.testing import FakeAdapter
from outbox import Outbox, schema, settings
from outbox.api import create_app
from outbox.delivery.dispatcher import Dispatcher
from tests.console.conftest import LAPTOP, PHONE, Console
from tests.support.servers import serve_in_thread

pytestmark = pytest.mark.browser

OTHER = "globex"


def _search(page: Any, text: str) -> None:
    box = page.get_by_role("searchbox", name="Search this tenant")
    box.fill(text)
    box.press("Enter")
    page.wait_for_url("**/console/search?q=*")


SERIES = ("delivered", "retried", "unknown", "failed")


def _answer(request: DeliveryRequest) -> DeliveryResult:
    kind = request.operation_id.split("-")[1]
    if kind == "retry" and request.attempt == 1:
        return DeliveryResult.not_sent("ConnectError: connection refused")
    if kind == "unknown":
        return DeliveryResult.ambiguous("ReadTimeout: no reply after the send")
    if kind == "fail":
        return DeliveryResult.permanent("subject too long", status_code=422)
    return DeliveryResult.delivered(f"T-{request.operation_id}", status_code=201)


def _a_day_of_traffic(console: Console) -> dict[str, dict[str, int]]:
    """Attempts spread over the last day, made by the real dispatcher at past times.

    Returns what the hour and the day plots must add up to, per series.
    """
    now = schema.utcnow()
    adapter = FakeAdapter("helpdesk", adapters.Capabilities(False, False))
    registry = adapters.Registry([adapter])
    config = settings.load(concurrency=1)
    minutes = sorted({*range(2, 55, 4), *range(60, 23 * 60, 37)}, reverse=True)
    expected = {w: dict.fromkeys(SERIES, 0) for w in ("hour", "day")}
    for i, ago in enumerate(minutes):
        at = now - timedelta(minutes=ago)
        kinds = ["deliver"] * (1 + i % 3)
        kinds += ["retry"] if i % 4 == 0 else []
        kinds += ["unknown"] if i % 7 == 3 else []
        kinds += ["fail"] if i % 11 == 5 else []
        with Outbox(engine=console.box.engine, clock=lambda at=at: at, check_schema=False) as then:
            for k, kind in enumerate(kinds):
                then.execute(
                    "acme", f"hist-{kind}-{i}-{k}", "create_support_task", {"subject": kind}
                )
        adapter.push(*[_answer] * len(kinds))
        dispatcher = Dispatcher(console.box.engine, registry, config, rng=random.Random(i))
        try:
            assert dispatcher.run_once(now=at) == len(kinds)
            if "retry" in kinds:
                adapter.push(_answer)
                assert dispatcher.run_once(now=at + timedelta(minutes=1)) == 1
        finally:
            dispatcher.close()
        for window in ("hour", "day") if ago < 55 else ("day",):
            counts = expected[window]
            counts["delivered"] += kinds.count("deliver") + kinds.count("retry")
            counts["retried"] += kinds.count("retry")
            counts["unknown"] += kinds.count("unknown")
            counts["failed"] += kinds.count("fail")
    return expected


def _plotted(page: Any, window: str) -> dict[str, int]:
    svg = page.get_by_test_id(f"plot-helpdesk-{window}").locator("svg")
    return {
        series: sum(
            int(r.get_attribute("data-count") or 0)
            for r in svg.locator(f"rect[data-series={series}]").all()
        )
        for series in SERIES
    }


def _delivered(console: Console) -> Any:
    """The one ticket that went through (its effect sits between the two lost replies)."""
    first, second = console.unknown_ids
    (effect,) = [console.effect(i) for i in range(first + 1, second)]
    assert effect.status == "succeeded"
    return effect


def _other_operator(console: Console) -> str:
    console.box.create_tenant(OTHER)
    return console.box.create_token(OTHER, "operator", "globex on call")


def test_one_box_finds_an_operation_an_effect_key_and_a_provider_reference(
    console: Console, browser: Any
) -> None:
    first = console.unknown_ids[0]
    effect = console.effect(first)
    page = console.new_page(browser)
    console.sign_in(page, console.alice, "Alice")

    # The operation id the agent used (its Idempotency-Key).
    _search(page, effect.operation_id)
    hits = page.get_by_test_id("hits")
    assert hits.locator("tbody tr").count() == 1
    assert "operation id" in hits.inner_text()
    hits.get_by_role("link", name=f"Operation {effect.operation_id}").click()
    page.wait_for_url(f"**/console/operations/{effect.operation_id}")
    assert page.get_by_test_id("effects").locator("tbody tr").count() == 1
    assert "outcome_unknown" in page.get_by_test_id("effects").inner_text()
    console.screenshot(page, "console-operation", readme=True, full=False)

    # The effect key the provider received, with spaces around it as pasted.
    _search(page, f"  {effect.effect_key} ")
    assert "effect key" in page.get_by_test_id("hits").inner_text()
    page.get_by_test_id("hits").get_by_role("link", name=f"Effect #{first}").click()
    page.wait_for_url(f"**/console/items/{first}")
    assert page.get_by_test_id("effect-key").inner_text() == effect.effect_key

    # The provider's reference of the ticket that went through.
    delivered = _delivered(console)
    _search(page, delivered.provider_ref)
    hits = page.get_by_test_id("hits")
    assert "provider reference" in hits.inner_text()
    assert hits.get_by_role("link", name=f"Effect #{delivered.id}").count() == 1
    console.screenshot(page, "console-search", readme=True, full=False)

    # Exact matches only, and the page says where it looked.
    _search(page, effect.effect_key[:-4])
    assert "Nothing in tenant acme" in page.get_by_test_id("no-hits").inner_text()


def test_another_tenants_operator_finds_nothing_of_ours(console: Console, browser: Any) -> None:
    first = console.unknown_ids[0]
    effect = console.effect(first)
    page = console.new_page(browser)
    console.sign_in(page, _other_operator(console), "Gil")

    for text in (effect.operation_id, effect.effect_key, _delivered(console).provider_ref):
        _search(page, text)
        assert "Nothing in tenant globex" in page.get_by_test_id("no-hits").inner_text()
        assert page.get_by_test_id("hits").count() == 0

    # A pasted link to our effect or operation: not found, and nothing of it shown.
    page.goto(f"/console/items/{first}")
    alert = page.get_by_role("alert")
    assert alert.inner_text().startswith(f"There is no effect #{first} for tenant globex.")
    assert effect.effect_key not in page.content()
    page.goto(f"/console/operations/{effect.operation_id}")
    assert "There is no operation" in page.get_by_role("alert").inner_text()

    # Our attempts are not in their plots.
    page.goto("/console/overview")
    assert page.get_by_test_id("no-plots").is_visible()
    assert page.locator("figure.plot").count() == 0


def test_a_pasted_link_survives_a_restart_and_comes_back_after_sign_in(
    console: Console, browser: Any
) -> None:
    first = console.unknown_ids[0]
    page = console.new_page(browser)
    console.sign_in(page, console.alice, "Alice")
    page.goto(f"/console/items/{first}")
    link = page.get_by_test_id("permalink").get_attribute("href")
    assert link == f"/console/items/{first}"
    operation = console.effect(first).operation_id
    op_link = page.get_by_role("link", name=f"Operation {operation}").get_attribute("href")
    assert op_link == f"/console/operations/{operation}"
    (session,) = [c for c in page.context.cookies() if c["name"] == "outbox_console"]

    # The console restarts (a new process: a new signing secret, on a new port here).
    with serve_in_thread(create_app(console.box)) as restarted:
        context = browser.new_context(viewport=LAPTOP, base_url=restarted)
        console.contexts.append(context)
        context.add_cookies([{**session, "domain": "127.0.0.1", "path": "/console"}])
        again = context.new_page()
        again.goto(link)
        again.wait_for_url(re.compile(r".*/console/sign-in\?next=.*"))
        alert = again.get_by_role("alert")
        assert "the console restarted since you signed in" in alert.inner_text()
        assert again.evaluate("document.activeElement.id") == "page-alert"
        console.screenshot(again, "console-signed-out", readme=True, full=False)
        again.get_by_label("Operator token").fill(console.alice)
        again.get_by_role("button", name="Sign in").click()
        again.wait_for_url(f"**{link}")
        assert again.get_by_role("heading", name=f"Effect #{first}").is_visible()
        again.goto(op_link)
        assert again.get_by_role("heading", name=f"Operation {operation}").is_visible()


def test_the_overview_plots_each_adapter_over_the_hour_and_the_day(
    console: Console, browser: Any
) -> None:
    page = console.new_page(browser)
    console.sign_in(page, console.alice, "Alice")
    page.get_by_role("navigation").get_by_role("link", name="Overview").click()
    page.wait_for_url("**/console/overview")
    for window in ("hour", "day"):
        svg = page.get_by_test_id(f"plot-helpdesk-{window}").locator("svg")
        assert svg.get_attribute("role") == "img"
        # One delivered ticket and two lost replies, all in the current bucket.
        assert _plotted(page, window) == {"delivered": 1, "retried": 0, "unknown": 2, "failed": 0}
        box = svg.bounding_box()
        assert box is not None and box["width"] > 200 and box["height"] > 80
        assert "1 delivered, 0 retried, 2 unknown, 0 failed" in svg.locator("desc").text_content()

    # A day of traffic behind it: every attempt lands in its window, once.
    expected = _a_day_of_traffic(console)
    page.reload()
    for window in ("hour", "day"):
        now = {"delivered": 1, "retried": 0, "unknown": 2, "failed": 0}
        want = {k: v + now[k] for k, v in expected[window].items()}
        assert _plotted(page, window) == want, window
    columns = page.get_by_test_id("plot-helpdesk-day").locator("rect[data-series=delivered]")
    assert columns.count() >= 20  # spread over the day, not piled in one bucket
    console.screenshot(page, "console-overview", readme=True, full=True)


def test_an_error_is_shown_first_and_takes_the_focus(console: Console, browser: Any) -> None:
    first = console.unknown_ids[0]
    page = console.new_page(browser)
    console.sign_in(page, console.alice, "Alice")
    page.goto(f"/console/items/{first}")
    # The resolve form is far down the page; the operator scrolls to it.
    page.get_by_label("It happened", exact=True).check()
    page.get_by_label("Reason").fill("Found it, but forgot the reference.")
    page.get_by_role("button", name="Review this decision").click()
    page.wait_for_load_state()

    alert = page.get_by_role("alert")
    assert "Nothing changed. Fix this first:" in alert.inner_text()
    assert "Give the provider's reference for the effect you found." in alert.inner_text()
    assert page.evaluate("document.activeElement.id") == "page-alert"
    assert page.evaluate("window.scrollY") == 0
    box = alert.bounding_box()
    assert box is not None and 0 <= box["y"] < 200  # at the top, under the header
    assert page.title().startswith("Error: ")
    console.screenshot(page, "console-error", readme=True, full=False)

    # The cause links to its field.
    alert.get_by_role("link", name="Give the provider's reference").click()
    assert page.evaluate("document.activeElement.id") == "provider_ref"
    assert console.effect(first).status == "outcome_unknown"  # and nothing changed


def test_after_success_the_last_error_is_history(console: Console, browser: Any) -> None:
    first = console.unknown_ids[0]
    page = console.new_page(browser)
    console.sign_in(page, console.alice, "Alice")
    page.goto(f"/console/items/{first}")
    assert "RemoteProtocolError" in page.get_by_test_id("attempts").inner_text()
    ticket = console.ticket_for(page.get_by_test_id("effect-key").inner_text())
    page.get_by_label("It happened", exact=True).check()
    page.get_by_label("Provider reference").fill(ticket)
    page.get_by_label("Reason").fill(f"Found {ticket}.")
    page.get_by_role("button", name="Review this decision").click()
    page.get_by_role("button", name="Confirm").click()
    page.wait_for_url(re.compile(rf".*/console/items/{first}\?done="))

    assert page.get_by_test_id("status").inner_text() == "succeeded"
    assert page.get_by_test_id("last-error").count() == 0
    assert "None now: it succeeded" in page.get_by_test_id("earlier-errors").inner_text()
    # The error is still on the attempt it belongs to.
    assert "RemoteProtocolError" in page.get_by_test_id("attempts").inner_text()


def test_search_and_the_plots_fit_a_phone(console: Console, browser: Any) -> None:
    page = console.new_page(browser, viewport=PHONE)
    console.sign_in(page, console.alice, "Alice")
    effect = console.effect(console.unknown_ids[0])
    _search(page, effect.effect_key)
    assert page.get_by_test_id("hits").get_by_role("link", name=f"Effect #{effect.id}").count()
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
    page.goto("/console/overview")
    assert page.locator("figure.plot").count() == 2
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
    console.screenshot(page, "overview-phone")
