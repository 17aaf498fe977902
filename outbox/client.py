# Longer than 500 lines on purpose: the blocking and the async client are mirror images,
# kept in one module so a change to one is seen next to the other.
"""Clients for callers of the tool boundary: ``Client`` (blocking) and ``AsyncClient``.

    from outbox.client import Client
    with Client("http://127.0.0.1:8000", token) as client:
        result = client.create_task("order-4711-complaint", {"subject": "Late parcel"})
        if result.ok: ...                        # created, or replayed after a lost reply
        elif result.retry == "same_key": ...     # gave up for now: call again later, same id
        elif result.retry == "after_fix": ...    # change the arguments (see result.errors)
        elif result.retry == "reconcile": ...    # expired: look the outcome up
        else: ...                                # "never": this request will not succeed

        view = client.get_operation("order-4711-complaint", deadline=5)
        if view.ok: print(view.data["effects"])  # reads answer a Result too

One shape for every call, reads and writes, blocking and async: a ``Result``,
never an exception for an answer of the server or for a network that did not
answer. ``result.ok`` says whether ``result.data`` holds the answer; otherwise
``result.retry`` says what may help. Exceptions are for bugs (a closed client, a
malformed base URL).

The caller chooses the operation id; the client never invents one, so every
attempt of one call (and every later call with the same id) is the same
intent. It retries, with that same id, transport errors (connect, timeouts,
dropped connections) and answers whose problem says ``retry: same_key`` (503
with ``Retry-After``, 429, other 5xx), with full-jitter exponential backoff,
an overall deadline (per client, or per call with ``deadline=``) and a maximum
number of attempts. It never retries ``never``, ``after_fix`` or
``reconcile``: repeating those cannot help. Reads are retried the same way.

Importing this module loads httpx and tenacity, and nothing of the server
(no SQLAlchemy, no FastAPI).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from enum import StrEnum
from typing import Any, Self
from urllib.parse import quote

import httpx
import tenacity

OPERATION_ID = re.compile(r"^[\x21-\x7e]{1,255}$")
PROBLEM_MEDIA_TYPE = "application/problem+json"
PROBLEM_TYPE_PREFIX = "/problems/"
TIMEOUT_DEFAULT = 10.0
DEADLINE_DEFAULT = 30.0
MAX_ATTEMPTS_DEFAULT = 6
BACKOFF_INITIAL_DEFAULT = 0.2
BACKOFF_MAX_DEFAULT = 5.0

# What a request failed with, when it may or may not have reached the server. Each is safe
# to repeat under the same key. Others (UnsupportedProtocol, LocalProtocolError) are bugs.
RETRYABLE_TRANSPORT_ERRORS = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)

__all__ = ["AsyncClient", "Client", "Outcome", "Result", "Retry", "idempotency_key_header"]


class Outcome(StrEnum):
    CREATED = "created"  # this call's request created the record
    REPLAYED = "replayed"  # the record existed (an earlier attempt's reply may have been lost)
    FOUND = "found"  # a read answered: ``data`` is the record as it is now
    REJECTED = "rejected"  # the server refused: ``retry`` is after_fix or never
    EXPIRED = "expired"  # the key's record expired: reconcile, do not use a fresh key
    UNAVAILABLE = "unavailable"  # no answer within the deadline/attempts: retry later, same key


class Retry(StrEnum):
    SAME_KEY = "same_key"
    NEVER = "never"
    AFTER_FIX = "after_fix"
    RECONCILE = "reconcile"


@dataclass(frozen=True, slots=True)
class Result:
    """The classified answer of one call (a write or a read), after every attempt it made."""

    outcome: Outcome
    operation_id: str | None  # the key of a write or of an operation read; None for a task read
    attempts: int
    status_code: int | None = None
    data: dict[str, Any] | None = None  # the JSON object of a 2xx answer
    body: bytes = b""  # the final answer's exact bytes (a receipt is byte-identical on replay)
    problem: dict[str, Any] | None = None
    retry: Retry | None = None  # None on success
    error: str | None = None  # the last transport error, when there was no answer
    waits: list[float] = field(default_factory=list)  # the pauses between attempts, seconds

    @property
    def ok(self) -> bool:
        return self.outcome in (Outcome.CREATED, Outcome.REPLAYED, Outcome.FOUND)

    @property
    def receipt(self) -> dict[str, Any] | None:
        """A write's receipt (``data`` of a created or replayed answer)."""
        return self.data if self.outcome in (Outcome.CREATED, Outcome.REPLAYED) else None

    @property
    def problem_type(self) -> str | None:
        """The problem's ``type`` as sent: ``/problems/<slug>``."""
        return None if self.problem is None else str(self.problem.get("type"))

    @property
    def problem_slug(self) -> str | None:
        """The last segment of ``problem_type`` (``idempotency-key-reused``), to match on."""
        kind = self.problem_type
        return None if kind is None else kind.rsplit("/", 1)[-1]

    @property
    def errors(self) -> list[dict[str, Any]]:
        return list((self.problem or {}).get("errors") or [])


def idempotency_key_header(operation_id: str) -> str:
    """The ``Idempotency-Key`` field value for an id: bare, as every server version reads it,
    unless it starts with a double quote, which the server would parse as a structured-field
    string (RFC 8941): then it is sent as one, escaped, so the server reads the same id."""
    if not operation_id.startswith('"'):
        return operation_id
    return '"' + operation_id.replace("\\", "\\\\").replace('"', '\\"') + '"'


class _StopAtDeadline(tenacity.stop.stop_base):
    """Stop before a pause that would end past the deadline: the caller asked for an answer
    by then, and "unavailable: retry later with the same key" is one."""

    def __init__(self, clock: Callable[[], float], deadline_at: float) -> None:
        self.clock = clock
        self.deadline_at = deadline_at

    def __call__(self, state: tenacity.RetryCallState) -> bool:
        return self.clock() + state.upcoming_sleep >= self.deadline_at


@dataclass(frozen=True, slots=True)
class _Attempt:
    response: httpx.Response | None
    error: BaseException | None
    retry_after: float | None = None


@dataclass(frozen=True, slots=True)
class _Request:
    """One call: what every attempt sends, and what its answer is classified as."""

    method: str
    path: str
    operation_id: str | None
    write: bool
    content: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)


class _Calls:
    """The retry policy and the classification, shared by ``Client`` and ``AsyncClient``."""

    def __init__(
        self,
        *,
        timeout: float,
        deadline: float,
        max_attempts: int,
        backoff_initial: float,
        backoff_max: float,
        clock: Callable[[], float],
        wall_clock: Callable[[], datetime],
    ) -> None:
        if max_attempts < 1 or deadline <= 0 or timeout <= 0:
            raise ValueError("max_attempts must be >= 1; deadline and timeout must be positive")
        self.timeout = timeout
        self.deadline = deadline
        self.max_attempts = max_attempts
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self._clock = clock
        self._wall_clock = wall_clock

    # --- what a call sends ----------------------------------------------------------------

    @staticmethod
    def _refused(operation_id: object) -> Result | None:
        if isinstance(operation_id, str) and OPERATION_ID.match(operation_id):
            return None
        # Refused before sending: httpx cannot even put a non-ASCII id in a header.
        return Result(
            Outcome.REJECTED,
            str(operation_id),
            attempts=0,
            retry=Retry.AFTER_FIX,
            problem={
                "type": PROBLEM_TYPE_PREFIX + "invalid-operation-id",
                "detail": "the operation id must be 1-255 visible ASCII characters",
            },
        )

    @staticmethod
    def _write(path: str, operation_id: str, arguments: Any) -> _Request:
        content = json.dumps(arguments, separators=(",", ":"), ensure_ascii=False).encode()
        # One key for the whole call: every attempt sends exactly these headers and bytes.
        headers = {
            "Idempotency-Key": idempotency_key_header(operation_id),
            "Content-Type": "application/json",
        }
        return _Request("POST", path, operation_id, True, content, headers)

    @staticmethod
    def _tool_path(tool: str) -> str:
        return "/v1/tools/" + quote(tool, safe="")

    @staticmethod
    def _operation_path(operation_id: str) -> str:
        return "/v1/operations/" + quote(operation_id, safe="")

    # --- how a call is retried ------------------------------------------------------------

    def _deadline_at(self, deadline: float | None) -> float:
        if deadline is not None and deadline <= 0:
            raise ValueError("deadline must be positive")
        return self._clock() + (self.deadline if deadline is None else deadline)

    def _attempt_timeout(self, deadline_at: float) -> float:
        return max(0.001, min(self.timeout, deadline_at - self._clock()))

    def _answered(self, response: httpx.Response) -> _Attempt:
        return _Attempt(response, None, self._retry_after(response))

    def _policy(self, deadline_at: float, waits: list[float]) -> dict[str, Any]:
        """tenacity's arguments for one call (the sleep function is the client's own)."""

        def wait(state: tenacity.RetryCallState) -> float:
            last: _Attempt = state.outcome.result() if state.outcome else _Attempt(None, None)
            return max(self._jitter(state), last.retry_after or 0.0)

        def before_sleep(state: tenacity.RetryCallState) -> None:
            waits.append(state.upcoming_sleep)

        return {
            "retry": tenacity.retry_if_result(self._should_retry),
            "wait": wait,
            "stop": tenacity.stop_any(
                tenacity.stop_after_attempt(self.max_attempts),
                _StopAtDeadline(self._clock, deadline_at),
            ),
            "before_sleep": before_sleep,
            "retry_error_callback": lambda state: state.outcome.result() if state.outcome else None,
        }

    def _jitter(self, state: tenacity.RetryCallState) -> float:
        # Full jitter (uniform between 0 and the exponential cap): many callers retrying
        # after one outage spread out instead of arriving together.
        full_jitter = tenacity.wait_random_exponential(
            multiplier=self.backoff_initial, max=self.backoff_max
        )
        return float(full_jitter(state))

    @staticmethod
    def _should_retry(attempt: _Attempt) -> bool:
        if attempt.response is None:
            return attempt.error is not None
        return _retry_of(attempt.response) == Retry.SAME_KEY

    def _retry_after(self, response: httpx.Response) -> float | None:
        value = response.headers.get("retry-after")
        if value is None:
            return None
        value = value.strip()
        if value.isdigit():
            return float(value)
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        return max(0.0, (when - self._wall_clock()).total_seconds())

    # --- what the answer means ------------------------------------------------------------

    @staticmethod
    def _classify(call: _Request, last: _Attempt, attempts: int, waits: list[float]) -> Result:
        response = last.response
        if response is None:
            return Result(
                Outcome.UNAVAILABLE,
                call.operation_id,
                attempts,
                retry=Retry.SAME_KEY,
                error=f"{type(last.error).__name__}: {last.error}",
                waits=waits,
            )
        body = response.content
        common: dict[str, Any] = {
            "attempts": attempts,
            "status_code": response.status_code,
            "body": body,
            "waits": waits,
        }
        if response.is_success:
            if not call.write:
                outcome = Outcome.FOUND
            elif response.headers.get("idempotent-replayed", "").lower() == "true":
                outcome = Outcome.REPLAYED
            else:
                outcome = Outcome.CREATED
            return Result(outcome, call.operation_id, data=_json_object(body), **common)
        retry = _retry_of(response)
        outcome = {
            Retry.SAME_KEY: Outcome.UNAVAILABLE,
            Retry.RECONCILE: Outcome.EXPIRED,
        }.get(retry, Outcome.REJECTED)
        return Result(outcome, call.operation_id, problem=_problem(response), retry=retry, **common)


class Client(_Calls):
    """The blocking client. Every method returns a ``Result``; ``deadline=`` (seconds) bounds
    that one call, every attempt and pause included, instead of the client's default."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        timeout: float = TIMEOUT_DEFAULT,
        deadline: float = DEADLINE_DEFAULT,
        max_attempts: int = MAX_ATTEMPTS_DEFAULT,
        backoff_initial: float = BACKOFF_INITIAL_DEFAULT,
        backoff_max: float = BACKOFF_MAX_DEFAULT,
        transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        super().__init__(
            timeout=timeout,
            deadline=deadline,
            max_attempts=max_attempts,
            backoff_initial=backoff_initial,
            backoff_max=backoff_max,
            clock=clock,
            wall_clock=wall_clock,
        )
        self._sleep = sleep
        self._http = httpx.Client(
            base_url=base_url,
            transport=transport,
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout,
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # --- writes ------------------------------------------------------------------------

    def create_task(
        self, operation_id: str, arguments: dict[str, Any], *, deadline: float | None = None
    ) -> Result:
        """``POST /v1/tasks``: the tool ``create_support_task``."""
        return self._post("/v1/tasks", operation_id, arguments, deadline)

    def call(
        self, tool: str, operation_id: str, arguments: Any, *, deadline: float | None = None
    ) -> Result:
        """``POST /v1/tools/{tool}`` under ``operation_id``, retried with that id only."""
        return self._post(self._tool_path(tool), operation_id, arguments, deadline)

    def _post(self, path: str, operation_id: str, arguments: Any, deadline: float | None) -> Result:
        refused = self._refused(operation_id)
        if refused is not None:
            return refused
        return self._run(self._write(path, operation_id, arguments), deadline)

    # --- reads -------------------------------------------------------------------------

    def get_operation(self, operation_id: str, *, deadline: float | None = None) -> Result:
        """The receipt and each effect's current state (``data``), or why not."""
        refused = self._refused(operation_id)
        if refused is not None:
            return refused
        call = _Request("GET", self._operation_path(operation_id), operation_id, False)
        return self._run(call, deadline)

    def get_task(self, task_id: int, *, deadline: float | None = None) -> Result:
        """A task as it is now (``data``), or why not."""
        return self._run(_Request("GET", f"/v1/tasks/{int(task_id)}", None, False), deadline)

    # --- the loop ----------------------------------------------------------------------

    def _run(self, call: _Request, deadline: float | None) -> Result:
        deadline_at = self._deadline_at(deadline)
        waits: list[float] = []
        count = 0

        def attempt() -> _Attempt:
            nonlocal count
            count += 1
            try:
                response = self._http.request(
                    call.method,
                    call.path,
                    content=call.content,
                    headers=call.headers,
                    timeout=self._attempt_timeout(deadline_at),
                )
            except RETRYABLE_TRANSPORT_ERRORS as error:
                return _Attempt(None, error)
            return self._answered(response)

        retrying = tenacity.Retrying(sleep=self._sleep, **self._policy(deadline_at, waits))
        last: _Attempt = retrying(attempt)
        return self._classify(call, last, count, waits)


class AsyncClient(_Calls):
    """``Client`` for asyncio (httpx.AsyncClient underneath): the same methods, awaited,
    the same ``Result`` for every call, the same retries and per-call ``deadline=``."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        timeout: float = TIMEOUT_DEFAULT,
        deadline: float = DEADLINE_DEFAULT,
        max_attempts: int = MAX_ATTEMPTS_DEFAULT,
        backoff_initial: float = BACKOFF_INITIAL_DEFAULT,
        backoff_max: float = BACKOFF_MAX_DEFAULT,
        transport: httpx.AsyncBaseTransport | None = None,
        sleep: Callable[[float], Awaitable[None]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        super().__init__(
            timeout=timeout,
            deadline=deadline,
            max_attempts=max_attempts,
            backoff_initial=backoff_initial,
            backoff_max=backoff_max,
            clock=clock,
            wall_clock=wall_clock,
        )
        if sleep is None:
            import asyncio  # here, not at the top: a blocking caller never pays for asyncio

            sleep = asyncio.sleep
        self._async_sleep = sleep
        self._http = httpx.AsyncClient(
            base_url=base_url,
            transport=transport,
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout,
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def create_task(
        self, operation_id: str, arguments: dict[str, Any], *, deadline: float | None = None
    ) -> Result:
        """``POST /v1/tasks``: the tool ``create_support_task``."""
        return await self._post("/v1/tasks", operation_id, arguments, deadline)

    async def call(
        self, tool: str, operation_id: str, arguments: Any, *, deadline: float | None = None
    ) -> Result:
        """``POST /v1/tools/{tool}`` under ``operation_id``, retried with that id only."""
        return await self._post(self._tool_path(tool), operation_id, arguments, deadline)

    async def _post(
        self, path: str, operation_id: str, arguments: Any, deadline: float | None
    ) -> Result:
        refused = self._refused(operation_id)
        if refused is not None:
            return refused
        return await self._run(self._write(path, operation_id, arguments), deadline)

    async def get_operation(self, operation_id: str, *, deadline: float | None = None) -> Result:
        """The receipt and each effect's current state (``data``), or why not."""
        refused = self._refused(operation_id)
        if refused is not None:
            return refused
        call = _Request("GET", self._operation_path(operation_id), operation_id, False)
        return await self._run(call, deadline)

    async def get_task(self, task_id: int, *, deadline: float | None = None) -> Result:
        """A task as it is now (``data``), or why not."""
        return await self._run(_Request("GET", f"/v1/tasks/{int(task_id)}", None, False), deadline)

    async def _run(self, call: _Request, deadline: float | None) -> Result:
        deadline_at = self._deadline_at(deadline)
        waits: list[float] = []
        count = 0

        async def attempt() -> _Attempt:
            nonlocal count
            count += 1
            try:
                response = await self._http.request(
                    call.method,
                    call.path,
                    content=call.content,
                    headers=call.headers,
                    timeout=self._attempt_timeout(deadline_at),
                )
            except RETRYABLE_TRANSPORT_ERRORS as error:
                return _Attempt(None, error)
            return self._answered(response)

        retrying = tenacity.AsyncRetrying(
            sleep=self._async_sleep, **self._policy(deadline_at, waits)
        )
        last: _Attempt = await retrying(attempt)
        return self._classify(call, last, count, waits)


def _problem(response: httpx.Response) -> dict[str, Any] | None:
    if not response.headers.get("content-type", "").startswith(PROBLEM_MEDIA_TYPE):
        return None
    return _json_object(response.content)


def _json_object(body: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _retry_of(response: httpx.Response) -> Retry:
    """What the answer allows: the problem's ``retry``, else a default by status."""
    problem = _problem(response)
    if problem is not None:
        try:
            return Retry(str(problem.get("retry")))
        except ValueError:
            pass
    status = response.status_code
    if status == 429 or status >= 500:
        # A proxy's 502/504 or an overload: the key makes repeating it safe.
        return Retry.SAME_KEY
    if status == 410:
        return Retry.RECONCILE
    if status in (403, 404, 405, 409):
        return Retry.NEVER
    return Retry.AFTER_FIX
