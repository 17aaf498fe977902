"""HttpAdapter unit tests over respx: what goes on the wire, and how replies are read."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import respx

from adapters import (
    AdapterClosed,
    ConfigError,
    HttpAdapter,
    HttpAdapterConfig,
    LookupStatus,
    Outcome,
    PayloadError,
)
from adapters.helpdesk import helpdesk_config
from tests.adapters.support import (
    FIXED_NOW,
    TICKET,
    httpx_exception_classes,
    make_exception,
    request_for,
)
from tests.adapters.test_classify import EXPECTED_EXCEPTIONS, STATUS_CASES
from tests.support.patience import PATIENCE_S

BASE = "http://provider.test"
URL = f"{BASE}/v1/tickets"


@pytest.fixture
def router() -> Iterator[respx.Router]:
    router = respx.Router(assert_all_called=False)
    yield router


def make(router: respx.Router, *, env: dict[str, str] | None = None, **fields: Any) -> HttpAdapter:
    adapter = HttpAdapter(
        "helpdesk",
        helpdesk_config(BASE, **fields),
        transport=httpx.MockTransport(router.handler),
        env=env or {},
        now=lambda: FIXED_NOW,
    )
    return adapter


@pytest.fixture
def adapter(router: respx.Router) -> Iterator[HttpAdapter]:
    adapter = make(router)
    yield adapter
    adapter.close()


# -- the request ------------------------------------------------------------------


def test_sends_the_effect_key_as_header_and_body_field(router: respx.Router) -> None:
    route = router.post(URL).respond(201, json={"id": "T-1"})
    adapter = make(router, auth_env="HELPDESK_TOKEN", env={"HELPDESK_TOKEN": "s3cret"})
    result = adapter.deliver(request_for("eff-42"))
    assert (result.outcome, result.provider_ref, result.status_code) == (
        Outcome.DELIVERED,
        "T-1",
        201,
    )
    sent = route.calls.last.request
    assert sent.headers["Idempotency-Key"] == "eff-42"
    assert sent.headers["Authorization"] == "Bearer s3cret"
    assert sent.headers["Content-Type"] == "application/json"
    assert json.loads(sent.content) == {**TICKET, "client_reference": "eff-42"}
    adapter.close()


def test_every_attempt_sends_identical_bytes(router: respx.Router, adapter: HttpAdapter) -> None:
    route = router.post(URL).respond(201, json={"id": "T-1"})
    forward = {"subject": "s", "body": "b", "priority": "low", "tags": {"b": 1, "a": 2}}
    backward = dict(reversed(list(forward.items())))
    adapter.deliver(request_for("k", attempt=1, **forward))
    adapter.deliver(request_for("k", attempt=2, **backward))
    first, second = (call.request for call in route.calls)
    assert first.content == second.content
    assert first.headers["Idempotency-Key"] == second.headers["Idempotency-Key"] == "k"


def test_extra_headers_method_and_switched_off_fields(router: respx.Router) -> None:
    route = router.put(URL).respond(200, json={"ref": "R"})
    adapter = make(
        router,
        method="PUT",
        headers={"X-Team": "blue"},
        idempotency_header="X-Request-Key",
        client_reference_field=None,
        reference_field="ref",
    )
    result = adapter.deliver(request_for("k1"))
    assert result.provider_ref == "R"
    sent = route.calls.last.request
    assert sent.headers["X-Team"] == "blue"
    assert sent.headers["X-Request-Key"] == "k1"
    assert "Idempotency-Key" not in sent.headers
    assert json.loads(sent.content) == TICKET
    adapter.close()


def test_a_matching_client_reference_in_the_payload_is_accepted(
    router: respx.Router, adapter: HttpAdapter
) -> None:
    router.post(URL).respond(201, json={"id": "T"})
    result = adapter.deliver(request_for("k", client_reference="k", subject="s"))
    assert result.outcome is Outcome.DELIVERED


@pytest.mark.parametrize(
    "payload",
    [
        {"subject": object()},
        {"subject": float("nan")},
        {"tags": {1, 2}},
        {"client_reference": "someone-else"},
    ],
    ids=["object", "nan", "set", "reserved-field"],
)
def test_a_bad_payload_raises_before_anything_is_sent(
    router: respx.Router, adapter: HttpAdapter, payload: dict[str, Any]
) -> None:
    route = router.post(URL).respond(201, json={"id": "T"})
    with pytest.raises(PayloadError) as info:
        adapter.deliver(request_for("k", **payload))
    assert (info.value.adapter, info.value.effect_key) == ("helpdesk", "k")
    assert route.call_count == 0


@pytest.mark.parametrize("key", ["", "ключ", "line\nbreak"])
def test_a_key_that_cannot_be_sent_raises_payload_error(
    router: respx.Router, adapter: HttpAdapter, key: str
) -> None:
    route = router.post(URL).respond(201, json={"id": "T"})
    with pytest.raises(PayloadError):
        adapter.deliver(request_for(key))
    assert route.call_count == 0


def test_a_payload_that_is_not_a_mapping_raises(router: respx.Router, adapter: HttpAdapter) -> None:
    bad = request_for("k")
    object.__setattr__(bad, "payload", ["not", "an", "object"])
    with pytest.raises(PayloadError):
        adapter.deliver(bad)


# -- statuses and exceptions through the adapter ---------------------------------------


@pytest.mark.parametrize(("status", "outcome", "may_have_happened"), STATUS_CASES)
def test_each_status_through_the_adapter(
    router: respx.Router,
    adapter: HttpAdapter,
    status: int,
    outcome: Outcome,
    may_have_happened: bool,
) -> None:
    router.post(URL).respond(status, json={"id": "T-9"}, headers={"Retry-After": "4"})
    result = adapter.deliver(request_for())
    assert (result.outcome, result.status_code) == (outcome, status)
    assert result.may_have_happened is may_have_happened
    assert result.retry_after == (4.0 if outcome is Outcome.RETRYABLE else None)


@pytest.mark.parametrize("klass", httpx_exception_classes(), ids=lambda k: k.__name__)
def test_each_httpx_exception_through_the_adapter(
    router: respx.Router, adapter: HttpAdapter, klass: type[BaseException]
) -> None:
    def boom(request: httpx.Request) -> httpx.Response:
        raise make_exception(klass)

    router.post(URL).mock(side_effect=boom)
    result = adapter.deliver(request_for())  # never raises
    expected = EXPECTED_EXCEPTIONS[klass]
    assert result.outcome is (Outcome.RETRYABLE if expected is None else expected)


def test_a_non_httpx_exception_during_the_send_is_ambiguous(
    router: respx.Router, adapter: HttpAdapter
) -> None:
    router.post(URL).mock(side_effect=RuntimeError("transport bug"))
    result = adapter.deliver(request_for())
    assert result.outcome is Outcome.AMBIGUOUS
    assert result.error == "RuntimeError: transport bug"


def test_sequenced_replies(router: respx.Router, adapter: HttpAdapter) -> None:
    router.post(URL).mock(
        side_effect=[
            httpx.ConnectError("refused"),
            httpx.Response(503, headers={"Retry-After": "2"}),
            httpx.Response(201, json={"id": "T-3"}),
        ]
    )
    outcomes = [adapter.deliver(request_for(attempt=n)) for n in (1, 2, 3)]
    assert [r.outcome for r in outcomes] == [Outcome.NOT_SENT, Outcome.RETRYABLE, Outcome.DELIVERED]
    assert outcomes[1].retry_after == 2.0
    assert outcomes[2].provider_ref == "T-3"


class BrokenStream(httpx.SyncByteStream):
    def __init__(self, first: bytes, exc: Exception) -> None:
        self.first, self.exc = first, exc

    def __iter__(self) -> Iterator[bytes]:
        yield self.first
        raise self.exc


def test_a_body_that_breaks_after_a_2xx_status_keeps_the_status(
    router: respx.Router, adapter: HttpAdapter
) -> None:
    stream = BrokenStream(b'{"id": "T-', httpx.ReadError("connection reset"))
    router.post(URL).mock(return_value=httpx.Response(201, stream=stream))
    result = adapter.deliver(request_for())
    # The provider said 201: it did it, but the reference is lost. The status is kept.
    assert (result.outcome, result.provider_ref, result.status_code) == (
        Outcome.AMBIGUOUS,
        None,
        201,
    )
    assert result.error is not None and "ReadError" in result.error


def test_a_body_that_breaks_after_a_503_is_still_retryable(
    router: respx.Router, adapter: HttpAdapter
) -> None:
    stream = BrokenStream(b"busy", httpx.ReadError("reset"))
    router.post(URL).mock(
        return_value=httpx.Response(503, headers={"Retry-After": "9"}, stream=stream)
    )
    result = adapter.deliver(request_for())
    assert (result.outcome, result.retry_after) == (Outcome.RETRYABLE, 9.0)


def test_an_oversized_reply_is_abandoned(router: respx.Router, adapter: HttpAdapter) -> None:
    router.post(URL).respond(201, content=b"x" * (2 * 1024 * 1024))
    result = adapter.deliver(request_for())
    assert (result.outcome, result.status_code) == (Outcome.AMBIGUOUS, 201)
    assert result.error is not None and "larger than" in result.error


def test_waiting_for_a_free_connection_is_bounded_and_not_sent(router: respx.Router) -> None:
    entered, release = threading.Event(), threading.Event()

    def slow(request: httpx.Request) -> httpx.Response:
        entered.set()
        release.wait(5)
        return httpx.Response(201, json={"id": "T"})

    route = router.post(URL).mock(side_effect=slow)
    adapter = make(router, max_connections=1, connect_timeout=0.05)
    first = threading.Thread(target=adapter.deliver, args=(request_for("a"),))
    first.start()
    assert entered.wait(PATIENCE_S)
    result = adapter.deliver(request_for("b"))
    release.set()
    first.join()
    assert result.outcome is Outcome.NOT_SENT
    assert result.error is not None and result.error.startswith("PoolTimeout")
    assert route.call_count == 1
    assert adapter.deliver(request_for("c")).outcome is Outcome.DELIVERED  # the slot came back
    adapter.close()


def test_redirects_are_not_followed(router: respx.Router, adapter: HttpAdapter) -> None:
    router.post(URL).respond(307, headers={"Location": f"{BASE}/elsewhere"})
    result = adapter.deliver(request_for())
    assert (result.outcome, result.status_code) == (Outcome.AMBIGUOUS, 307)


def test_cookies_from_replies_are_not_sent_back(router: respx.Router, adapter: HttpAdapter) -> None:
    route = router.post(URL).respond(
        201, json={"id": "T"}, headers={"Set-Cookie": "session=tenant-a; Path=/"}
    )
    adapter.deliver(request_for("a"))
    adapter.deliver(request_for("b"))
    assert "cookie" not in route.calls.last.request.headers


def test_concurrent_deliveries_share_one_client(router: respx.Router) -> None:
    lock = threading.Lock()
    seen: list[str] = []

    def record(request: httpx.Request) -> httpx.Response:
        with lock:
            seen.append(request.headers["Idempotency-Key"])
        return httpx.Response(201, json={"id": f"T-{request.headers['Idempotency-Key']}"})

    router.post(URL).mock(side_effect=record)
    adapter = make(router, max_connections=4)
    results: dict[str, str | None] = {}

    def worker(n: int) -> None:
        for i in range(20):
            key = f"k-{n}-{i}"
            results[key] = adapter.deliver(request_for(key)).provider_ref

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    adapter.close()
    assert len(seen) == 160
    assert all(ref == f"T-{key}" for key, ref in results.items())


# -- lookup -------------------------------------------------------------------------

LOOKUP = f"{URL}?client_reference=eff-1"


@pytest.mark.parametrize(
    ("reply", "status", "ref"),
    [
        (httpx.Response(200, json={"tickets": [{"id": "T-1", "client_reference": "eff-1"}]}),
         LookupStatus.FOUND, "T-1"),
        (httpx.Response(200, json={"tickets": [{"id": 5}]}), LookupStatus.FOUND, "5"),
        (httpx.Response(200, json={"tickets": []}), LookupStatus.NOT_FOUND, None),
        # a provider that ignored the filter: items for other keys prove nothing
        (httpx.Response(200, json={"tickets": [{"id": "T-2", "client_reference": "other"}]}),
         LookupStatus.INCONCLUSIVE, None),
        (httpx.Response(200, json={"tickets": "nope"}), LookupStatus.INCONCLUSIVE, None),
        (httpx.Response(200, json={"tickets": [{"no_id": 1}]}), LookupStatus.INCONCLUSIVE, None),
        (httpx.Response(200, content=b"<html>"), LookupStatus.INCONCLUSIVE, None),
        (httpx.Response(200, json={"id": "T-7", "client_reference": "eff-1"}),
         LookupStatus.FOUND, "T-7"),
        (httpx.Response(404), LookupStatus.INCONCLUSIVE, None),  # a list URL that is missing
        (httpx.Response(501), LookupStatus.INCONCLUSIVE, None),
        (httpx.Response(500), LookupStatus.INCONCLUSIVE, None),
        (httpx.Response(503), LookupStatus.INCONCLUSIVE, None),
        (httpx.Response(429), LookupStatus.INCONCLUSIVE, None),
    ],
)  # fmt: skip
def test_lookup_replies(
    router: respx.Router,
    adapter: HttpAdapter,
    reply: httpx.Response,
    status: LookupStatus,
    ref: str | None,
) -> None:
    router.get(LOOKUP).mock(return_value=reply)
    result = adapter.lookup("eff-1", None)
    assert (result.status, result.provider_ref) == (status, ref)
    if status is LookupStatus.INCONCLUSIVE:
        assert result.error


@pytest.mark.parametrize("klass", httpx_exception_classes(), ids=lambda k: k.__name__)
def test_lookup_never_raises_for_httpx_exceptions(
    router: respx.Router, adapter: HttpAdapter, klass: type[BaseException]
) -> None:
    def boom(request: httpx.Request) -> httpx.Response:
        raise make_exception(klass)

    router.get(LOOKUP).mock(side_effect=boom)
    assert adapter.lookup("eff-1", None).status is LookupStatus.INCONCLUSIVE


def test_lookup_escapes_the_key(router: respx.Router, adapter: HttpAdapter) -> None:
    route = router.get(URL).respond(200, json={"tickets": []})
    adapter.lookup("a/b c&d=e", None)
    assert route.calls.last.request.url.params["client_reference"] == "a/b c&d=e"


def test_lookup_by_reference(router: respx.Router) -> None:
    adapter = make(router, lookup_url=f"{URL}/{{reference}}")
    router.get(f"{URL}/T-1").respond(200, json={"id": "T-1", "client_reference": "eff-1"})
    router.get(f"{URL}/T-2").respond(404)
    router.get(f"{URL}/T-3").respond(200, json={"id": "T-3", "client_reference": "other"})
    assert adapter.lookup("eff-1", "T-1").provider_ref == "T-1"
    assert adapter.lookup("eff-1", "T-2").status is LookupStatus.NOT_FOUND  # by id: authoritative
    assert adapter.lookup("eff-1", "T-3").status is LookupStatus.INCONCLUSIVE
    assert adapter.lookup("eff-1", None).status is LookupStatus.INCONCLUSIVE  # nothing to look up
    adapter.close()


def test_lookup_without_a_lookup_url_is_inconclusive(router: respx.Router) -> None:
    adapter = make(router, lookup_url=None, capabilities=HttpAdapterConfig("http://x").capabilities)
    assert adapter.lookup("k", None).status is LookupStatus.INCONCLUSIVE
    adapter.close()


# -- lifecycle and configuration --------------------------------------------------------


def test_close_is_idempotent_and_use_after_close_raises(router: respx.Router) -> None:
    route = router.post(URL).respond(201, json={"id": "T"})
    adapter = make(router)
    adapter.close()
    adapter.close()
    with pytest.raises(AdapterClosed):
        adapter.deliver(request_for())
    with pytest.raises(AdapterClosed):
        adapter.lookup("k", None)
    assert route.call_count == 0


def test_an_injected_client_is_not_closed_by_the_adapter(router: respx.Router) -> None:
    router.post(URL).respond(201, json={"id": "T"})
    client = httpx.Client(transport=httpx.MockTransport(router.handler))
    adapter = HttpAdapter("h", helpdesk_config(BASE), client=client)
    assert adapter.deliver(request_for()).outcome is Outcome.DELIVERED
    adapter.close()
    assert not client.is_closed
    client.close()
    with pytest.raises(ValueError, match="not both"):
        HttpAdapter(
            "h", helpdesk_config(BASE), client=client, transport=httpx.MockTransport(router.handler)
        )


def test_the_token_is_read_at_construction_and_never_shown() -> None:
    with pytest.raises(ConfigError) as info:
        HttpAdapter("crm", HttpAdapterConfig(url=URL, auth_env="CRM_TOKEN"), env={})
    assert "CRM_TOKEN" in str(info.value)
    assert (info.value.adapter, info.value.field) == ("crm", "auth_env")
    adapter = HttpAdapter(
        "crm", HttpAdapterConfig(url=URL, auth_env="CRM_TOKEN"), env={"CRM_TOKEN": "s3cret"}
    )
    assert "s3cret" not in repr(adapter)
    adapter.close()


def cfg(**fields: Any) -> Callable[[], HttpAdapterConfig]:
    return lambda: HttpAdapterConfig(**{"url": URL, **fields})


@pytest.mark.parametrize(
    ("fields", "field", "hint"),
    [
        ({"url": "ftp://provider.test/x"}, "url", "http:// or https://"),
        ({"url": "provider.test/x"}, "url", "http:// or https://"),
        ({"url": "http:///x"}, "url", "no host"),
        ({"url": "http://user:pw@provider.test/"}, "url", "auth_env"),
        ({"method": "GET"}, "method", "POST"),
        ({"connect_timeout": 0}, "connect_timeout", "> 0"),
        ({"read_timeout": -1.0}, "read_timeout", "> 0"),
        ({"total_timeout": float("inf")}, "total_timeout", "> 0"),
        ({"total_timeout": True}, "total_timeout", "number"),
        ({"max_connections": 0}, "max_connections", "at least 1"),
        ({"headers": {"Idempotency-Key": "x"}}, "headers", "remove it"),
        ({"headers": {"bad name": "x"}}, "headers", "header name"),
        ({"headers": {"X-A": "line\nbreak"}}, "headers", "printable"),
        ({"idempotency_header": "bad header"}, "idempotency_header", "header name"),
        ({"lookup_url": f"{URL}?q={{key}}"}, "lookup_url", "{effect_key}"),
        ({"lookup_url": f"{URL}?q=fixed"}, "lookup_url", "{effect_key}"),
        ({"lookup_url": "ftp://x/{effect_key}"}, "lookup_url", "http://"),
        ({"reference_field": ""}, "reference_field", "non-empty"),
        (
            {"capabilities": helpdesk_config().capabilities, "lookup_url": None},
            "supports_lookup",
            "lookup_url",
        ),
    ],
)
def test_bad_config_names_adapter_field_and_fix(
    fields: dict[str, Any], field: str, hint: str
) -> None:
    with pytest.raises(ConfigError) as info:
        HttpAdapter("crm", cfg(**fields)(), env={})
    assert (info.value.adapter, info.value.field) == ("crm", field)
    message = str(info.value)
    assert f"crm.{field}" in message and hint in message
