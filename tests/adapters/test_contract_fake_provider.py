"""HttpAdapter (the helpdesk preset) against the real fake provider over loopback HTTP.

Each row of the classification table that the provider can produce is met
here on a real socket: replays, 409 while in progress, 422 for a reused key,
429/503 with both Retry-After forms, faults before and after the commit, a
dropped connection, a held reply, lookups (with lag, and switched off).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from adapters import HttpAdapter, LookupResult, LookupStatus, Outcome, load_registry
from adapters.helpdesk import helpdesk_adapter
from fake_provider import DropMode, FaultSpec, Mode, ProviderConfig, RetryAfterFormat, create_app
from fake_provider import Outcome as Fault
from tests.adapters.support import TICKET, request_for
from tests.support.patience import PATIENCE_S
from tests.support.servers import serve_in_thread


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


class Provider:
    def __init__(self, app: Any, base_url: str) -> None:
        self.app = app
        self.base_url = base_url

    def script(self, *faults: Fault, latency_ms: int = 0) -> None:
        spec = FaultSpec(script=faults, latency_min_ms=latency_ms, latency_max_ms=latency_ms)
        self.app.state.faults.replace(spec)

    def effects(self, key: str) -> int:
        tickets = httpx.get(f"{self.base_url}/_admin/effects").json()["effects"]
        return sum(1 for ticket in tickets if ticket.get("client_reference") == key)


Serve = Callable[..., Provider]


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def serve(clock: Clock) -> Iterator[Serve]:
    with_stack: list[Any] = []

    def start(**fields: Any) -> Provider:
        app = create_app(ProviderConfig(**{"seed": 0, **fields}), clock=clock)
        context = serve_in_thread(app)
        base_url = context.__enter__()
        with_stack.append((app, context))
        return Provider(app, base_url)

    yield start
    for app, context in reversed(with_stack):
        context.__exit__(None, None, None)
        app.state.ledger.close()


@pytest.fixture
def provider(serve: Serve) -> Provider:
    return serve()


def adapter_for(provider: Provider, clock: Clock | None = None, **fields: Any) -> HttpAdapter:
    adapter = helpdesk_adapter(provider.base_url, env={}, **fields)
    if clock is not None:
        adapter._now = clock
    return adapter


@pytest.fixture
def adapter(provider: Provider, clock: Clock) -> Iterator[HttpAdapter]:
    made = adapter_for(provider, clock)
    yield made
    made.close()


def test_delivers_replays_and_looks_up(provider: Provider, adapter: HttpAdapter) -> None:
    first = adapter.deliver(request_for("eff-1"))
    assert (first.outcome, first.status_code) == (Outcome.DELIVERED, 201)
    assert first.provider_ref
    second = adapter.deliver(request_for("eff-1", attempt=2))
    assert second.provider_ref == first.provider_ref  # a replay, not a second ticket
    assert provider.effects("eff-1") == 1
    assert adapter.lookup("eff-1", first.provider_ref) == LookupResult.found(first.provider_ref)
    assert adapter.lookup("eff-never", None) == LookupResult.not_found()


def test_same_key_other_body_is_permanent(provider: Provider, adapter: HttpAdapter) -> None:
    adapter.deliver(request_for("eff-1"))
    changed: dict[str, Any] = {**TICKET, "priority": "low"}
    result = adapter.deliver(request_for("eff-1", **changed))
    # 422 at an honouring provider: this request did nothing. (The effect with
    # this key did happen once: the adapter sends canonical bytes so that a
    # resend of an unchanged payload can never land here.)
    assert (result.outcome, result.status_code) == (Outcome.PERMANENT, 422)
    assert result.error is not None and "idempotency_key_reused" in result.error
    assert provider.effects("eff-1") == 1


def test_in_progress_is_retryable_and_may_have_happened(
    provider: Provider, adapter: HttpAdapter
) -> None:
    # The first request holds its key for 5 s: long enough on a busy machine for the
    # second to arrive while it does (only the wait below is a sleep).
    provider.script(Fault.OK, latency_ms=5000)
    results: list[Any] = []
    first = threading.Thread(target=lambda: results.append(adapter.deliver(request_for("k"))))
    first.start()
    deadline = time.monotonic() + PATIENCE_S
    while provider.app.state.faults.counts().get("ok", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    provider.script()  # the second request has no latency
    time.sleep(0.1)  # let the first request claim its key
    second = adapter.deliver(request_for("k", attempt=2))
    first.join()
    assert (second.outcome, second.status_code) == (Outcome.RETRYABLE, 409)
    assert second.may_have_happened
    assert results[0].outcome is Outcome.DELIVERED
    assert provider.effects("k") == 1


@pytest.mark.parametrize("fault", [Fault.RATE_LIMIT, Fault.UNAVAILABLE])
@pytest.mark.parametrize("form", [RetryAfterFormat.SECONDS, RetryAfterFormat.HTTP_DATE])
def test_rate_limits_honour_retry_after(
    serve: Serve, clock: Clock, fault: Fault, form: RetryAfterFormat
) -> None:
    provider = serve(retry_after_seconds=7, retry_after_format=form)
    adapter = adapter_for(provider, clock)
    provider.script(fault)
    result = adapter.deliver(request_for("k"))
    assert (result.outcome, result.retry_after) == (Outcome.RETRYABLE, 7.0)
    assert not result.may_have_happened
    assert provider.effects("k") == 0
    adapter.close()


@pytest.mark.parametrize(
    ("fault", "outcome", "status", "effects"),
    [
        (Fault.REJECT, Outcome.PERMANENT, 400, 0),
        (Fault.FAIL_BEFORE_COMMIT, Outcome.AMBIGUOUS, 500, 0),
        (Fault.FAIL_AFTER_COMMIT, Outcome.AMBIGUOUS, 500, 1),
        (Fault.TIMEOUT_BEFORE_COMMIT, Outcome.AMBIGUOUS, 504, 0),
        # The status line arrives, then the connection is cut: it happened, unnamed.
        (Fault.DROP_AFTER_COMMIT, Outcome.AMBIGUOUS, 201, 1),
    ],
)
def test_faults(
    serve: Serve, fault: Fault, outcome: Outcome, status: int | None, effects: int
) -> None:
    provider = serve(hold_seconds=0.05)
    adapter = adapter_for(provider)
    provider.script(fault)
    result = adapter.deliver(request_for("k"))
    assert (result.outcome, result.status_code) == (outcome, status)
    assert provider.effects("k") == effects
    # A resend with the same key settles it: one ticket at most.
    again = adapter.deliver(request_for("k", attempt=2))
    assert again.outcome is Outcome.DELIVERED
    assert provider.effects("k") == 1
    adapter.close()


def test_a_held_reply_is_a_read_timeout(serve: Serve) -> None:
    provider = serve(drop_mode=DropMode.HOLD, hold_seconds=2)
    adapter = adapter_for(provider, read_timeout=0.2)
    provider.script(Fault.DROP_AFTER_COMMIT)
    result = adapter.deliver(request_for("k"))
    assert result.outcome is Outcome.AMBIGUOUS
    assert result.error is not None and result.error.startswith("ReadTimeout")
    assert adapter.lookup("k", None).status is LookupStatus.FOUND
    adapter.close()


def test_an_ignoring_provider_makes_duplicates(serve: Serve) -> None:
    # Why honours_idempotency_keys must be declared truthfully: the same key
    # twice is two tickets here, so an ambiguous send must go to a lookup.
    provider = serve(mode=Mode.IGNORE)
    adapter = adapter_for(provider, capabilities=helpdesk_adapter().capabilities)
    refs = {adapter.deliver(request_for("k", attempt=n)).provider_ref for n in (1, 2)}
    assert len(refs) == 2 and provider.effects("k") == 2
    adapter.close()


def test_lookup_switched_off_is_inconclusive(serve: Serve) -> None:
    provider = serve(lookup_enabled=False)
    adapter = adapter_for(provider)
    result = adapter.lookup("k", None)
    assert result.status is LookupStatus.INCONCLUSIVE
    assert result.error is not None and "501" in result.error
    adapter.close()


def test_lookup_lag_is_why_settle_seconds_exist(serve: Serve, clock: Clock) -> None:
    provider = serve(lookup_lag_ms=1500)
    adapter = adapter_for(provider, clock)
    ref = adapter.deliver(request_for("k")).provider_ref
    # Right after the send the provider says "not found": believing it would resend.
    assert adapter.lookup("k", None).status is LookupStatus.NOT_FOUND
    clock.now += timedelta(seconds=2)
    assert adapter.lookup("k", None) == LookupResult.found(ref or "")
    adapter.close()


def test_many_dispatcher_threads_share_one_adapter(provider: Provider) -> None:
    # Six threads share four connections: a thread may wait its turn for a slot, and
    # on a busy machine for seconds. The limits are the patience, not an idle
    # machine's timings, so a wait is never mistaken for "not sent" or "ambiguous".
    adapter = adapter_for(
        provider,
        max_connections=4,
        connect_timeout=PATIENCE_S,
        read_timeout=PATIENCE_S,
        total_timeout=PATIENCE_S,
    )
    refs: dict[str, set[str | None]] = {}
    lock = threading.Lock()

    def worker(n: int) -> None:
        for i in range(10):
            key = f"k-{i}"
            result = adapter.deliver(request_for(key, attempt=n + 1))
            with lock:
                refs.setdefault(key, set()).add(
                    result.provider_ref if result.outcome is Outcome.DELIVERED else result.outcome
                )

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    adapter.close()
    for i in range(10):
        assert provider.effects(f"k-{i}") == 1
    # Concurrent duplicates may see 409 (retryable); every delivered one has the one
    # ref; nothing is ambiguous (no false alarms from the connection pool).
    for seen in refs.values():
        assert Outcome.AMBIGUOUS not in seen and Outcome.NOT_SENT not in seen
        assert len({ref for ref in seen if ref is not Outcome.RETRYABLE}) == 1


def test_the_registry_from_toml_reaches_the_provider(provider: Provider, tmp_path: Path) -> None:
    path = tmp_path / "adapters.toml"
    path.write_text(f'[adapters.helpdesk]\nkind = "helpdesk"\nbase_url = "{provider.base_url}"\n')
    with load_registry(path, env={}) as registry:
        result = registry.get("helpdesk").deliver(request_for("via-toml"))
    assert result.outcome is Outcome.DELIVERED
    assert provider.effects("via-toml") == 1
