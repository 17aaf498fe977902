"""``outbox.client`` against scripted answers (respx): what it retries, with which key, and the
one ``Result`` shape of every call, blocking and async, reads and writes."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import httpx
import pytest
import respx

from outbox.client import AsyncClient, Client, Outcome, Result, Retry

BASE = "http://127.0.0.1:8000"
RECEIPT = b'{"operation_id":"op-1","status":"created","task_id":7}'
NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


class FakeTime:
    """Monotonic clock and sleep for the client: sleeping moves the clock, nothing waits."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.pauses: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds


@pytest.fixture
def time() -> FakeTime:
    return FakeTime()


@pytest.fixture
def mock() -> Iterator[respx.MockRouter]:
    with respx.mock(base_url=BASE, assert_all_called=False) as router:
        yield router


def client(time: FakeTime, **kwargs: Any) -> Client:
    options: dict[str, Any] = {
        "deadline": 30.0,
        "max_attempts": 6,
        "sleep": time.sleep,
        "clock": time.clock,
        "wall_clock": lambda: NOW,
        **kwargs,
    }
    return Client(BASE, "obx_token", **options)


def created(replayed: bool = False) -> httpx.Response:
    return httpx.Response(
        201,
        content=RECEIPT,
        headers={
            "Content-Type": "application/json",
            "Idempotent-Replayed": "true" if replayed else "false",
        },
    )


def problem(status: int, kind: str, retry: str, **headers: str) -> httpx.Response:
    doc: dict[str, Any] = {
        "type": f"/problems/{kind}",
        "title": kind,
        "status": status,
        "detail": kind,
        "retry": retry,
    }
    if kind == "invalid-arguments":
        doc["errors"] = [{"field": "subject", "message": "too short", "type": "string_too_short"}]
    return httpx.Response(
        status,
        content=json.dumps(doc).encode(),
        headers={"Content-Type": "application/problem+json", **headers},
    )


def keys(route: respx.Route) -> list[str]:
    return [call.request.headers["Idempotency-Key"] for call in route.calls]


@pytest.mark.parametrize(
    "error",
    [
        httpx.ConnectError("refused"),
        httpx.ReadTimeout("read timed out"),
        httpx.RemoteProtocolError("server disconnected without sending a response"),
    ],
    ids=["connect-error", "read-timeout", "remote-protocol-error"],
)
def test_each_transport_error_is_retried_with_the_same_key(
    mock: respx.MockRouter, time: FakeTime, error: Exception
) -> None:
    route = mock.post("/v1/tasks").mock(side_effect=[error, error, created(replayed=True)])
    with client(time) as c:
        result = c.create_task("op-1", {"subject": "x"})
    assert result.outcome is Outcome.REPLAYED
    assert result.ok
    assert result.attempts == 3
    assert result.body == RECEIPT
    assert result.receipt == {"operation_id": "op-1", "status": "created", "task_id": 7}
    assert keys(route) == ["op-1"] * 3
    assert len({call.request.content for call in route.calls}) == 1
    assert all(call.request.headers["Authorization"] == "Bearer obx_token" for call in route.calls)
    # Full jitter: each pause is between 0 and the exponential cap.
    assert len(time.pauses) == 2
    assert 0 <= time.pauses[0] <= 0.2
    assert 0 <= time.pauses[1] <= 0.4


def test_503_with_retry_after_in_seconds_waits_at_least_that_long(
    mock: respx.MockRouter, time: FakeTime
) -> None:
    route = mock.post("/v1/tasks").mock(
        side_effect=[problem(503, "busy", "same_key", **{"Retry-After": "3"}), created()]
    )
    with client(time) as c:
        result = c.create_task("op-1", {"subject": "x"})
    assert result.outcome is Outcome.CREATED
    assert keys(route) == ["op-1", "op-1"]
    assert time.pauses[0] >= 3
    assert result.waits == time.pauses


def test_503_with_retry_after_as_an_http_date(mock: respx.MockRouter, time: FakeTime) -> None:
    later = format_datetime(NOW + timedelta(seconds=7), usegmt=True)
    route = mock.post("/v1/tools/create_support_task").mock(
        side_effect=[problem(503, "busy", "same_key", **{"Retry-After": later}), created()]
    )
    with client(time) as c:
        result = c.call("create_support_task", "op-1", {"subject": "x"})
    assert result.outcome is Outcome.CREATED
    assert keys(route) == ["op-1", "op-1"]
    assert 7 <= time.pauses[0] < 8


@pytest.mark.parametrize(
    ("answer", "outcome", "retry"),
    [
        (problem(422, "invalid-arguments", "after_fix"), Outcome.REJECTED, Retry.AFTER_FIX),
        (problem(422, "idempotency-key-reused", "never"), Outcome.REJECTED, Retry.NEVER),
        (problem(410, "operation-expired", "reconcile"), Outcome.EXPIRED, Retry.RECONCILE),
        (problem(400, "malformed-request", "after_fix"), Outcome.REJECTED, Retry.AFTER_FIX),
        (problem(401, "unauthenticated", "after_fix"), Outcome.REJECTED, Retry.AFTER_FIX),
        (httpx.Response(404, text="not here"), Outcome.REJECTED, Retry.NEVER),
    ],
    ids=["422-invalid", "422-reused", "410-expired", "400", "401", "404-plain"],
)
def test_never_after_fix_and_reconcile_are_not_retried(
    mock: respx.MockRouter, time: FakeTime, answer: httpx.Response, outcome: Outcome, retry: Retry
) -> None:
    route = mock.post("/v1/tasks").mock(side_effect=[answer, created()])
    with client(time) as c:
        result = c.create_task("op-1", {"subject": "x"})
    assert route.call_count == 1
    assert result.outcome is outcome
    assert result.retry is retry
    assert not result.ok
    assert time.pauses == []
    if answer.headers.get("content-type") == "application/problem+json":
        assert result.problem_type == answer.json()["type"]
    if result.problem_slug == "invalid-arguments":
        assert result.errors[0]["field"] == "subject"


def test_it_stops_at_its_deadline_and_says_retry_with_the_same_key(
    mock: respx.MockRouter, time: FakeTime
) -> None:
    route = mock.post("/v1/tasks").mock(side_effect=httpx.ConnectError("refused"))
    start = time.now
    with client(time, deadline=2.0, max_attempts=1000, backoff_initial=0.5) as c:
        result = c.create_task("op-1", {"subject": "x"})
    assert result.outcome is Outcome.UNAVAILABLE
    assert result.retry is Retry.SAME_KEY
    assert result.error is not None and "ConnectError" in result.error
    assert time.now - start < 2.0  # no pause that would end past the deadline was taken
    assert 2 <= route.call_count < 1000
    assert set(keys(route)) == {"op-1"}


def test_a_retry_after_past_the_deadline_ends_the_call_now(
    mock: respx.MockRouter, time: FakeTime
) -> None:
    route = mock.post("/v1/tasks").mock(
        return_value=problem(503, "busy", "same_key", **{"Retry-After": "120"})
    )
    with client(time, deadline=10.0) as c:
        result = c.create_task("op-1", {"subject": "x"})
    assert route.call_count == 1
    assert time.pauses == []
    assert result.outcome is Outcome.UNAVAILABLE
    assert result.status_code == 503
    assert result.retry is Retry.SAME_KEY


def test_it_stops_at_its_maximum_attempt_count(mock: respx.MockRouter, time: FakeTime) -> None:
    route = mock.post("/v1/tasks").mock(side_effect=httpx.ReadTimeout("slow"))
    with client(time, max_attempts=4, deadline=3600) as c:
        result = c.create_task("op-1", {"subject": "x"})
    assert route.call_count == 4
    assert len(time.pauses) == 3
    assert result.outcome is Outcome.UNAVAILABLE


def test_a_5xx_without_a_problem_body_is_retried_and_a_429_too(
    mock: respx.MockRouter, time: FakeTime
) -> None:
    route = mock.post("/v1/tasks").mock(
        side_effect=[httpx.Response(502, text="bad gateway"), httpx.Response(429), created()]
    )
    with client(time) as c:
        result = c.create_task("op-1", {"subject": "x"})
    assert result.outcome is Outcome.CREATED
    assert keys(route) == ["op-1"] * 3


def test_the_client_never_invents_an_operation_id(mock: respx.MockRouter, time: FakeTime) -> None:
    route = mock.post("/v1/tasks").mock(return_value=created())
    with client(time) as c:
        for bad in ("", "with space", "é", "k" * 256):
            result = c.create_task(bad, {"subject": "x"})
            assert result.outcome is Outcome.REJECTED
            assert result.retry is Retry.AFTER_FIX
            assert result.attempts == 0
    assert route.call_count == 0


# --- one shape for reads and writes ---------------------------------------------------

OPERATION = {"operation_id": "op-1", "receipt": {"task_id": 7}, "effects": []}


def found() -> httpx.Response:
    return httpx.Response(200, json=OPERATION)


def test_a_read_answers_a_result_like_a_write_and_is_retried_the_same_way(
    mock: respx.MockRouter, time: FakeTime
) -> None:
    route = mock.get("/v1/operations/op-1").mock(
        side_effect=[httpx.ConnectError("refused"), problem(503, "busy", "same_key"), found()]
    )
    with client(time) as c:
        result = c.get_operation("op-1")
    assert result.outcome is Outcome.FOUND
    assert result.ok and result.retry is None
    assert result.data == OPERATION
    assert result.receipt is None  # a read has data, not a receipt
    assert (result.attempts, route.call_count, len(time.pauses)) == (3, 3, 2)


@pytest.mark.parametrize(
    ("answer", "outcome", "retry"),
    [
        (problem(404, "not-found", "never"), Outcome.REJECTED, Retry.NEVER),
        (problem(410, "operation-expired", "reconcile"), Outcome.EXPIRED, Retry.RECONCILE),
        (problem(401, "unauthenticated", "after_fix"), Outcome.REJECTED, Retry.AFTER_FIX),
    ],
    ids=["404", "410", "401"],
)
def test_a_read_that_cannot_succeed_is_a_result_not_an_exception(
    mock: respx.MockRouter, time: FakeTime, answer: httpx.Response, outcome: Outcome, retry: Retry
) -> None:
    route = mock.get("/v1/tasks/7").mock(side_effect=[answer, found()])
    with client(time) as c:
        result = c.get_task(7)
    assert route.call_count == 1
    assert (result.outcome, result.retry, result.ok) == (outcome, retry, False)
    assert result.problem_slug == answer.json()["type"].rsplit("/", 1)[-1]
    assert result.operation_id is None


def test_a_read_with_a_bad_id_is_refused_without_sending(
    mock: respx.MockRouter, time: FakeTime
) -> None:
    route = mock.get(url__regex=r"/v1/operations/.*").mock(return_value=found())
    with client(time) as c:
        result = c.get_operation("with space")
    assert (result.outcome, result.attempts, route.call_count) == (Outcome.REJECTED, 0, 0)
    assert result.problem_slug == "invalid-operation-id"


def test_the_deadline_is_per_call(mock: respx.MockRouter, time: FakeTime) -> None:
    route = mock.post("/v1/tasks").mock(side_effect=httpx.ConnectError("refused"))
    with client(time, deadline=3600, max_attempts=1000, backoff_initial=0.5) as c:
        start = time.now
        short = c.create_task("op-1", {"subject": "x"}, deadline=2.0)
        short_calls, short_span = route.call_count, time.now - start
        start = time.now
        long = c.create_task("op-1", {"subject": "x"}, deadline=60.0)
        long_span = time.now - start
        with pytest.raises(ValueError):
            c.get_task(1, deadline=0)
    assert short.outcome is long.outcome is Outcome.UNAVAILABLE
    assert short_span < 2.0 <= long_span < 60.0  # each call stopped at its own deadline
    assert route.call_count - short_calls > short_calls
    assert set(keys(route)) == {"op-1"}


def test_an_id_that_starts_with_a_quote_is_sent_as_a_structured_string(
    mock: respx.MockRouter, time: FakeTime
) -> None:
    route = mock.post("/v1/tasks").mock(return_value=created())
    with client(time) as c:
        c.create_task('"odd\\id', {"subject": "x"})
        c.create_task("plain", {"subject": "x"})
    # The server parses a leading quote as RFC 8941: escaped, it reads back the same id.
    assert keys(route) == ['"\\"odd\\\\id"', "plain"]


# --- the async client -------------------------------------------------------------------


class AsyncFakeTime(FakeTime):
    async def asleep(self, seconds: float) -> None:
        self.sleep(seconds)


def test_the_async_client_has_the_same_shape_and_keeps_one_key_across_retries(
    mock: respx.MockRouter,
) -> None:
    fake = AsyncFakeTime()
    writes = mock.post("/v1/tasks").mock(
        side_effect=[httpx.ReadTimeout("slow"), httpx.ConnectError("refused"), created(True)]
    )
    reads = mock.get("/v1/operations/op-1").mock(
        side_effect=[httpx.RemoteProtocolError("dropped"), found()]
    )
    mock.get("/v1/tasks/9").mock(return_value=problem(404, "not-found", "never"))

    async def main() -> list[Result]:
        async with AsyncClient(
            BASE, "obx_token", sleep=fake.asleep, clock=fake.clock, wall_clock=lambda: NOW
        ) as c:
            return [
                await c.create_task("op-1", {"subject": "x"}, deadline=60),
                await c.get_operation("op-1"),
                await c.get_task(9),
            ]

    write, read, missing = asyncio.run(main())
    assert (write.outcome, write.attempts, write.receipt) == (
        Outcome.REPLAYED,
        3,
        json.loads(RECEIPT),
    )
    assert keys(writes) == ["op-1"] * 3
    assert len({call.request.content for call in writes.calls}) == 1
    assert (read.outcome, read.data, reads.call_count) == (Outcome.FOUND, OPERATION, 2)
    assert (missing.outcome, missing.retry) == (Outcome.REJECTED, Retry.NEVER)
    assert len(fake.pauses) == 3


def test_the_async_client_stops_at_the_calls_deadline(mock: respx.MockRouter) -> None:
    fake = AsyncFakeTime()
    route = mock.post("/v1/tools/send_email").mock(side_effect=httpx.ConnectError("refused"))

    async def main() -> Result:
        async with AsyncClient(
            BASE, "t", deadline=3600, max_attempts=1000, sleep=fake.asleep, clock=fake.clock
        ) as c:
            return await c.call("send_email", "op-9", {"to": "a@example.com"}, deadline=1.5)

    start = fake.now
    result = asyncio.run(main())
    assert result.outcome is Outcome.UNAVAILABLE and result.retry is Retry.SAME_KEY
    assert fake.now - start < 1.5
    assert set(keys(route)) == {"op-9"}


# --- a light import ---------------------------------------------------------------------

HEAVY = (
    "sqlalchemy",
    "fastapi",
    "starlette",
    "pydantic",
    "alembic",
    "outbox.db",
    "outbox.creating.create",
)


def test_importing_the_client_loads_nothing_of_the_server() -> None:
    code = (
        "import json, sys\n"
        "import outbox.client\n"
        f"print(json.dumps([m for m in {list(HEAVY)!r} if m in sys.modules]))\n"
        "from outbox import Outbox, OutboxError, Settings\n"
        "print(Outbox.__module__, OutboxError.__module__, Settings.__module__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.splitlines()
    assert json.loads(out[0]) == []
    # The package's top-level names still work; they load on first use.
    assert out[1] == "outbox.service outbox.errors outbox.settings"


def test_the_package_names_resolve_lazily_and_unknown_ones_fail() -> None:
    import outbox

    assert set(outbox.__all__) <= set(dir(outbox))
    for name in outbox.__all__:
        assert getattr(outbox, name).__name__ == name
    with pytest.raises(AttributeError):
        _ = outbox.NoSuchName  # type: ignore[attr-defined]
