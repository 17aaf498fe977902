"""The value types, the registry, the exported API and the shipped fakes."""

from __future__ import annotations

import threading

import pytest

import adapters
from adapters import (
    Adapter,
    AdapterClosed,
    AdapterError,
    Capabilities,
    ConfigError,
    DeliveryResult,
    LookupResult,
    LookupStatus,
    Outcome,
    PayloadError,
    Registry,
    UnknownAdapter,
)
from adapters.protocol import ERROR_MAX_CHARS
from adapters.testing import FakeAdapter, NoopAdapter
from tests.adapters.support import request_for


def test_exported_members() -> None:
    assert sorted(adapters.__all__) == sorted(
        [
            "ADAPTERS_ENV",
            "Adapter",
            "AdapterClosed",
            "AdapterError",
            "Capabilities",
            "ConfigError",
            "DeliveryRequest",
            "DeliveryResult",
            "HttpAdapter",
            "HttpAdapterConfig",
            "PRESETS",
            "Preset",
            "PreparedRequest",
            "LookupResult",
            "LookupStatus",
            "Outcome",
            "PayloadError",
            "Registry",
            "SignatureError",
            "UnknownAdapter",
            "WebhookConfig",
            "WebhookEvent",
            "build_adapter",
            "classify_exception",
            "classify_response",
            "load_registry",
            "parse_retry_after",
            "read_document",
        ]
    )
    for name in adapters.__all__:
        assert getattr(adapters, name) is not None


def test_values_are_the_same_strings_everywhere() -> None:
    assert [o.value for o in Outcome] == [
        "delivered",
        "not_sent",
        "retryable",
        "permanent",
        "ambiguous",
    ]
    assert [s.value for s in LookupStatus] == ["found", "not_found", "inconclusive"]


@pytest.mark.parametrize(
    ("result", "outcome", "may_have_happened"),
    [
        (DeliveryResult.delivered("T-1", status_code=201), Outcome.DELIVERED, True),
        (DeliveryResult.not_sent("ConnectError"), Outcome.NOT_SENT, False),
        (DeliveryResult.retryable(3.0, status_code=429), Outcome.RETRYABLE, False),
        (DeliveryResult.retryable(None, status_code=503), Outcome.RETRYABLE, False),
        (DeliveryResult.retryable(None, status_code=409), Outcome.RETRYABLE, True),
        (DeliveryResult.retryable(None), Outcome.RETRYABLE, False),
        (DeliveryResult.permanent("HTTP 422", status_code=422), Outcome.PERMANENT, False),
        (DeliveryResult.ambiguous("ReadTimeout"), Outcome.AMBIGUOUS, True),
    ],
)
def test_named_constructors_and_may_have_happened(
    result: DeliveryResult, outcome: Outcome, may_have_happened: bool
) -> None:
    assert result.outcome is outcome
    assert result.may_have_happened is may_have_happened


def test_result_invariants() -> None:
    with pytest.raises(ValueError, match="only meaningful for RETRYABLE"):
        DeliveryResult(Outcome.AMBIGUOUS, retry_after=1.0)
    with pytest.raises(ValueError, match=">= 0"):
        DeliveryResult.retryable(-1.0)
    with pytest.raises(ValueError, match=">= 0"):
        DeliveryResult.retryable(float("inf"))
    with pytest.raises(ValueError, match="provider_ref"):
        LookupResult(LookupStatus.FOUND)
    with pytest.raises(ValueError, match="lookup_settle_seconds"):
        Capabilities(True, True, lookup_settle_seconds=-1)
    assert DeliveryResult("delivered", "x").outcome is Outcome.DELIVERED  # type: ignore[arg-type]
    long = DeliveryResult.ambiguous("z" * 10_000).error
    assert long is not None and len(long) == ERROR_MAX_CHARS and long.endswith("…")


def test_lookup_constructors() -> None:
    assert LookupResult.found("T").provider_ref == "T"
    assert LookupResult.not_found().status is LookupStatus.NOT_FOUND
    assert LookupResult.inconclusive("501").error == "501"


def test_error_tree() -> None:
    for klass in (PayloadError, ConfigError, UnknownAdapter, AdapterClosed):
        assert issubclass(klass, AdapterError)
    assert issubclass(UnknownAdapter, KeyError)
    assert str(AdapterError()) == "Unexpected adapter error."


def test_registry() -> None:
    one, two = FakeAdapter("one"), FakeAdapter("two")
    registry = Registry([two, one])
    assert registry.names() == ("one", "two")
    assert "one" in registry and "three" not in registry
    assert registry.get("two") is two
    assert len(registry) == 2 and set(registry) == {one, two}
    with pytest.raises(UnknownAdapter) as info:
        registry.get("three")
    assert str(info.value) == "no adapter named 'three'; known adapters: 'one', 'two'"
    assert info.value.known == ("one", "two")
    with pytest.raises(KeyError):  # callers may treat it as a lookup miss
        registry.get("three")
    with pytest.raises(ConfigError, match="twice"):
        registry.register(FakeAdapter("one"))
    with pytest.raises(TypeError):
        registry.register(object())  # type: ignore[arg-type]
    registry.close()
    assert one.closed and two.closed


def test_registry_close_closes_all_even_if_one_fails() -> None:
    class Broken(FakeAdapter):
        def close(self) -> None:
            raise RuntimeError("stuck")

    broken, fine = Broken("a"), FakeAdapter("b")
    with pytest.raises(RuntimeError, match="stuck"), Registry([broken, fine]):
        pass
    assert fine.closed


# -- the shipped fakes -------------------------------------------------------------------


def test_fake_adapter_follows_its_script_then_delivers() -> None:
    fake = FakeAdapter(
        script=[
            DeliveryResult.not_sent("ConnectError"),
            lambda request: DeliveryResult.retryable(1.0, error=f"try {request.attempt}"),
            PayloadError("bad"),
        ]
    )
    assert isinstance(fake, Adapter)
    assert fake.deliver(request_for("k", attempt=1)).outcome is Outcome.NOT_SENT
    assert fake.deliver(request_for("k", attempt=2)).error == "try 2"
    with pytest.raises(PayloadError):
        fake.deliver(request_for("k", attempt=3))
    result = fake.deliver(request_for("k", attempt=4))
    assert (result.outcome, result.provider_ref) == (Outcome.DELIVERED, "fake-k")
    assert [call.attempt for call in fake.calls] == [1, 2, 3, 4]


def test_fake_adapter_remembers_scripted_deliveries() -> None:
    fake = FakeAdapter(script=[DeliveryResult.delivered("T-77")])
    fake.deliver(request_for("k"))
    assert fake.deliver(request_for("k")).provider_ref == "T-77"  # a replay
    assert fake.lookup("k", None) == LookupResult.found("T-77")
    assert fake.lookup("other", None) == LookupResult.not_found()
    fake.push_lookup(LookupResult.inconclusive("down"), TimeoutError("boom"))
    assert fake.lookup("k", None).status is LookupStatus.INCONCLUSIVE
    with pytest.raises(TimeoutError):
        fake.lookup("k", None)
    assert fake.lookups == [("k", None), ("other", None), ("k", None), ("k", None)]


def test_fake_adapter_is_thread_safe() -> None:
    fake = FakeAdapter()
    fake.push(*[DeliveryResult.not_sent("x")] * 50)

    def worker(n: int) -> None:
        for i in range(50):
            fake.deliver(request_for(f"k-{n}-{i}"))

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(fake.calls) == 400
    assert len(fake.delivered) == 350  # exactly the 50 scripted failures were consumed once


def test_noop_adapter() -> None:
    noop = NoopAdapter()
    assert isinstance(noop, Adapter)
    result = noop.deliver(request_for("k"))
    assert (result.outcome, result.provider_ref) == (Outcome.DELIVERED, "noop-k")
    assert noop.lookup("k", None).provider_ref == "noop-k"
    noop.close()
