"""One contract, two adapters: FakeAdapter, and HttpAdapter against a provider on respx.

Both are driven through the same ``Harness``: it makes the next delivery fail
in a named way, and tells how many effects the provider really holds per key,
so each test states the protocol once and both adapters must keep it.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import httpx
import pytest
import respx

from adapters import (
    Adapter,
    AdapterClosed,
    Capabilities,
    DeliveryResult,
    HttpAdapter,
    LookupResult,
    LookupStatus,
    Outcome,
    PayloadError,
)
from adapters.helpdesk import helpdesk_config
from adapters.testing import FakeAdapter
from tests.adapters.support import request_for

FAULTS = (
    "connect_error",
    "rate_limited",
    "rejected",
    "in_progress",
    "timeout_after_commit",
    "error_after_commit",
)


class Harness(Protocol):
    adapter: Adapter

    def fail_next(self, fault: str) -> None: ...
    def fail_next_lookup(self) -> None: ...
    def effects(self, key: str) -> int: ...


class FakeHarness:
    def __init__(self) -> None:
        self.fake = FakeAdapter()
        self.adapter: Adapter = self.fake

    def fail_next(self, fault: str) -> None:
        def commit_then(result: DeliveryResult) -> Callable[[Any], DeliveryResult]:
            def step(request: Any) -> DeliveryResult:
                self.fake.delivered.setdefault(request.effect_key, f"fake-{request.effect_key}")
                return result

            return step

        steps: dict[str, Any] = {
            "connect_error": DeliveryResult.not_sent("ConnectError: refused"),
            "rate_limited": DeliveryResult.retryable(2.0, status_code=429, error="HTTP 429"),
            "rejected": DeliveryResult.permanent("HTTP 400: bad", status_code=400),
            "in_progress": DeliveryResult.retryable(None, status_code=409, error="HTTP 409"),
            "timeout_after_commit": commit_then(DeliveryResult.ambiguous("ReadTimeout")),
            "error_after_commit": commit_then(
                DeliveryResult.ambiguous("HTTP 500", status_code=500)
            ),
        }
        self.fake.push(steps[fault])

    def fail_next_lookup(self) -> None:
        self.fake.push_lookup(LookupResult.inconclusive("HTTP 503"))

    def effects(self, key: str) -> int:
        return 1 if key in self.fake.delivered else 0


class RespxProvider:
    """A tiny helpdesk that honours keys, mounted on a respx router."""

    BASE = "http://provider.test"

    def __init__(self) -> None:
        self.tickets: dict[str, dict[str, Any]] = {}
        self.faults: deque[str] = deque()
        self.lookup_faults = 0
        self.lock = threading.Lock()
        self.router = respx.Router()
        self.router.post(f"{self.BASE}/v1/tickets").mock(side_effect=self.create)
        self.router.get(f"{self.BASE}/v1/tickets").mock(side_effect=self.lookup)

    def _commit(self, key: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.tickets.setdefault(key, {"id": f"T-{len(self.tickets) + 1}", **body})

    def create(self, request: httpx.Request) -> httpx.Response:
        key = request.headers["Idempotency-Key"]
        body = json.loads(request.content)
        with self.lock:
            fault = self.faults.popleft() if self.faults else None
            if fault == "connect_error":
                raise httpx.ConnectError("refused", request=request)
            if fault == "rate_limited":
                return httpx.Response(429, headers={"Retry-After": "2"})
            if fault == "rejected":
                return httpx.Response(400, json={"error": "bad"})
            if fault == "in_progress":
                return httpx.Response(409, json={"error": "in progress"})
            ticket = self._commit(key, body)
        if fault == "timeout_after_commit":
            raise httpx.ReadTimeout("timed out", request=request)
        if fault == "error_after_commit":
            return httpx.Response(500, json={"error": "oops"})
        return httpx.Response(201, json=ticket)

    def lookup(self, request: httpx.Request) -> httpx.Response:
        with self.lock:
            if self.lookup_faults:
                self.lookup_faults -= 1
                return httpx.Response(503)
            key = request.url.params["client_reference"]
            found = [self.tickets[key]] if key in self.tickets else []
        return httpx.Response(200, json={"tickets": found})


class HttpHarness:
    def __init__(self) -> None:
        self.provider = RespxProvider()
        self.adapter: Adapter = HttpAdapter(
            "helpdesk",
            helpdesk_config(RespxProvider.BASE),
            transport=httpx.MockTransport(self.provider.router.handler),
        )

    def fail_next(self, fault: str) -> None:
        self.provider.faults.append(fault)

    def fail_next_lookup(self) -> None:
        self.provider.lookup_faults += 1

    def effects(self, key: str) -> int:
        return 1 if key in self.provider.tickets else 0


@pytest.fixture(params=["fake", "http"])
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    made: Harness = FakeHarness() if request.param == "fake" else HttpHarness()
    yield made
    made.adapter.close()


def test_it_is_an_adapter(harness: Harness) -> None:
    adapter = harness.adapter
    assert isinstance(adapter, Adapter)
    assert isinstance(adapter.name, str) and adapter.name
    assert isinstance(adapter.capabilities, Capabilities)
    assert adapter.capabilities.honours_idempotency_keys
    assert adapter.capabilities.supports_lookup


def test_delivers_and_names_the_effect(harness: Harness) -> None:
    result = harness.adapter.deliver(request_for("k1"))
    assert result.outcome is Outcome.DELIVERED
    assert isinstance(result.provider_ref, str) and result.provider_ref
    assert result.may_have_happened
    assert harness.effects("k1") == 1


def test_a_resend_with_the_same_key_is_the_same_effect(harness: Harness) -> None:
    first = harness.adapter.deliver(request_for("k1", attempt=1))
    second = harness.adapter.deliver(request_for("k1", attempt=2))
    assert first.provider_ref == second.provider_ref
    assert harness.effects("k1") == 1


def test_lookup_finds_a_delivered_effect_and_not_an_unknown_one(harness: Harness) -> None:
    ref = harness.adapter.deliver(request_for("k1")).provider_ref
    assert ref is not None
    assert harness.adapter.lookup("k1", ref) == LookupResult.found(ref)
    assert harness.adapter.lookup("never-sent", None) == LookupResult.not_found()


@pytest.mark.parametrize(
    ("fault", "outcome", "may_have_happened", "effects"),
    [
        ("connect_error", Outcome.NOT_SENT, False, 0),
        ("rate_limited", Outcome.RETRYABLE, False, 0),
        ("rejected", Outcome.PERMANENT, False, 0),
        ("in_progress", Outcome.RETRYABLE, True, 0),
        ("timeout_after_commit", Outcome.AMBIGUOUS, True, 1),
        ("error_after_commit", Outcome.AMBIGUOUS, True, 1),
    ],
)
def test_failures_are_classified_never_raised(
    harness: Harness, fault: str, outcome: Outcome, may_have_happened: bool, effects: int
) -> None:
    harness.fail_next(fault)
    result = harness.adapter.deliver(request_for("k1"))
    assert result.outcome is outcome
    assert result.may_have_happened is may_have_happened
    assert result.error
    assert harness.effects("k1") == effects
    if fault == "rate_limited":
        assert result.retry_after == 2.0
    # Whatever happened, a resend with the same key ends in exactly one effect.
    again = harness.adapter.deliver(request_for("k1", attempt=2))
    assert again.outcome is Outcome.DELIVERED
    assert harness.effects("k1") == 1
    assert harness.adapter.lookup("k1", None) == LookupResult.found(again.provider_ref or "")


def test_an_ambiguous_send_is_settled_by_lookup(harness: Harness) -> None:
    harness.fail_next("timeout_after_commit")
    assert harness.adapter.deliver(request_for("k1")).outcome is Outcome.AMBIGUOUS
    assert harness.adapter.lookup("k1", None).status is LookupStatus.FOUND


def test_a_failed_lookup_is_inconclusive_not_raised(harness: Harness) -> None:
    harness.fail_next_lookup()
    result = harness.adapter.lookup("k1", None)
    assert result.status is LookupStatus.INCONCLUSIVE and result.error


def test_a_bad_payload_raises_before_sending(harness: Harness) -> None:
    with pytest.raises(PayloadError):
        harness.adapter.deliver(request_for("k1", subject=object()))
    assert harness.effects("k1") == 0


def test_close_twice_then_use_raises(harness: Harness) -> None:
    harness.adapter.close()
    harness.adapter.close()
    with pytest.raises(AdapterClosed):
        harness.adapter.deliver(request_for("k1"))
    assert harness.effects("k1") == 0


def test_many_threads_at_once(harness: Harness) -> None:
    refs: dict[str, set[str | None]] = {}
    lock = threading.Lock()

    def worker(n: int) -> None:
        for i in range(20):
            key = f"k-{i}"  # every thread sends the same 20 keys
            ref = harness.adapter.deliver(request_for(key, attempt=n + 1)).provider_ref
            with lock:
                refs.setdefault(key, set()).add(ref)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(len(seen) == 1 and None not in seen for seen in refs.values())
    assert all(harness.effects(f"k-{i}") == 1 for i in range(20))
