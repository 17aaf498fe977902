"""Retry timing, the per-adapter retry budget and the circuit breaker. Pure.

Nothing here does I/O or reads a clock: every function and method takes ``now``
and, where there is chance, a ``random.Random``. The dispatcher owns one RNG
(seedable), one ``RetryBudget`` and one ``CircuitBreaker`` per adapter; the state
*decisions* (retry, stop, outcome_unknown) stay in ``outbox.policy``.

- ``FullJitter``: tenacity's ``wait_exponential`` bound, drawn uniformly from
  ``[0, min(backoff_max, backoff_initial * 2**(n-1))]`` with an injected RNG
  ("full jitter": retries of many effects spread out instead of arriving in
  waves after an outage).
- ``Backoff.retry_at``: when attempt ``n + 1`` may start; ``Retry-After`` is a
  floor, never shortened by jitter. The deadline and the attempt cap are applied
  by ``policy.after_attempt``, which refuses a ``retry_at`` at or past the deadline.
- ``RetryBudget``: retries may be at most ``ratio`` times the first attempts
  over a sliding window (with a floor of ``min_per_window``), so a failing
  provider sees a bounded multiple of normal traffic, not every backlog at once.
- ``CircuitBreaker``: after ``threshold`` consecutive provider failures the
  adapter is paused for a cooldown that doubles on each failed probe, up to a
  maximum; one probe delivery is let through when the cooldown ends.

``RetryBudget`` and ``CircuitBreaker`` are thread-safe (each holds a lock): the
dispatcher's loop admits rows while its collector threads record results.
"""

from __future__ import annotations

import math
import random
import threading
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum

import tenacity

# tenacity's wait strategies read only ``attempt_number`` from the call state;
# one Retrying object serves as the (unused) owner of every state we build.
_RETRYING = tenacity.Retrying()


class FullJitter(tenacity.wait_exponential):
    """Full-jitter exponential backoff on tenacity's ``wait_exponential``, RNG injected.

    tenacity's own ``wait_random_exponential`` draws from the global ``random``
    module, which a test cannot seed without touching every other user of it.
    """

    def __init__(self, initial: float, maximum: float, rng: random.Random) -> None:
        super().__init__(multiplier=initial, max=maximum, exp_base=2, min=0)
        self.rng = rng
        self._bounds: dict[int, float] = {}  # pure in the attempt number: computed once each

    def upper_bound(self, attempt_number: int) -> float:
        """The largest delay attempt ``attempt_number`` may draw (seconds)."""
        bound = self._bounds.get(attempt_number)
        if bound is None:
            state = tenacity.RetryCallState(_RETRYING, None, (), {})
            state.attempt_number = max(1, attempt_number)
            bound = float(super().__call__(state))
            if len(self._bounds) < 1024:
                self._bounds[attempt_number] = bound
        return bound

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        return self.rng.uniform(0.0, self.upper_bound(retry_state.attempt_number))

    def delay(self, attempt_number: int) -> float:
        return self.rng.uniform(0.0, self.upper_bound(attempt_number))


@dataclass(frozen=True, slots=True)
class Backoff:
    """When to try again after attempt ``attempts`` failed in a retryable way."""

    initial: timedelta
    maximum: timedelta
    rng: random.Random
    # Built once: the dispatcher asks for a retry time on every result, and
    # constructing tenacity's strategy cost more than drawing from it.
    _wait: FullJitter = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        jitter = FullJitter(self.initial.total_seconds(), self.maximum.total_seconds(), self.rng)
        object.__setattr__(self, "_wait", jitter)

    def wait(self) -> FullJitter:
        return self._wait

    def retry_at(
        self, *, now: datetime, attempts: int, retry_after: float | None = None
    ) -> datetime:
        """``now`` plus a jittered delay for attempt ``attempts`` (1-based), at least ``retry_after``.

        A provider's ``Retry-After`` is honoured as a floor even when it is
        longer than ``maximum``: sending earlier would only earn another 429.
        The caller (``policy.after_attempt``) refuses any time at or past the
        effect's deadline.
        """
        seconds = self._wait.delay(attempts)
        if retry_after is not None and math.isfinite(retry_after):
            seconds = max(seconds, retry_after)
        return now + timedelta(seconds=seconds)


class RetryBudget:
    """Failing retries at most ``ratio`` x first attempts over a sliding window.

    A token bucket in the spirit of the AWS SDKs' standard retry mode: every
    retry spends a token, and a retry the provider then answers (delivered, or
    refused for good) gives its token back. So during a full outage the retry
    volume stays within ``max(min_per_window, ratio x first attempts)`` per
    window, and once the provider answers again, retries flow at the rate it
    answers them instead of waiting for the window to slide.

    The window is kept as ``buckets`` counters, so memory stays constant
    however many deliveries pass through (a timestamp per delivery would grow
    with throughput).

    Thread-safe: the dispatcher's loop spends and counts (``try_retry``,
    ``record_first``) while a collector thread, recording a detached pass's slow
    sends, refunds (``record_answered_retry``). Each method reads and rewrites
    the buckets under one lock; without it a refund could be lost or doubled,
    or the window's sum could see the deque change under it.
    """

    def __init__(
        self,
        ratio: float,
        window: timedelta,
        min_per_window: int,
        *,
        buckets: int = 20,
    ) -> None:
        if window <= timedelta(0):
            raise ValueError("the retry budget window must be positive")
        self.ratio = ratio
        self.window = window
        self.min_per_window = min_per_window
        self._width = window.total_seconds() / buckets
        self._buckets = buckets
        # (bucket index, first attempts, retries), oldest first
        self._counts: deque[list[int]] = deque()
        self._lock = threading.Lock()
        self.denied = 0  # retries refused since start: a counter for logs and metrics
        self.refunded = 0  # tokens given back by answered retries since start

    # ``_bucket``, ``_totals`` and ``_available`` run under ``_lock``.

    def _bucket(self, now: datetime) -> list[int]:
        index = math.floor(now.timestamp() / self._width)
        while self._counts and self._counts[0][0] <= index - self._buckets:
            self._counts.popleft()
        if not self._counts or self._counts[-1][0] < index:
            self._counts.append([index, 0, 0])
        return self._counts[-1]

    def _totals(self, now: datetime) -> tuple[int, int]:
        self._bucket(now)
        return sum(c[1] for c in self._counts), sum(c[2] for c in self._counts)

    def _available(self, now: datetime) -> int:
        firsts, retries = self._totals(now)
        allowed = max(self.min_per_window, math.floor(self.ratio * firsts))
        return max(0, allowed - retries)

    def record_first(self, now: datetime) -> None:
        with self._lock:
            self._bucket(now)[1] += 1

    def available(self, now: datetime) -> int:
        """How many retries may start now."""
        with self._lock:
            return self._available(now)

    def try_retry(self, now: datetime) -> bool:
        """Spend one retry if the budget has one; count a refusal otherwise."""
        with self._lock:
            if self._available(now) <= 0:
                self.denied += 1
                return False
            self._bucket(now)[2] += 1
            return True

    def record_answered_retry(self, now: datetime) -> None:
        """A retry the provider answered: give its token back (never below zero spent)."""
        with self._lock:
            _, retries = self._totals(now)
            if retries > 0:
                self._bucket(now)[2] -= 1
                self.refunded += 1


class BreakerState(StrEnum):
    CLOSED = "closed"  # deliveries flow
    OPEN = "open"  # paused until the cooldown ends
    HALF_OPEN = "half_open"  # one probe delivery is out; its result closes or reopens


class CircuitBreaker:
    """Consecutive provider failures pause an adapter, with a cooldown that backs off.

    A failure is an answer that says the provider is in trouble (not sent,
    retryable, ambiguous); a success is any answer that shows it working
    (delivered, or a permanent refusal of one request).

    Thread-safe: the dispatcher's loop asks ``allow`` and ``paused`` while a
    collector thread, recording a detached pass's slow sends, calls
    ``record_failure`` and ``record_success``. Each method reads and rewrites the
    state under one lock. Without it, ``allow`` could see a reopening breaker
    half written (open, with the last cooldown's end) and let probes through
    during the new cooldown, more than the one a half-open breaker promises.
    """

    def __init__(
        self,
        threshold: int,
        cooldown: timedelta,
        cooldown_max: timedelta,
        probe_timeout: timedelta | None = None,
    ) -> None:
        self.threshold = threshold
        # A probe whose result never came back (its pass failed, its process's
        # work was lost) stops blocking the adapter after this long.
        self.probe_timeout = probe_timeout if probe_timeout is not None else cooldown_max
        self.cooldown_initial = cooldown
        self.cooldown_max = cooldown_max
        self.state = BreakerState.CLOSED
        self.failures = 0
        self.cooldown = cooldown
        self.open_until: datetime | None = None
        self.opened = 0  # times it opened since start: a counter for logs and metrics
        self._probe_out = False
        self._probe_at: datetime | None = None
        self._lock = threading.Lock()  # ``_probe_lost`` and ``_open`` run under it

    def allow(self, now: datetime) -> bool:
        """May a delivery start now? In half-open state, only the first caller's may."""
        if self._closed():
            # Read without the lock (an attribute read is atomic): a breaker another
            # thread opens at this moment opens just after this delivery was admitted,
            # as it would after the lock. Every effect of a healthy adapter passes here.
            return True
        with self._lock:
            if self.state is BreakerState.CLOSED:
                return True
            if self.state is BreakerState.OPEN:
                assert self.open_until is not None
                if now < self.open_until:
                    return False
                self.state = BreakerState.HALF_OPEN
                self._probe_out = False
            if self._probe_lost(now):
                self._probe_out = False
            if self._probe_out:
                return False
            self._probe_out, self._probe_at = True, now
            return True

    def _closed(self) -> bool:
        # A method, not an inline test: the type checker would otherwise take ``state`` as
        # never CLOSED in ``allow``'s locked check, which another thread can make true.
        return self.state is BreakerState.CLOSED

    def paused(self, now: datetime) -> bool:
        """True when ``allow`` would refuse; does not take the probe."""
        with self._lock:
            if self.state is BreakerState.CLOSED:
                return False
            if self.state is BreakerState.OPEN:
                assert self.open_until is not None
                return now < self.open_until
            return self._probe_out and not self._probe_lost(now)

    def _probe_lost(self, now: datetime) -> bool:
        return (
            self._probe_out
            and self._probe_at is not None
            and now - self._probe_at >= self.probe_timeout
        )

    def record_success(self, now: datetime) -> bool:
        """Returns True when this closed a breaker that was open or half-open."""
        del now
        if self.state is BreakerState.CLOSED and self.failures == 0:
            # Nothing to reset (closing resets the rest): no lock for every delivered
            # effect. A failure recorded at this moment counts as after this success.
            return False
        with self._lock:
            was_open = self.state is not BreakerState.CLOSED
            self.state = BreakerState.CLOSED
            self.failures = 0
            self.cooldown = self.cooldown_initial
            self.open_until = None
            self._probe_out = False
            return was_open

    def record_failure(self, now: datetime) -> bool:
        """Returns True when this failure opened (or reopened) the breaker."""
        with self._lock:
            self.failures += 1
            if self.state is BreakerState.HALF_OPEN:
                # The probe failed: pause again, for longer.
                self.cooldown = min(self.cooldown * 2, self.cooldown_max)
                return self._open(now)
            if self.state is BreakerState.CLOSED and self.failures >= self.threshold:
                return self._open(now)
            return False

    def release_probe(self) -> None:
        """The probe never reached the provider (withdrawn at shutdown): let another go."""
        with self._lock:
            self._probe_out = False

    def _open(self, now: datetime) -> bool:
        self.state = BreakerState.OPEN
        self.open_until = now + self.cooldown
        self._probe_out = False
        self.opened += 1
        return True
