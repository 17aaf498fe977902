"""The console's pages without a browser: search, deep links, the time series,
errors with their real cause, and tenant isolation across all of them.

The evidence is made the way production makes it: tools through ``Outbox.execute``
and attempts through the real dispatcher, with a scripted adapter and a clock
the test moves, on SQLite and on PostgreSQL.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import sqlalchemy as sa
from markupsafe import escape

import adapters
from adapters import DeliveryRequest, DeliveryResult
from adapters.testing import FakeAdapter
from outbox import Outbox, db, schema, settings
from outbox.api import create_app
from outbox.delivery.dispatcher import Dispatcher
from reconciler import review
from reconciler.console import pages, plots, queries
from tests.conftest import Clock
from tests.support.servers import serve_in_thread

ACME, OTHER = "acme", "other"
IGNORES = adapters.Capabilities(honours_idempotency_keys=False, supports_lookup=True)
T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
SETTINGS = {"backoff_initial": 1, "backoff_max": 30, "concurrency": 1, "max_attempts": 5}


def decide(request: DeliveryRequest) -> DeliveryResult:
    """The provider's answer, chosen by the operation id's first word."""
    kind = request.operation_id.split("-")[0]
    if kind == "retry" and request.attempt == 1:
        return DeliveryResult.not_sent("ConnectError: connection refused")
    if kind == "unknown":
        return DeliveryResult.ambiguous("ReadTimeout: no reply after the send")
    if kind == "noted":  # delivered, with a remark the adapter kept as its error
        return DeliveryResult.delivered(
            "T-noted", status_code=201, error="reply had no ticket id; reference from Location"
        )
    if kind == "fail":
        return DeliveryResult.permanent("subject too long", status_code=422)
    return DeliveryResult.delivered(f"T-{request.operation_id}", status_code=201)


@contextmanager
def browse(box: Outbox) -> Iterator[httpx.Client]:
    """The API with the console, on a loopback port, and a client that keeps cookies."""
    with (
        serve_in_thread(create_app(box)) as url,
        httpx.Client(base_url=url, timeout=30, follow_redirects=True) as client,
    ):
        yield client


@dataclass
class Site:
    box: Outbox
    clock: Clock
    client: httpx.Client
    adapter: FakeAdapter
    tokens: dict[str, str]

    def run(self, tenant: str, *operation_ids: str, at: datetime) -> None:
        """Create one task per id at ``at``, then deliver everything due at ``at``."""
        self.clock.now = at
        for op in operation_ids:
            assert self.box.execute(tenant, op, "create_support_task", {"subject": op}).created
        self.dispatch(at)

    def dispatch(self, at: datetime) -> int:
        self.clock.now = at
        self.adapter.push(*[decide] * 20)
        config = settings.load(**SETTINGS)
        registry = adapters.Registry([self.adapter])
        dispatcher = Dispatcher(
            self.box.engine, registry, config, worker_id="w1", rng=random.Random(3)
        )
        try:
            return dispatcher.run_once(now=at)
        finally:
            dispatcher.close()

    def sign_in(self, who: str = "acme-operator") -> None:
        self.client.cookies.clear()
        page = self.client.get("/console/sign-in")
        csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)
        assert csrf is not None
        done = self.client.post(
            "/console/sign-in",
            data={"csrf": csrf.group(1), "token": self.tokens[who], "name": who, "next": ""},
            follow_redirects=False,
        )
        assert done.status_code == 303, done.text

    def effect(self, tenant: str, operation_id: str) -> Any:
        out = schema.outbox
        with db.read(self.box.engine) as conn:
            return conn.execute(
                sa.select(out).where(out.c.tenant == tenant, out.c.operation_id == operation_id)
            ).one()


@pytest.fixture
def site(db_url: str) -> Iterator[Site]:
    clock = Clock(T0)
    with Outbox(db_url, clock=clock) as box:
        for tenant in (ACME, OTHER):
            box.create_tenant(tenant)
        tokens = {
            "acme-operator": box.create_token(ACME, "operator", "a"),
            "other-operator": box.create_token(OTHER, "operator", "o"),
        }
        adapter = FakeAdapter("helpdesk", IGNORES)
        with browse(box) as client:
            yield Site(box, clock, client, adapter, tokens)


@pytest.fixture
def history(site: Site) -> Site:
    """Attempts over a day and a bit, in two tenants, read at 12:47."""
    site.run(ACME, "deliver-ancient", at=T0 - timedelta(hours=25, minutes=30))
    site.run(ACME, "deliver-old", at=T0 - timedelta(hours=1, minutes=58))
    site.run(OTHER, "deliver-9", "unknown-9", "unknown-8", at=T0)
    site.run(ACME, "deliver-1", "retry-1", "unknown-1", "fail-1", at=T0)
    assert site.dispatch(T0 + timedelta(minutes=10)) == 1  # the retry, delivered
    site.clock.now = T0 + timedelta(minutes=47)
    return site


# --- the time series ---------------------------------------------------------------


def test_buckets_end_with_the_current_one_and_are_aligned() -> None:
    now = datetime(2026, 1, 1, 12, 47, 13, tzinfo=UTC)
    hour = plots.HOUR.edges(now)
    assert (hour[0], hour[-1], len(hour)) == (
        datetime(2026, 1, 1, 11, 50, tzinfo=UTC),
        datetime(2026, 1, 1, 12, 50, tzinfo=UTC),
        13,
    )
    day = plots.DAY.edges(now)
    assert (day[0], day[-1], len(day)) == (
        datetime(2025, 12, 31, 13, 0, tzinfo=UTC),
        datetime(2026, 1, 1, 13, 0, tzinfo=UTC),
        25,
    )
    # On an edge, the bucket that starts there is the current one.
    assert plots.HOUR.edges(datetime(2026, 1, 1, 12, 50, tzinfo=UTC))[-1] == hour[-1] + timedelta(
        minutes=5
    )


def test_the_series_count_each_attempt_once_per_tenant_and_window(history: Site) -> None:
    now = history.clock()
    (hour,) = plots.attempt_counts(history.box.engine, ACME, plots.HOUR, now).values()
    assert hour.adapter == "helpdesk"
    # 11:50 + 2 buckets = 12:00 (the first send of four), + 4 = 12:10 (the retry's delivery).
    expected = {s.name: [0] * 12 for s in plots.SERIES}
    expected["delivered"][2] = 1
    expected["retried"][2] = 1
    expected["unknown"][2] = 1
    expected["failed"][2] = 1
    expected["delivered"][4] = 1
    assert hour.counts == expected

    (day,) = plots.attempt_counts(history.box.engine, ACME, plots.DAY, now).values()
    # Yesterday 13:00 + 21 = 10:00 (deliver-old, at 10:02); + 23 = 12:00 (the rest).
    # deliver-ancient (25.5 hours ago) is outside the day.
    assert day.counts["delivered"][21] == 1
    assert {s.name: day.counts[s.name][23] for s in plots.SERIES} == {
        "delivered": 2,
        "retried": 1,
        "unknown": 1,
        "failed": 1,
    }
    assert sum(day.totals) == 6

    (theirs,) = plots.attempt_counts(history.box.engine, OTHER, plots.HOUR, now).values()
    assert {s.name: theirs.total(s.name) for s in plots.SERIES} == {
        "delivered": 1,
        "retried": 0,
        "unknown": 2,
        "failed": 0,
    }


def test_the_overview_draws_the_plots_as_inline_svg_for_its_own_tenant(history: Site) -> None:
    history.sign_in("acme-operator")
    page = history.client.get("/console/overview")
    assert page.status_code == 200
    html = page.text
    assert html.count('<svg xmlns="http://www.w3.org/2000/svg"') >= 2
    assert 'data-adapter="helpdesk" data-window="hour"' in html
    assert 'data-adapter="helpdesk" data-window="day"' in html
    delivered = re.findall(r'data-series="delivered" data-bucket="(\d+)" data-count="(\d+)"', html)
    # Hour: buckets 2 and 4; day: bucket 21 and bucket 23 (two delivered).
    assert sorted(delivered) == sorted([("2", "1"), ("4", "1"), ("21", "1"), ("23", "2")])
    unknown = re.findall(r'data-series="unknown" data-bucket="(\d+)" data-count="(\d+)"', html)
    assert unknown == [("2", "1"), ("23", "1")]  # acme's one, never other's two
    assert "<script" not in html.split("</head>")[1]  # drawn on the server, no script
    assert "http" not in re.sub(r'xmlns="http://www.w3.org/2000/svg"', "", html.split("<main")[1])

    history.sign_in("other-operator")
    theirs = history.client.get("/console/overview").text
    assert re.findall(r'data-series="unknown" data-bucket="(\d+)" data-count="(\d+)"', theirs) == [
        ("2", "2"),
        ("23", "2"),
    ]


def test_an_overview_with_no_attempts_says_so(site: Site) -> None:
    site.sign_in()
    page = site.client.get("/console/overview")
    assert page.status_code == 200 and "No delivery attempt finished in the last day" in page.text


def test_svg_text_is_escaped() -> None:
    edges = plots.HOUR.edges(T0)
    counts = {s.name: [1] + [0] * 11 for s in plots.SERIES}
    drawn = str(plots.svg(plots.Plot('<img src=x onerror="1">', plots.HOUR, edges, counts)))
    assert "<img" not in drawn and "&lt;img" in drawn
    assert plots.nice_ceiling(0) == 1 and plots.nice_ceiling(7) == 10
    assert plots.nice_ceiling(20) == 20 and plots.nice_ceiling(21) == 50


# --- search ----------------------------------------------------------------------


def _hits(site: Site, q: str) -> list[tuple[str, str]]:
    page = site.client.get("/console/search", params={"q": q})
    assert page.status_code == 200, page.text
    return re.findall(
        r'<a href="(/console/(?:items|operations)/[^"]+)">((?:Effect|Operation) [^<]+)</a></th>',
        page.text,
    )


def test_search_finds_an_operation_an_effect_key_and_a_provider_reference(history: Site) -> None:
    history.sign_in()
    retry = history.effect(ACME, "retry-1")
    assert _hits(history, "retry-1") == [("/console/operations/retry-1", "Operation retry-1")]
    assert _hits(history, retry.effect_key) == [
        (f"/console/items/{retry.id}", f"Effect #{retry.id}")
    ]
    assert _hits(history, "T-retry-1") == [(f"/console/items/{retry.id}", f"Effect #{retry.id}")]
    page = history.client.get("/console/search", params={"q": f"  {retry.effect_key}  "})
    assert "effect key" in page.text  # trimmed, and says what matched
    # Exact only: a prefix or another case finds nothing, and says where it looked.
    for q in ("retry", "RETRY-1", retry.effect_key[:-1]):
        page = history.client.get("/console/search", params={"q": q})
        assert 'data-testid="no-hits"' in page.text and "tenant <strong>acme</strong>" in page.text


def test_search_never_shows_another_tenants_items(history: Site) -> None:
    theirs = history.effect(OTHER, "deliver-9")
    history.sign_in("acme-operator")
    for q in ("deliver-9", theirs.effect_key, theirs.provider_ref):
        assert _hits(history, q) == [], q
    history.sign_in("other-operator")
    assert _hits(history, theirs.effect_key) == [
        (f"/console/items/{theirs.id}", f"Effect #{theirs.id}")
    ]


def test_a_reference_seen_only_on_an_attempt_is_found(history: Site) -> None:
    # An operator resolved it with a reference of their own; the attempt's stays evidence.
    found = queries.search(history.box.engine, ACME, "T-deliver-1")
    assert [(h.kind, h.matched) for h in found] == [("effect", "provider reference")]
    effect = history.effect(ACME, "deliver-1")
    with db.write(history.box.engine) as conn:
        conn.execute(
            sa.update(schema.outbox)
            .where(schema.outbox.c.id == effect.id)
            .values(provider_ref="T-corrected")
        )
    (hit,) = queries.search(history.box.engine, ACME, "T-deliver-1")
    assert (hit.effect_id, hit.detail) == (effect.id, "reported by attempt 1")


def test_search_text_too_long_is_an_error_on_top(site: Site) -> None:
    site.sign_in()
    page = site.client.get("/console/search", params={"q": "x" * 501})
    assert page.status_code == 400
    _assert_alert_first(page.text, "The search text is 501 characters long")
    assert 'href="#search-q"' in page.text


# --- deep links --------------------------------------------------------------------


def test_operation_page_lists_its_effects_and_links_back(history: Site) -> None:
    history.sign_in()
    retry = history.effect(ACME, "retry-1")
    page = history.client.get("/console/operations/retry-1")
    assert page.status_code == 200
    assert f'href="/console/items/{retry.id}"' in page.text
    assert "T-retry-1" in page.text
    item = history.client.get(f"/console/items/{retry.id}")
    assert 'href="/console/operations/retry-1"' in item.text


@pytest.mark.parametrize("operation_id", ["a/b?c#d%f", "a&b=c+d;e", ".", "..", "x/../y", "%2F"])
def test_any_operation_id_has_a_working_link(site: Site, operation_id: str) -> None:
    site.run(ACME, operation_id, at=T0)
    site.sign_in()
    url = pages.operation_url(operation_id)
    page = site.client.get(url)
    assert page.status_code == 200, (url, page.text)
    assert f"<code>{escape(operation_id)}</code>" in page.text


def test_deep_links_do_not_cross_tenants(history: Site) -> None:
    theirs = history.effect(OTHER, "deliver-9")
    history.sign_in("acme-operator")
    item = history.client.get(f"/console/items/{theirs.id}")
    assert item.status_code == 404
    _assert_alert_first(item.text, f"There is no effect #{theirs.id} for tenant acme.")
    assert "deliver-9" not in item.text and theirs.effect_key not in item.text
    op = history.client.get("/console/operations/deliver-9")
    assert op.status_code == 404
    _assert_alert_first(op.text, "There is no operation &#39;deliver-9&#39; for tenant acme.")
    assert theirs.effect_key not in op.text


def test_a_deep_link_survives_a_restart_through_sign_in(history: Site) -> None:
    effect = history.effect(ACME, "unknown-1")
    history.sign_in()
    link = f"/console/items/{effect.id}"
    assert history.client.get(link).status_code == 200
    # A restart: a new app, a new signing secret; the old cookie is now foreign.
    with browse(history.box) as fresh:
        fresh.cookies = history.client.cookies
        bounce = fresh.get(link, follow_redirects=False)
        assert bounce.status_code == 303
        assert bounce.headers["location"] == (
            f"/console/sign-in?next={quote(link, safe='')}&ended=restarted"
        )
        sign_in = fresh.get(bounce.headers["location"])
        _assert_alert_first(sign_in.text, "the console restarted since you signed in")
        csrf = re.search(r'name="csrf" value="([^"]+)"', sign_in.text)
        assert csrf is not None and f'name="next" value="{link}"' in sign_in.text
        back = fresh.post(
            "/console/sign-in",
            data={"csrf": csrf.group(1), "token": history.tokens["acme-operator"], "next": link},
            follow_redirects=False,
        )
        assert back.headers["location"] == link
        assert fresh.get(link).status_code == 200


def test_a_malformed_effect_link_says_what_an_effect_link_looks_like(site: Site) -> None:
    site.sign_in()
    for bad in ("abc", "0", "99999999999999999999", "-1"):
        page = site.client.get(f"/console/items/{bad}")
        assert page.status_code == 404, bad
        _assert_alert_first(page.text, "Effect links end in the effect")


def test_the_console_root_lands_on_the_review_queue(site: Site) -> None:
    for root in ("/console", "/console/"):
        landing = site.client.get(root, follow_redirects=False)
        assert landing.headers["location"] == "/console/queue"
    signed_out = site.client.get("/console/", follow_redirects=True)
    assert "--tenant &lt;tenant&gt; --role operator" in signed_out.text
    site.sign_in()
    assert "Review queue" in site.client.get("/console/").text


# --- errors on top, with the real cause ---------------------------------------------


def _assert_alert_first(html: str, text: str) -> None:
    main = html.split('<main id="main">', 1)[1]
    first = main.lstrip().split(">", 1)[0]
    assert 'role="alert"' in first and 'tabindex="-1"' in first and "autofocus" in first, first
    alert = main.split("</div>", 1)[0]
    assert text in alert, alert


def test_a_resolve_form_error_is_on_top_and_names_each_field(history: Site) -> None:
    effect = history.effect(ACME, "unknown-1")
    history.sign_in()
    page = history.client.get(f"/console/items/{effect.id}")
    csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert csrf is not None
    posted = history.client.post(
        f"/console/items/{effect.id}/resolve",
        data={
            "csrf": csrf.group(1),
            "action_id": "console_x",
            "expected_status": "outcome_unknown",
            "expected_attempts": "1",
            "choice": "happened",
            "reason": "",
        },
    )
    assert posted.status_code == 422
    _assert_alert_first(posted.text, "Give the provider&#39;s reference for the effect you found.")
    assert 'href="#provider_ref"' in posted.text and 'href="#reason"' in posted.text
    assert "<title>Error: " in posted.text


def test_a_refused_form_says_whether_the_token_was_missing_or_foreign(history: Site) -> None:
    effect = history.effect(ACME, "unknown-1")
    history.sign_in()
    form = {"action_id": "a", "expected_status": "outcome_unknown", "expected_attempts": "1"}
    missing = history.client.post(f"/console/items/{effect.id}/resolve", data=form)
    assert missing.status_code == 403
    _assert_alert_first(missing.text, "The form carried no security token")
    foreign = history.client.post(
        f"/console/items/{effect.id}/resolve", data={**form, "csrf": "from-another-session"}
    )
    _assert_alert_first(foreign.text, "belongs to another session")


def test_sign_in_says_revoked_or_unknown(site: Site) -> None:
    token = site.tokens["acme-operator"]
    site.box.revoke_token(token)
    page = site.client.get("/console/sign-in")
    csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert csrf is not None
    refused = site.client.post(
        "/console/sign-in", data={"csrf": csrf.group(1), "token": token, "next": ""}
    )
    assert refused.status_code == 401
    _assert_alert_first(refused.text, "That token was revoked at 2026-01-01 12:00:00 UTC")


def test_a_sign_in_form_without_its_cookie_says_so(site: Site) -> None:
    page = site.client.get("/console/sign-in")
    csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert csrf is not None
    site.client.cookies.clear()  # blocked, or expired after an hour
    refused = site.client.post(
        "/console/sign-in", data={"csrf": csrf.group(1), "token": site.tokens["acme-operator"]}
    )
    assert refused.status_code == 403
    _assert_alert_first(refused.text, "The sign-in form expired or its cookie was not sent")
    assert "outbox_console=" not in refused.headers.get("set-cookie", "")


def test_a_post_without_a_session_says_nothing_changed(history: Site) -> None:
    effect = history.effect(ACME, "unknown-1")
    for path in (f"/console/items/{effect.id}/resolve", "/console/items/abc/resolve"):
        posted = history.client.post(path, data={"csrf": "x", "confirm": "yes"})
        assert posted.status_code == 401, path
        _assert_alert_first(posted.text, "Nothing changed: you are signed out.")
    assert history.effect(ACME, "unknown-1").status == "outcome_unknown"


def test_a_session_of_a_revoked_token_says_so(history: Site) -> None:
    history.sign_in()
    history.box.revoke_token(history.tokens["acme-operator"])
    page = history.client.get("/console/queue")
    _assert_alert_first(page.text, "The token you signed in with was revoked")


def test_a_database_failure_names_the_drivers_error(sqlite_url: str, tmp_path: Path) -> None:
    with Outbox(sqlite_url) as box:
        box.create_tenant(ACME)
        token = box.create_token(ACME, "operator")
        with browse(box) as client:
            page = client.get("/console/sign-in")
            csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)
            assert csrf is not None
            client.post("/console/sign-in", data={"csrf": csrf.group(1), "token": token})
            box.engine.dispose()
            Path(sqlite_url.removeprefix("sqlite:///")).unlink()
            broken = client.get("/console/queue")
            assert broken.status_code == 503
            _assert_alert_first(broken.text, "sqlite3.OperationalError: no such table: api_tokens")
            assert "SELECT" not in broken.text  # the cause, not the statement


# --- "Last error" once it succeeded --------------------------------------------------


def test_last_error_is_history_once_the_effect_succeeded(history: Site) -> None:
    history.run(ACME, "noted-1", at=history.clock())
    noted = history.effect(ACME, "noted-1")
    assert (noted.status, noted.last_error) == (
        "succeeded",
        "reply had no ticket id; reference from Location",
    )
    unknown = history.effect(ACME, "unknown-1")
    review.resolve(
        history.box.engine,
        unknown.id,
        choice="happened",
        reason="Found it in the helpdesk.",
        actor="test",
        action_id="a1",
        provider_ref="T-found",
        tenant=ACME,
        now=history.clock(),
    )
    history.sign_in()
    for effect_id, error in (
        (noted.id, "reply had no ticket id"),
        (unknown.id, "ReadTimeout: no reply after the send"),
    ):
        page = history.client.get(f"/console/items/{effect_id}").text
        assert 'data-testid="last-error"' not in page
        assert 'data-testid="earlier-errors"' in page
        # The error is kept as history, with the attempt it belongs to.
        before, attempts = page.split('data-testid="attempts"', 1)
        assert error not in before and error in attempts
    operation = history.client.get("/console/operations/noted-1").text
    assert "reply had no ticket id" not in operation

    failed = history.effect(ACME, "fail-1")
    page = history.client.get(f"/console/items/{failed.id}").text
    assert 'data-testid="last-error"' in page and "subject too long" in page
