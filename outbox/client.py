"""A small HTTP client for callers of the tool boundary.

    from outbox.client import Client
    with Client("http://127.0.0.1:8000", token) as client:
        result = client.create_task("order-4711-complaint", {"subject": "Late parcel"})
        if result.ok: ...                        # created, or replayed after a lost reply
        elif result.retry == "same_key": ...     # gave up for now: call again later, same id
        elif result.retry == "after_fix": ...    # change the arguments (see result.errors)
        elif result.retry == "reconcile": ...    # expired: look the outcome up
        else: ...                                # "never": this request will not succeed

The caller chooses the operation id; the client never invents one, so every
attempt of one call (and every later call with the same id) is the same
intent. It retries, with that same id, transport errors (connect, timeouts,
dropped connections) and answers whose problem says ``retry: same_key`` (503
with ``Retry-After``, 429, other 5xx), with full-jitter exponential backoff,
an overall deadline and a maximum number of attempts. It never retries
``never``, ``after_fix`` or ``reconcile``: repeating those cannot help.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
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
TIMEOUT_DEFAULT = 10.0
DEADLINE_DEFAULT = 30.0
MAX_ATTEMPTS_DEFAULT = 6
BACKOFF_INITIAL_DEFAULT = 0.2
BACKOFF_MAX_DEFAULT = 5.0

# What a request failed with, when it may or may not have reached the server. Each is safe
# to repeat under the same key. Others (UnsupportedProtocol, LocalProtocolError) are bugs.
RETRYABLE_TRANSPORT_ERRORS = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)


class Outcome(StrEnum):
    CREATED = "created"  # this call's request created the record
    REPLAYED = "replayed"  # the record existed (an earlier attempt's reply may have been lost)
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
    """The classified answer of one ``call``, after every attempt it made."""

    outcome: Outcome
    operation_id: str
    attempts: int
    status_code: int | None = None
    receipt: dict[str, Any] | None = None
    body: bytes = b""  # the final answer's exact bytes (a receipt is byte-identical on replay)
    problem: dict[str, Any] | None = None
    retry: Retry | None = None  # None on success
    error: str | None = None  # the last transport error, when there was no answer
    waits: list[float] = field(default_factory=list)  # the pauses between attempts, seconds

    @property
    def ok(self) -> bool:
        return self.outcome in (Outcome.CREATED, Outcome.REPLAYED)

    @property
    def problem_type(self) -> str | None:
        return None if self.problem is None else str(self.problem.get("type"))

    @property
    def errors(self) -> list[dict[str, Any]]:
        return list((self.problem or {}).get("errors") or [])


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


class Client:
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
        if max_attempts < 1 or deadline <= 0 or timeout <= 0:
            raise ValueError("max_attempts must be >= 1; deadline and timeout must be positive")
        self.timeout = timeout
        self.deadline = deadline
        self.max_attempts = max_attempts
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self._sleep = sleep
        self._clock = clock
        self._wall_clock = wall_clock
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

    def create_task(self, operation_id: str, arguments: dict[str, Any]) -> Result:
        """``POST /v1/tasks``: the tool ``create_support_task``."""
        return self._write("/v1/tasks", operation_id, arguments)

    def call(self, tool: str, operation_id: str, arguments: Any) -> Result:
        """``POST /v1/tools/{tool}`` under ``operation_id``, retried with that id only."""
        return self._write("/v1/tools/" + quote(tool, safe=""), operation_id, arguments)

    def _write(self, path: str, operation_id: str, arguments: Any) -> Result:
        if not isinstance(operation_id, str) or not OPERATION_ID.match(operation_id):
            # Refused before sending: httpx cannot even put a non-ASCII id in a header.
            return Result(
                Outcome.REJECTED,
                str(operation_id),
                attempts=0,
                retry=Retry.AFTER_FIX,
                problem={
                    "type": "invalid-operation-id",
                    "detail": "the operation id must be 1-255 visible ASCII characters",
                },
            )
        content = json.dumps(arguments, separators=(",", ":"), ensure_ascii=False).encode()
        # One key for the whole call: every attempt below sends exactly these headers.
        headers = {"Idempotency-Key": operation_id, "Content-Type": "application/json"}
        deadline_at = self._clock() + self.deadline
        waits: list[float] = []

        def attempt() -> _Attempt:
            remaining = deadline_at - self._clock()
            try:
                response = self._http.post(
                    path,
                    content=content,
                    headers=headers,
                    timeout=max(0.001, min(self.timeout, remaining)),
                )
            except RETRYABLE_TRANSPORT_ERRORS as error:
                return _Attempt(None, error)
            return _Attempt(response, None, self._retry_after(response))

        def wait(state: tenacity.RetryCallState) -> float:
            jitter = self._jitter(state)
            last: _Attempt = state.outcome.result() if state.outcome else _Attempt(None, None)
            pause = max(jitter, last.retry_after or 0.0)
            return pause

        def before_sleep(state: tenacity.RetryCallState) -> None:
            waits.append(state.upcoming_sleep)

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_result(self._should_retry),
            wait=wait,
            stop=tenacity.stop_any(
                tenacity.stop_after_attempt(self.max_attempts),
                _StopAtDeadline(self._clock, deadline_at),
            ),
            sleep=self._sleep,
            before_sleep=before_sleep,
            retry_error_callback=lambda state: state.outcome.result() if state.outcome else None,
        )
        count = 0

        def counted() -> _Attempt:
            nonlocal count
            count += 1
            return attempt()

        last: _Attempt = retrying(counted)
        return self._classify(operation_id, last, count, waits)

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

    def _classify(
        self, operation_id: str, last: _Attempt, attempts: int, waits: list[float]
    ) -> Result:
        response = last.response
        if response is None:
            return Result(
                Outcome.UNAVAILABLE,
                operation_id,
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
            replayed = response.headers.get("idempotent-replayed", "").lower() == "true"
            return Result(
                Outcome.REPLAYED if replayed else Outcome.CREATED,
                operation_id,
                receipt=_json_object(body),
                **common,
            )
        retry = _retry_of(response)
        outcome = {
            Retry.SAME_KEY: Outcome.UNAVAILABLE,
            Retry.RECONCILE: Outcome.EXPIRED,
        }.get(retry, Outcome.REJECTED)
        return Result(outcome, operation_id, problem=_problem(response), retry=retry, **common)

    # --- reads -------------------------------------------------------------------------

    def get_operation(self, operation_id: str) -> dict[str, Any]:
        """The receipt and each effect's state; raises ``httpx.HTTPStatusError`` on errors."""
        response = self._http.get("/v1/operations/" + quote(operation_id, safe=""))
        response.raise_for_status()
        value: dict[str, Any] = response.json()
        return value

    def get_task(self, task_id: int) -> dict[str, Any]:
        response = self._http.get(f"/v1/tasks/{int(task_id)}")
        response.raise_for_status()
        value: dict[str, Any] = response.json()
        return value


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
