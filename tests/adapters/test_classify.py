"""The classification table, row by row (docs/adapter-protocol.md shows the same table)."""

from __future__ import annotations

import email.utils
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from adapters import Outcome, classify, classify_exception, classify_response, parse_retry_after
from adapters.protocol import ERROR_MAX_CHARS
from tests.adapters.support import FIXED_NOW, httpx_exception_classes, make_exception

NOT_SENT, AMBIGUOUS = Outcome.NOT_SENT, Outcome.AMBIGUOUS

# Written out independently of the code, so an edit of the table must be an
# edit of this test too. None: classified by the carried response.
EXPECTED_EXCEPTIONS: dict[type[BaseException], Outcome | None] = {
    httpx.HTTPError: AMBIGUOUS,
    httpx.RequestError: AMBIGUOUS,
    httpx.TransportError: AMBIGUOUS,
    httpx.TimeoutException: AMBIGUOUS,
    httpx.ConnectTimeout: NOT_SENT,
    httpx.ReadTimeout: AMBIGUOUS,
    httpx.WriteTimeout: AMBIGUOUS,
    httpx.PoolTimeout: NOT_SENT,
    httpx.NetworkError: AMBIGUOUS,
    httpx.ConnectError: NOT_SENT,
    httpx.ReadError: AMBIGUOUS,
    httpx.WriteError: AMBIGUOUS,
    httpx.CloseError: AMBIGUOUS,
    httpx.ProxyError: NOT_SENT,
    httpx.UnsupportedProtocol: NOT_SENT,
    httpx.ProtocolError: AMBIGUOUS,
    httpx.LocalProtocolError: AMBIGUOUS,
    httpx.RemoteProtocolError: AMBIGUOUS,
    httpx.DecodingError: AMBIGUOUS,
    httpx.TooManyRedirects: AMBIGUOUS,
    httpx.HTTPStatusError: None,
    httpx.InvalidURL: NOT_SENT,
    httpx.CookieConflict: AMBIGUOUS,
    httpx.StreamError: AMBIGUOUS,
    httpx.StreamConsumed: AMBIGUOUS,
    httpx.StreamClosed: AMBIGUOUS,
    httpx.ResponseNotRead: AMBIGUOUS,
    httpx.RequestNotRead: NOT_SENT,
}

ALL_HTTPX = httpx_exception_classes()


def test_the_walk_finds_httpx_tree() -> None:
    # Guard the walk itself: if it found nothing, the tests below would prove nothing.
    assert set(EXPECTED_EXCEPTIONS) <= set(ALL_HTTPX)
    assert len(ALL_HTTPX) >= 28


@pytest.mark.parametrize("klass", ALL_HTTPX, ids=lambda k: k.__name__)
def test_every_httpx_exception_has_its_own_row(klass: type[BaseException]) -> None:
    """The most specific row for each httpx class is its own, not an ancestor's."""
    assert klass in classify.EXCEPTION_RULES, f"httpx.{klass.__name__} needs a row in the table"
    assert classify.exception_rule(klass) is classify.EXCEPTION_RULES[klass]
    assert klass in EXPECTED_EXCEPTIONS, f"add httpx.{klass.__name__} to EXPECTED_EXCEPTIONS"


@pytest.mark.parametrize("klass", ALL_HTTPX, ids=lambda k: k.__name__)
def test_each_exception_classifies_as_its_row(klass: type[BaseException]) -> None:
    result = classify_exception(make_exception(klass))
    expected = EXPECTED_EXCEPTIONS[klass]
    if expected is None:  # HTTPStatusError: by the response it carries (503 here)
        assert result.outcome is Outcome.RETRYABLE
        assert (result.status_code, result.retry_after) == (503, 7.0)
        return
    assert result.outcome is expected
    assert result.may_have_happened is (expected is AMBIGUOUS)
    assert result.status_code is None and result.retry_after is None
    assert result.error is not None and result.error.startswith(klass.__name__)


@pytest.mark.parametrize("klass", ALL_HTTPX, ids=lambda k: k.__name__)
def test_an_unknown_subclass_falls_back_to_its_parents_row(klass: type[BaseException]) -> None:
    future = type(f"Future{klass.__name__}", (klass,), {})
    assert classify.exception_rule(future) is classify.EXCEPTION_RULES[klass]
    assert (
        classify_exception(make_exception(future)).outcome
        is classify_exception(make_exception(klass)).outcome
    )


@pytest.mark.parametrize("exc", [ValueError("bug"), RuntimeError(), OSError(104, "reset")])
def test_non_httpx_exceptions_are_ambiguous(exc: BaseException) -> None:
    result = classify_exception(exc)
    assert result.outcome is AMBIGUOUS
    assert result.error is not None and result.error.startswith(type(exc).__name__)


def test_http_status_error_with_a_2xx_uses_the_reference_field() -> None:
    request = httpx.Request("POST", "http://provider.test/")
    response = httpx.Response(201, json={"ticket": {"number": 42}}, request=request)
    exc = httpx.HTTPStatusError("odd", request=request, response=response)
    result = classify_exception(exc, reference_field="ticket.number")
    assert (result.outcome, result.provider_ref) == (Outcome.DELIVERED, "42")


# -- statuses ------------------------------------------------------------------

STATUS_CASES = [
    (200, Outcome.DELIVERED, True),
    (201, Outcome.DELIVERED, True),
    (202, Outcome.DELIVERED, True),
    (299, Outcome.DELIVERED, True),
    (400, Outcome.PERMANENT, False),
    (404, Outcome.PERMANENT, False),
    (422, Outcome.PERMANENT, False),
    (409, Outcome.RETRYABLE, True),  # an earlier request with this key is in progress
    (429, Outcome.RETRYABLE, False),
    (503, Outcome.RETRYABLE, False),
    (500, AMBIGUOUS, True),
    (502, AMBIGUOUS, True),
    (504, AMBIGUOUS, True),
    # anything else
    (100, AMBIGUOUS, True),
    (301, AMBIGUOUS, True),
    (302, AMBIGUOUS, True),
    (304, AMBIGUOUS, True),
    (401, AMBIGUOUS, True),
    (403, AMBIGUOUS, True),
    (405, AMBIGUOUS, True),
    (410, AMBIGUOUS, True),
    (418, AMBIGUOUS, True),
    (501, AMBIGUOUS, True),
    (505, AMBIGUOUS, True),
    (599, AMBIGUOUS, True),
]


@pytest.mark.parametrize(("status", "outcome", "may_have_happened"), STATUS_CASES)
def test_status_codes(status: int, outcome: Outcome, may_have_happened: bool) -> None:
    response = httpx.Response(status, json={"id": "T-1", "error": "nope"})
    result = classify_response(response, now=lambda: FIXED_NOW)
    assert result.outcome is outcome
    assert result.status_code == status
    assert result.may_have_happened is may_have_happened
    if outcome is Outcome.DELIVERED:
        assert result.provider_ref == "T-1" and result.error is None
    else:
        assert result.provider_ref is None
        assert result.error is not None and result.error.startswith(f"HTTP {status}")
        assert "nope" in result.error  # a body excerpt says why


def test_every_explicit_status_row_is_covered_by_a_case() -> None:
    covered = {status for status, _, _ in STATUS_CASES}
    assert set(classify.STATUS_RULES) <= covered


@pytest.mark.parametrize(
    ("body", "field", "ref"),
    [
        (b'{"id": 7}', "id", "7"),
        (b'{"data": {"id": "x-1"}}', "data.id", "x-1"),
        (b'{"id": ""}', "id", None),
        (b'{"id": true}', "id", None),
        (b'{"id": null}', "id", None),
        (b'{"other": 1}', "id", None),
        (b"[1, 2]", "id", None),
        (b"not json", "id", None),
        (b"", "id", None),
    ],
)
def test_2xx_reference_extraction(body: bytes, field: str, ref: str | None) -> None:
    result = classify_response(httpx.Response(201, content=body), reference_field=field)
    assert result.provider_ref == ref
    assert result.status_code == 201 and result.may_have_happened
    if ref is None:
        # It happened but cannot be named: a same-key resend or a lookup names it.
        assert result.outcome is Outcome.AMBIGUOUS
        assert result.error is not None and repr(field) in result.error
    else:
        assert result.outcome is Outcome.DELIVERED


def test_2xx_without_a_reference_field_configured() -> None:
    result = classify_response(httpx.Response(204), reference_field=None)
    assert (result.outcome, result.provider_ref, result.error) == (Outcome.DELIVERED, None, None)


def test_errors_are_bounded() -> None:
    result = classify_response(httpx.Response(400, content=b"x" * 100_000))
    assert result.error is not None and len(result.error) <= ERROR_MAX_CHARS
    huge = ValueError("y" * 100_000)
    assert len(classify_exception(huge).error or "") <= ERROR_MAX_CHARS


# -- Retry-After -----------------------------------------------------------------


def http_date(delta: timedelta) -> str:
    return email.utils.format_datetime(FIXED_NOW + delta, usegmt=True)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("7", 7.0),
        ("0", 0.0),
        (" 120 ", 120.0),
        ("1.5", 1.5),
        (http_date(timedelta(seconds=30)), 30.0),
        (http_date(timedelta(hours=2)), 7200.0),
        (http_date(timedelta(seconds=-30)), 0.0),  # in the past: go now
        ("Thu, 01 Jan 2026 12:00:30 -0000", 30.0),  # naive date means UTC
        # The obsolete forms RFC 9110 says a recipient must accept:
        ("Thursday, 01-Jan-26 12:00:30 GMT", 30.0),  # RFC 850
        ("Thu Jan  1 12:00:30 2026", 30.0),  # asctime
        ("Thu, 01 Jan 2026 12:00:30 +0100", 0.0),  # an offset is honoured (an hour ago)
    ],
)
def test_retry_after_values(value: str, seconds: float | None) -> None:
    assert parse_retry_after(value, FIXED_NOW) == seconds


@pytest.mark.parametrize(
    "value", [None, "", "  ", "soon", "-5", "1e3", "NaN", "inf", "5 seconds", "Wed, 99 Foo 2026"]
)
def test_malformed_retry_after_is_none(value: str | None) -> None:
    assert parse_retry_after(value, FIXED_NOW) is None


@given(st.text(max_size=60))
def test_parse_retry_after_never_raises(value: str) -> None:
    result = parse_retry_after(value, FIXED_NOW)
    assert result is None or result >= 0


@pytest.mark.parametrize("status", [429, 503, 409])
@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("3", 3.0),
        (http_date(timedelta(seconds=45)), 45.0),
        ("next tuesday", None),
        (None, None),
    ],
)
def test_retryable_statuses_honour_retry_after(
    status: int, header: str | None, expected: float | None
) -> None:
    headers = {} if header is None else {"Retry-After": header}
    result = classify_response(httpx.Response(status, headers=headers), now=lambda: FIXED_NOW)
    assert result.outcome is Outcome.RETRYABLE
    assert result.retry_after == expected
    if header is not None and expected is None:
        assert result.error is not None and "Retry-After" in result.error


def test_retry_after_is_ignored_on_non_retryable_statuses() -> None:
    result = classify_response(httpx.Response(500, headers={"Retry-After": "5"}))
    assert (result.outcome, result.retry_after) == (AMBIGUOUS, None)


# -- the documented table ----------------------------------------------------------


def test_the_docs_show_the_table_in_code() -> None:
    page = Path(__file__).resolve().parents[2] / "docs" / "adapter-protocol.md"
    assert classify.table_markdown() in page.read_text(encoding="utf-8"), (
        "the classification table in docs/adapter-protocol.md is out of date: "
        "paste classify.table_markdown() into it"
    )
