"""Retry timing, the retry budget and the circuit breaker: pure, clock and RNG injected."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest

from outbox.delivery import policy, retry
from outbox.states import AttemptOutcome, EffectStatus

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def backoff(seed: int = 1, initial: float = 0.5, maximum: float = 60.0) -> retry.Backoff:
    return retry.Backoff(
        timedelta(seconds=initial), timedelta(seconds=maximum), random.Random(seed)
    )


@pytest.mark.parametrize("attempt", [1, 2, 3, 5, 8, 12, 40, 10_000])
def test_full_jitter_stays_within_its_bounds(attempt: int) -> None:
    b = backoff(seed=attempt)
    high = min(60.0, 0.5 * 2 ** (attempt - 1)) if attempt < 64 else 60.0
    assert b.wait().upper_bound(attempt) == pytest.approx(high)
    delays = [(b.retry_at(now=T0, attempts=attempt) - T0).total_seconds() for _ in range(2000)]
    assert min(delays) >= 0.0
    assert max(delays) <= high + 1e-6
    # Full jitter spreads over the whole range, not a band near the top.
    assert min(delays) < high * 0.05
    assert max(delays) > high * 0.95


def test_same_seed_same_schedule() -> None:
    a = [backoff(seed=42).retry_at(now=T0, attempts=n) for n in range(1, 10)]
    b = [backoff(seed=42).retry_at(now=T0, attempts=n) for n in range(1, 10)]
    assert a == b


def test_retry_after_is_a_floor_never_shortened_by_jitter() -> None:
    b = backoff(maximum=5.0)
    for attempt in range(1, 20):
        at = b.retry_at(now=T0, attempts=attempt, retry_after=7.0)
        assert at - T0 >= timedelta(seconds=7)
        assert at - T0 <= timedelta(seconds=7)  # above the jitter bound: exactly the floor


def test_full_jitter_is_tenacity_wait_strategy() -> None:
    import tenacity

    wait = backoff().wait()
    assert isinstance(wait, tenacity.wait_exponential)
    state = tenacity.RetryCallState(tenacity.Retrying(), None, (), {})
    state.attempt_number = 3
    assert 0.0 <= wait(state) <= 2.0


def _schedule(deadline: timedelta, max_attempts: int, seed: int, retry_after: float | None = None):
    """Simulate an always-failing (retryable) effect; yield each attempt's start time."""
    b = backoff(seed=seed, initial=1.0, maximum=30.0)
    now, deadline_at, attempts = T0, T0 + deadline, 0
    starts = []
    while True:
        starts.append(now)
        attempts += 1
        decision = policy.after_attempt(
            outcome=AttemptOutcome.RETRYABLE,
            may_have_happened=False,
            honours_keys=True,
            maybe_sent_before=False,
            attempts=attempts,
            max_attempts=max_attempts,
            retry_at=b.retry_at(now=now, attempts=attempts, retry_after=retry_after),
            deadline_at=deadline_at,
        )
        if decision.status is not EffectStatus.PENDING:
            return starts, decision
        assert decision.next_attempt_at is not None
        now = decision.next_attempt_at
        assert len(starts) < 10_000


@pytest.mark.parametrize("seed", range(20))
def test_no_attempt_is_scheduled_past_the_deadline(seed: int) -> None:
    starts, decision = _schedule(timedelta(minutes=2), max_attempts=1000, seed=seed)
    assert all(start < T0 + timedelta(minutes=2) for start in starts)
    assert decision.status is EffectStatus.FAILED  # nothing may have been sent


def test_retry_after_past_the_deadline_stops_instead_of_waiting() -> None:
    starts, decision = _schedule(timedelta(seconds=10), 100, seed=1, retry_after=60.0)
    assert starts == [T0]
    assert decision.status is EffectStatus.FAILED


@pytest.mark.parametrize("cap", [1, 2, 5])
def test_the_attempt_cap_holds(cap: int) -> None:
    starts, decision = _schedule(timedelta(days=1), max_attempts=cap, seed=3)
    assert len(starts) == cap
    assert decision.reason.value == "max_attempts"


# --- retry budget ----------------------------------------------------------------


def test_retry_budget_trips_at_its_ratio_and_recovers_as_the_window_slides() -> None:
    budget = retry.RetryBudget(0.5, timedelta(seconds=60), min_per_window=2)
    now = T0
    assert budget.available(now) == 2  # the floor, with no traffic at all
    for _ in range(10):
        budget.record_first(now)
    assert budget.available(now) == 5
    assert [budget.try_retry(now) for _ in range(7)] == [True] * 5 + [False] * 2
    assert budget.denied == 2
    # Half a window later the spent retries still count.
    assert budget.available(now + timedelta(seconds=30)) == 0
    # A full window later they have slid out: only the floor is left.
    later = now + timedelta(seconds=61)
    assert budget.available(later) == 2
    assert budget.try_retry(later)


def test_an_answered_retry_gives_its_token_back() -> None:
    budget = retry.RetryBudget(0.0, timedelta(seconds=60), min_per_window=2)
    now = T0
    assert [budget.try_retry(now) for _ in range(3)] == [True, True, False]
    budget.record_answered_retry(now)  # the provider answered one: one more may go
    assert budget.try_retry(now)
    assert not budget.try_retry(now)
    # Refunds never create credit beyond what was spent in the window.
    later = now + timedelta(seconds=61)
    budget.record_answered_retry(later)
    budget.record_answered_retry(later)
    assert budget.available(later) == 2
    assert budget.refunded == 1


def test_retry_budget_memory_is_bounded() -> None:
    budget = retry.RetryBudget(1.0, timedelta(seconds=10), 0, buckets=10)
    for i in range(100_000):
        budget.record_first(T0 + timedelta(milliseconds=i))
    assert len(budget._counts) <= 11


# --- circuit breaker -----------------------------------------------------------------


def breaker() -> retry.CircuitBreaker:
    return retry.CircuitBreaker(3, timedelta(seconds=5), timedelta(seconds=18))


def test_breaker_opens_after_consecutive_failures_only() -> None:
    b = breaker()
    b.record_failure(T0)
    b.record_failure(T0)
    b.record_success(T0)  # not consecutive: the count starts again
    assert not b.record_failure(T0)
    assert not b.record_failure(T0)
    assert b.allow(T0)
    assert b.record_failure(T0)  # third in a row
    assert b.state is retry.BreakerState.OPEN
    assert not b.allow(T0 + timedelta(seconds=4.9))
    assert b.paused(T0 + timedelta(seconds=4.9))


def test_breaker_lets_one_probe_through_then_closes_on_success() -> None:
    b = breaker()
    for _ in range(3):
        b.record_failure(T0)
    later = T0 + timedelta(seconds=5)
    assert not b.paused(later)
    assert b.allow(later)  # the probe
    assert not b.allow(later)  # only one
    assert b.paused(later)
    assert b.record_success(later)
    assert b.state is retry.BreakerState.CLOSED
    assert all(b.allow(later) for _ in range(10))


def test_breaker_cooldown_doubles_on_failed_probes_up_to_its_maximum() -> None:
    b = breaker()
    for _ in range(3):
        b.record_failure(T0)
    now = T0
    pauses = []
    for _ in range(4):
        assert b.open_until is not None
        pauses.append((b.open_until - now).total_seconds())
        now = b.open_until
        assert b.allow(now)
        assert b.record_failure(now)
    assert pauses == [5, 10, 18, 18]
    assert b.opened == 5
    b.allow(b.open_until)
    b.record_success(b.open_until)
    assert b.cooldown == timedelta(seconds=5)  # back to the start after recovery


def test_breaker_probe_withdrawn_lets_another_go() -> None:
    b = breaker()
    for _ in range(3):
        b.record_failure(T0)
    later = T0 + timedelta(seconds=5)
    assert b.allow(later)
    b.release_probe()
    assert b.allow(later)


def test_breaker_probe_lost_without_a_result_stops_blocking_after_its_timeout() -> None:
    # The pass that took the probe failed before any result: nobody records
    # success or failure, and nobody releases it.
    b = retry.CircuitBreaker(
        3, timedelta(seconds=5), timedelta(seconds=18), probe_timeout=timedelta(seconds=60)
    )
    for _ in range(3):
        b.record_failure(T0)
    later = T0 + timedelta(seconds=5)
    assert b.allow(later)
    assert b.paused(later + timedelta(seconds=59))
    assert not b.allow(later + timedelta(seconds=59))
    assert not b.paused(later + timedelta(seconds=60))
    assert b.allow(later + timedelta(seconds=60))  # another probe
    assert not b.allow(later + timedelta(seconds=60))  # and only one


# --- shared with a collector thread ------------------------------------------------
#
# The dispatcher's loop admits rows (``allow``, ``try_retry``) while collector threads
# record a detached pass's results (``record_failure``, ``record_answered_retry``). Each
# test pauses one call halfway through, at a hook of a subclass, runs the competing call
# on another thread meanwhile, and checks the invariant. Events, never sleeps: the
# paused call goes on once the other has finished (no lock) or blocks on the lock.


class _Contended:
    """Stands in for an object's lock; ``waited`` is set when a second thread blocks on it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.waited = threading.Event()

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            self.waited.set()
            self._lock.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self._lock.release()


def _meanwhile(
    lock: _Contended, competing: Callable[[], object], answers: list[object]
) -> threading.Thread:
    """Start ``competing`` on a thread; return once it has finished or waits on ``lock``."""

    def run() -> None:
        try:
            answers.append(competing())
        finally:
            lock.waited.set()

    thread = threading.Thread(target=run, name="collector")
    thread.start()
    lock.waited.wait()
    return thread


class _PausingBudget(retry.RetryBudget):
    """Runs ``meanwhile`` once, right after the next sum over the window."""

    meanwhile: Callable[[], object] | None = None

    def _totals(self, now: datetime) -> tuple[int, int]:
        totals = super()._totals(now)
        hook, self.meanwhile = self.meanwhile, None
        if hook is not None:
            hook()
        return totals


class _PausingBreaker(retry.CircuitBreaker):
    """Runs ``meanwhile`` once, right before ``open_until`` is next written."""

    meanwhile: Callable[[], object] | None = None

    def __setattr__(self, name: str, value: object) -> None:
        if name == "open_until":
            hook, self.meanwhile = self.meanwhile, None
            if hook is not None:
                hook()
        super().__setattr__(name, value)


def test_retry_budget_refunds_a_token_once_when_two_threads_answer_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The loop records one pass's results while a collector records a detached pass's:
    # both may see the one token spent and give it back.
    budget = _PausingBudget(0.0, timedelta(seconds=60), min_per_window=1)
    lock = _Contended()
    monkeypatch.setattr(budget, "_lock", lock, raising=False)
    assert budget.try_retry(T0)
    answers: list[object] = []
    threads: list[threading.Thread] = []
    budget.meanwhile = lambda: threads.append(
        _meanwhile(lock, lambda: budget.record_answered_retry(T0), answers)
    )
    budget.record_answered_retry(T0)  # paused once it has seen one token spent
    threads[0].join()
    assert (budget.refunded, budget.available(T0)) == (1, 1)  # not 2: no credit made up


def test_breaker_reopening_on_a_failed_probe_admits_no_probe_meanwhile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A collector records the probe's failure while the loop asks whether to admit a
    # row: the loop must not see the breaker open with the last cooldown's end.
    b = _PausingBreaker(1, timedelta(seconds=5), timedelta(seconds=60))
    lock = _Contended()
    monkeypatch.setattr(b, "_lock", lock, raising=False)
    assert b.record_failure(T0)  # open until T0 + 5s
    probe_at = T0 + timedelta(seconds=5)
    assert b.allow(probe_at)  # the probe
    answers: list[object] = []
    threads: list[threading.Thread] = []
    b.meanwhile = lambda: threads.append(_meanwhile(lock, lambda: b.allow(probe_at), answers))
    assert b.record_failure(probe_at)  # reopens for 10s; paused before open_until is written
    threads[0].join()
    next_probe = probe_at + timedelta(seconds=10)
    admitted = [
        *answers,
        b.allow(probe_at + timedelta(seconds=9)),
        b.allow(next_probe),
        b.allow(next_probe),
    ]
    assert admitted == [False, False, True, False]  # one probe, once the cooldown ends
