# Longer than 500 lines on purpose: the delivery loop, its threads, the budget and breaker
# bookkeeping and the stop protocol share one lock and one state; split, they would share it
# across modules.
"""``outbox dispatcher``: deliver due outbox rows through their adapters.

One pass (``run_once``):

1. **Claim** a batch in one transaction (``store.claim_due``): due rows go
   ``in_flight`` under a fenced lease and each gets an open attempt row, which
   is committed before anything is sent. Adapters whose circuit breaker is open
   are left out, and so are retries of adapters whose retry budget is spent.
2. **Send** up to ``concurrency`` at once on a thread pool. Each request carries
   the row's stored ``effect_key`` and nothing else. An adapter that raises
   fails that row only. A few more runners are kept in reserve for adapters
   with no slow send (out longer than ``slow_send_after``), and ``run()``
   stops waiting for slow sends (a collector thread records them) before it
   claims again: one slow provider does not hold up the others.
3. **Record** results in batches (``store.finish_attempts``), one transaction
   per batch of finished deliveries; each row's state is written only while its
   fence holds. ``policy.after_attempt`` decides the next state; ``retry`` says
   when a retry is due (full jitter, ``Retry-After`` as a floor). On PostgreSQL
   ``run()`` writes a pass's last batch behind (a recorder thread) while the
   next pass claims: the server writes one batch while this process works on
   the next (under a backlog: a short pass records in line). At most one batch
   is behind; its rows keep their leases until it commits, as while they are sent.

``run()`` loops over ``run_once``. APScheduler runs two jobs, one instance
each, coalesced: the poll (wakes the loop every ``poll_interval``) and lease
renewal (every ``lease_renew_interval``, at most a third of the lease, while
anything is in flight). On PostgreSQL the loop also waits on its own
``LISTEN outbox_pending`` connection (``wakeup``), so it wakes as soon as new
rows commit, on the thread that claims. ``request_stop()`` (SIGTERM) stops
claiming, withdraws requests not yet handed to an adapter, gives the ones in
progress ``shutdown_grace`` to finish, then releases the rest through
``store.release`` (a possibly-sent row is never returned as unsent).

Clocks: ``run_once(now=...)`` uses the given time for everything (tests). With
``now=None`` the claim uses the database clock on PostgreSQL and the host's on
SQLite; a result's time is the claim's time plus the elapsed monotonic time, so
attempt times, retries and leases share one clock.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import itertools
import json
import logging
import os
import queue
import random
import secrets
import signal
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from types import FrameType
from typing import Any, NamedTuple

from sqlalchemy.engine import Engine

import adapters
from outbox import app as apps
from outbox import db, faults, logs, metrics, schema, settings
from outbox.delivery import policy, retry, store, wakeup
from outbox.states import AttemptOutcome, EffectStatus

logger = logging.getLogger("outbox.dispatcher")

S = EffectStatus

FLUSH_SIZE_DEFAULT = 100
"""Record results once this many have finished, even if others are still out."""
FLUSH_AFTER_DEFAULT = timedelta(milliseconds=20)
"""... or once the oldest unrecorded result has waited this long."""

_OUTCOMES: Mapping[adapters.Outcome, AttemptOutcome] = {
    adapters.Outcome.DELIVERED: AttemptOutcome.DELIVERED,
    adapters.Outcome.NOT_SENT: AttemptOutcome.NOT_SENT,
    adapters.Outcome.RETRYABLE: AttemptOutcome.RETRYABLE,
    adapters.Outcome.PERMANENT: AttemptOutcome.PERMANENT,
    adapters.Outcome.AMBIGUOUS: AttemptOutcome.AMBIGUOUS,
}
# Answers that say the provider is in trouble (the breaker counts them); a
# permanent refusal or a delivery shows it working.
_PROVIDER_FAILURES = frozenset(
    {AttemptOutcome.NOT_SENT, AttemptOutcome.RETRYABLE, AttemptOutcome.AMBIGUOUS}
)


def default_worker_id() -> str:
    """``host:pid:random``: unique per process, readable in attempt rows and logs."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class _Result(NamedTuple):
    """What one delivery produced, as the dispatcher records it."""

    outcome: AttemptOutcome
    may_have_happened: bool
    status_code: int | None = None
    provider_ref: str | None = None
    retry_after: float | None = None
    error: str | None = None
    lease_lapsed: bool = False  # not sent because the lease may have run out: no provider news


_WITHDRAWN = object()  # the request was never handed to the adapter (shutdown)


@dataclass(frozen=True, slots=True)
class _Raised:
    """An exception a delivery runner caught, for the pass's thread to raise."""

    error: BaseException


def _take(
    results: queue.SimpleQueue[tuple[_Task, object]], timeout: float
) -> list[tuple[_Task, object]]:
    """Every result waiting now, blocking up to ``timeout`` for the first."""
    try:
        taken = [results.get(timeout=timeout)]
    except queue.Empty:
        return []
    while True:
        try:
            taken.append(results.get_nowait())
        except queue.Empty:
            return taken


@dataclass(eq=False)
class _Task:
    effect: store.Claimed
    adapter: adapters.Adapter | None
    started: float  # monotonic, at claim
    held_until: float  # monotonic; the lease surely holds until then (claim or renewal + lease)
    lock: threading.Lock = field(default_factory=threading.Lock)
    handed: bool = False  # the request was given to adapter.deliver: it may have been sent
    withdrawn: bool = False
    done: float | None = None  # monotonic, when the adapter returned
    # Where a runner puts this task's outcome: its pass's queue.
    results: queue.SimpleQueue[tuple[_Task, object]] | None = None
    picked: float = 0.0  # monotonic, when a runner took it
    finished: bool = False  # its result is in (recorded or about to be)


@dataclass(eq=False)
class _Pass:
    """One claim's tasks while their results come in (on the pass's thread, or a collector's
    after the pass stopped waiting for slow sends)."""

    tasks: list[_Task]
    results: queue.SimpleQueue[tuple[_Task, object]]
    claimed_at: datetime
    fixed_now: datetime | None
    waiting: set[_Task]
    progress: float  # monotonic: the pass's start, then each result's arrival
    buffer: list[store.Finish] = field(default_factory=list)
    withdrawn: list[_Task] = field(default_factory=list)
    oldest: float | None = None  # monotonic: when the oldest unrecorded result came in
    behind: bool = False  # its last batch is being written by the recorder thread


class Dispatcher:
    """Delivers outbox rows. ``run_once(now)`` is one pass; ``run()`` loops over it."""

    def __init__(
        self,
        engine: Engine,
        registry: adapters.Registry,
        config: settings.Settings | None = None,
        *,
        worker_id: str | None = None,
        rng: random.Random | None = None,
        flush_size: int = FLUSH_SIZE_DEFAULT,
        flush_after: timedelta = FLUSH_AFTER_DEFAULT,
    ) -> None:
        self.engine = engine
        self.adapters = registry
        self.settings = config or settings.load()
        self.worker_id = worker_id or default_worker_id()
        self.rng = rng or random.Random()
        self.backoff = retry.Backoff(
            self.settings.backoff_initial, self.settings.backoff_max, self.rng
        )
        self.flush_size = flush_size
        self.flush_after = flush_after.total_seconds()
        # One of each per adapter, made by ``_admit`` on the loop's thread (every row is
        # admitted before it is sent) and fed results by collector threads too
        # (``_observe``) while the loop admits: each guards its state with its own lock.
        self._budgets: dict[str, retry.RetryBudget] = {}
        self._breakers: dict[str, retry.CircuitBreaker] = {}
        self._budget_empty: set[str] = set()  # for logging the transitions only
        # Claimed tasks not yet taken by a runner, every pass's, oldest first; and the
        # sends in progress by adapter. Up to ``concurrency`` sends go out at once, and
        # ``_reserve`` more for adapters with no send out longer than ``slow_send_after``:
        # a slow provider holds at most ``concurrency`` runners, and the others still
        # get the reserve.
        self._slow_after = self.settings.slow_send_after.total_seconds()
        concurrency = self.settings.concurrency
        self._reserve = max(1, concurrency // 4) if self._slow_after > 0 else 0
        self._pool = cf.ThreadPoolExecutor(
            max_workers=concurrency + self._reserve, thread_name_prefix="outbox-deliver"
        )
        self._queue: collections.deque[_Task] = collections.deque()
        self._sending: dict[str, set[_Task]] = collections.defaultdict(set)
        self._out = 0  # sends in progress, all adapters
        self._queue_lock = threading.Lock()
        # Passes whose slow sends are left to a collector thread (``run()`` only).
        self._detached: list[_Pass] = []
        self._collectors: list[threading.Thread] = []
        # Write-behind (``run()`` on PostgreSQL): the pass's last batch, being written
        # on the recorder thread while the loop claims again. SQLite's writes run in
        # this process under the file's one write lock: there it would only move the wait.
        self._write_behind = engine.dialect.name == "postgresql" and self.settings.record_behind
        self._recorder = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="outbox-record")
        self._recording: cf.Future[None] | None = None
        self._stop = threading.Event()
        self._stop_requested_at: float | None = None
        self._wake = wakeup.Waker()
        # Set while a LISTEN connection is up: every commit of a row then wakes us.
        self._listening = threading.Event()
        self._more_due = False  # the last pass's select was full: more may be due now
        self._in_flight = 0
        self._in_flight_lock = threading.Lock()
        self._holding: list[list[_Task]] = []  # the passes in progress, for lease renewal
        # Refuse a send this close to the lease's end: the request takes time to leave.
        self._lease_margin = self.settings.lease_duration.total_seconds() / 10
        self.late_results = 0  # results that arrived after the lease was lost
        self.released = 0  # rows given back at shutdown
        self.abandoned_sends = 0  # sends still running when their rows were released
        # Providers that forget keys: the claim and every decision read their window.
        self._key_retention: dict[str, float] = {
            adapter.name: adapter.capabilities.key_retention_seconds
            for adapter in registry
            if adapter.capabilities.key_retention_seconds is not None
        }

    # --- the retry budget and the breaker, per adapter -----------------------

    def budget(self, adapter: str) -> retry.RetryBudget:
        found = self._budgets.get(adapter)
        if found is None:
            s = self.settings
            found = retry.RetryBudget(
                s.retry_budget_ratio, s.retry_budget_window, s.retry_budget_min_per_window
            )
            self._budgets[adapter] = found
        return found

    def breaker(self, adapter: str) -> retry.CircuitBreaker:
        found = self._breakers.get(adapter)
        if found is None:
            s = self.settings
            found = retry.CircuitBreaker(
                s.breaker_failure_threshold,
                s.breaker_cooldown,
                s.breaker_cooldown_max,
                # A probe normally answers within its lease; one that has not is lost.
                probe_timeout=s.lease_duration,
            )
            self._breakers[adapter] = found
        return found

    def _admit(self, candidate: store.Candidate, now: datetime) -> bool:
        """May this due row be sent now? Called inside the claim transaction."""
        if not self.breaker(candidate.adapter).allow(now):
            return False
        budget = self.budget(candidate.adapter)
        if candidate.attempts == 0:
            budget.record_first(now)
            return True
        if budget.try_retry(now):
            return True
        metrics.RETRY_BUDGET_REFUSALS.labels(candidate.adapter).inc()
        if candidate.adapter not in self._budget_empty:
            self._budget_empty.add(candidate.adapter)
            logger.warning(
                "retry budget spent: retries wait for first attempts or the window to pass",
                extra={"adapter": candidate.adapter, "worker": self.worker_id},
            )
        # The breaker's probe, if this was one, did not go out. Only this thread takes
        # probes (``allow``), so no other probe can have been taken since ours.
        self.breaker(candidate.adapter).release_probe()
        return False

    def _claim_params(self, now: datetime | None) -> store.ClaimParams:
        at = now or schema.utcnow()
        paused = frozenset(name for name, b in self._breakers.items() if b.paused(at))
        # An adapter with a slow runner's share of sends still out from passes that
        # stopped waiting for them: claiming more of its rows would only queue them.
        paused |= self._saturated()
        spent = set()
        for name, budget in self._budgets.items():
            if budget.available(at) > 0:
                self._budget_empty.discard(name)
            else:
                spent.add(name)
        return store.ClaimParams(
            owner=self.worker_id,
            lease=self.settings.lease_duration,
            limit=self.settings.claim_batch_size,
            now=now,
            paused_adapters=paused,
            no_retry_adapters=frozenset(spent),
            # ``_admit`` takes every first attempt of an adapter whose breaker is closed.
            unsettled_adapters=frozenset(
                name
                for name, b in self._breakers.items()
                if b.state is not retry.BreakerState.CLOSED
            ),
            key_retention=self._key_retention,
        )

    # --- one pass ----------------------------------------------------------------

    def _saturated(self) -> frozenset[str]:
        """Adapters with at least ``concurrency`` tasks unfinished in detached passes."""
        with self._in_flight_lock:
            if not self._detached:
                return frozenset()
            counts = collections.Counter(
                task.effect.adapter
                for one in self._detached
                for task in one.tasks
                if not task.finished
            )
        limit = self.settings.concurrency
        return frozenset(name for name, count in counts.items() if count >= limit)

    def run_once(self, now: datetime | None = None) -> int:
        """Claim one batch, deliver it, record the results. Returns the rows handled."""
        return self._run_pass(now, detach=False)

    def _run_pass(
        self,
        now: datetime | None,
        *,
        detach: bool,
        behind: bool = False,
        pinned: db.Pinned | None = None,
    ) -> int:
        """One pass. ``detach`` (the ``run()`` loop): once only slow sends are left, stop
        waiting for them (a collector thread records them) so the next claim can serve
        the other adapters. ``behind``: the last batch of results is written by the
        recorder thread (``_record_behind``) and the pass returns without waiting.
        ``pinned``: the connection the claim runs on (``run``'s loop), else the pool's."""
        if self._stop.is_set():
            return 0
        # Read before the claim, so the lease surely lasts until this + lease.
        claim_began = time.monotonic()
        params = self._claim_params(now)
        claim = store.claim_due(self.engine, params, self._admit, pinned=pinned)
        self._more_due = len(claim.effects) + claim.expired + claim.skipped >= params.limit
        if claim.expired:
            logger.info(
                "settled rows past their deadline or key window without sending",
                extra={"count": claim.expired, "worker": self.worker_id},
            )
        if not claim.effects:
            return claim.expired
        assert claim.now is not None
        started = time.monotonic()
        held_until = claim_began + self.settings.lease_duration.total_seconds()
        tasks = [self._task(effect, started, held_until) for effect in claim.effects]
        with self._in_flight_lock:
            self._in_flight += len(tasks)
            self._holding.append(tasks)
        handed_off = False
        try:
            faults.point("dispatch.after_attempt_commit")
            # Only under a backlog (a full claim) does a next claim follow at once: a
            # short pass records in line, and the loop may then sleep.
            handed_off = self._deliver_and_record(
                tasks, claim.now, fixed_now=now, detach=detach, behind=behind and self._more_due
            )
        finally:
            if not handed_off:
                self._done_with(tasks)
        return len(tasks) + claim.expired

    def _done_with(self, tasks: list[_Task]) -> None:
        with self._in_flight_lock:
            self._in_flight -= len(tasks)
            self._holding.remove(tasks)

    def _task(self, effect: store.Claimed, started: float, held_until: float) -> _Task:
        try:
            adapter: adapters.Adapter | None = self.adapters.get(effect.adapter)
        except adapters.UnknownAdapter:
            adapter = None
        return _Task(effect, adapter, started, held_until)

    def _deliver_and_record(
        self,
        tasks: list[_Task],
        claimed_at: datetime,
        fixed_now: datetime | None,
        *,
        detach: bool = False,
        behind: bool = False,
    ) -> bool:
        """Send and record ``tasks``. True when another thread finishes recording them: a
        collector (the pass stopped waiting for its slow sends, ``detach``) or the
        recorder (its last batch is written behind, ``behind``); False when all is recorded."""
        # At most ``concurrency`` runners take tasks from one queue and hand
        # results back on the pass's queue: one pool submission per runner rather
        # than one future per effect (profiled: the per-effect futures and waits
        # cost more than a no-op delivery). A slow delivery holds only its runner.
        results: queue.SimpleQueue[tuple[_Task, object]] = queue.SimpleQueue()
        for task in tasks:
            task.results = results
        with self._queue_lock:
            self._queue.extend(tasks)
        for _ in range(min(self.settings.concurrency + self._reserve, len(tasks))):
            self._pool.submit(self._runner)
        one = _Pass(tasks, results, claimed_at, fixed_now, set(tasks), time.monotonic())
        if self._collect(one, detach=detach, behind=behind):
            return one.behind
        # Only slow sends are left: a collector records them; the loop claims again,
        # leaving out the adapters whose share of the runners they fill.
        with self._in_flight_lock:
            self._detached.append(one)
        logger.info(
            "slow sends left to finish in the background",
            extra={
                "count": len(one.waiting),
                "adapters": sorted({t.effect.adapter for t in one.waiting}),
                "worker": self.worker_id,
            },
        )
        collector = threading.Thread(
            target=self._collect_detached, args=(one,), name="outbox-collect", daemon=True
        )
        self._collectors = [c for c in self._collectors if c.is_alive()]
        self._collectors.append(collector)
        collector.start()
        return True

    def _runner(self) -> None:
        """A pool thread: take runnable tasks from the shared queue until none is left."""
        while True:
            with self._queue_lock:
                task = self._next_runnable()
                if task is None:
                    return
                task.picked = time.monotonic()
                self._sending[task.effect.adapter].add(task)
                self._out += 1
            try:
                outcome: object = self._deliver(task)
            except BaseException as exc:  # noqa: BLE001 - a crash window: re-raised by the pass
                outcome = _Raised(exc)
            finally:
                with self._queue_lock:
                    self._sending[task.effect.adapter].discard(task)
                    self._out -= 1
            assert task.results is not None
            task.results.put((task, outcome))

    def _next_runnable(self) -> _Task | None:
        """The next task to send (under ``_queue_lock``): the oldest queued while fewer than
        ``concurrency`` sends are out; past that, within the reserve, the oldest whose
        adapter has no slow send and fewer than ``_reserve`` sends out.

        A task skipped here is taken later by a runner that finishes a send: a send out
        means a runner that will look again.
        """
        if not self._queue:
            return None
        if self._out < self.settings.concurrency:
            return self._queue.popleft()
        if self._out >= self.settings.concurrency + self._reserve:
            return None
        # The reserve: for an adapter with no slow send and fewer sends out than the
        # reserve itself (so the adapter that fills ``concurrency`` cannot take it too).
        slow = self._slow_adapters(time.monotonic())
        for index, task in enumerate(self._queue):
            adapter = task.effect.adapter
            if adapter not in slow and len(self._sending[adapter]) < self._reserve:
                del self._queue[index]
                return task
        return None

    def _slow_adapters(self, now: float) -> set[str]:
        """Adapters with a send out longer than ``slow_send_after`` (under ``_queue_lock``)."""
        return {
            adapter
            for adapter, sending in self._sending.items()
            if any(now - t.picked >= self._slow_after for t in sending)
        }

    def _only_slow_left(self, one: _Pass) -> bool:
        """Has the pass waited ``slow_send_after`` for its last results, and is each send
        it waits for out that long or queued behind its adapter's slow sends?"""
        if self._slow_after <= 0:
            return False
        now = time.monotonic()
        if now - one.progress < self._slow_after:
            return False
        with self._queue_lock:
            slow = self._slow_adapters(now)
        return all(task.effect.adapter in slow for task in one.waiting)

    def _collect(self, one: _Pass, *, detach: bool, behind: bool = False) -> bool:
        """Wait for the pass's results and record them in batches. True when done; False
        when ``detach`` and only slow sends are left (the pass's state is kept in ``one``).
        ``behind``: the last batch, when nothing was withdrawn, goes to the recorder."""

        def at(task: _Task) -> datetime:
            if one.fixed_now is not None:
                return one.fixed_now
            return one.claimed_at + timedelta(
                seconds=(task.done or time.monotonic()) - task.started
            )

        while one.waiting:
            done = _take(one.results, self._wait_timeout(one.oldest))
            if done:
                one.progress = time.monotonic()
            sent: collections.Counter[tuple[str, str]] = collections.Counter()
            for task, outcome in done:
                one.waiting.discard(task)
                task.finished = True
                if isinstance(outcome, _Raised):
                    with self._queue_lock:  # nothing more of this pass leaves
                        self._queue = collections.deque(
                            t for t in self._queue if t.results is not one.results
                        )
                    raise outcome.error
                if outcome is _WITHDRAWN:
                    one.withdrawn.append(task)
                    continue
                assert isinstance(outcome, _Result)
                if task.done is not None:  # sent: counted here, off the runners' threads
                    adapter = task.effect.adapter
                    sent[adapter, outcome.outcome.value] += 1
                    seconds = task.done - task.started
                    metrics.labelled(metrics.ATTEMPT_SECONDS, adapter).observe(seconds)
                one.buffer.append(self._finish(task, outcome, at(task)))
                one.oldest = one.oldest if one.oldest is not None else time.monotonic()
            self._count_deliveries(sent)
            if one.buffer and (
                not one.waiting
                or len(one.buffer) >= self.flush_size
                or (one.oldest is not None and time.monotonic() - one.oldest >= self.flush_after)
            ):
                if behind and not one.waiting and not one.withdrawn:
                    self._record_behind(one.buffer, one.tasks)
                    one.behind = True
                else:
                    self._record(one.buffer)
                one.buffer, one.oldest = [], None
            if one.waiting and self._grace_over():
                self._record(one.buffer)
                one.buffer = []
                left = [task for task in one.tasks if task in one.waiting]
                for task in left:
                    task.finished = True
                self._release(left, one.withdrawn, one.fixed_now, one.claimed_at)
                return True
            if detach and one.waiting and not one.buffer and self._only_slow_left(one):
                return False
        if one.withdrawn:
            self._release([], one.withdrawn, one.fixed_now, one.claimed_at)
        return True

    def _collect_detached(self, one: _Pass) -> None:
        """A collector thread: the rest of a detached pass, then wake the loop (its
        adapters may be claimed again)."""
        try:
            self._collect(one, detach=False)
        except Exception:  # the leases protect the rows, as after a failed pass
            logger.exception("recording slow sends failed", extra={"worker": self.worker_id})
        except BaseException:  # a crash window (tests): the rows' leases cover it
            logger.exception("slow sends abandoned", extra={"worker": self.worker_id})
        finally:
            for task in one.tasks:
                task.finished = True
            with self._in_flight_lock:
                self._detached.remove(one)
            self._done_with(one.tasks)
            self._wake.set()

    def _wait_timeout(self, oldest: float | None) -> float:
        timeout = 0.05
        if oldest is not None:
            timeout = max(0.0, min(timeout, oldest + self.flush_after - time.monotonic()))
        if self._stop_requested_at is not None:
            left = self._stop_requested_at + self.settings.shutdown_grace.total_seconds()
            timeout = max(0.0, min(timeout, left - time.monotonic()))
        return timeout

    def _grace_over(self) -> bool:
        started = self._stop_requested_at
        return (
            started is not None
            and time.monotonic() >= started + self.settings.shutdown_grace.total_seconds()
        )

    def _deliver(self, task: _Task) -> _Result | object:
        """Runs on a pool thread: one send, classified. Never raises for the adapter's sake."""
        with task.lock:
            if self._stop.is_set() or task.withdrawn:
                # Shutting down: a request that has not left must not leave now.
                task.withdrawn = True
                return _WITHDRAWN
            if time.monotonic() > task.held_until - self._lease_margin:
                # This worker was paused or starved between the claim and the send:
                # the lease may have run out, the reconciler may have taken the row
                # and a lookup may have found nothing. Sending now could be a
                # second effect at a provider that ignores keys. Not sent; the
                # fenced finish decides whether the row is still ours to reschedule.
                return _Result(
                    AttemptOutcome.NOT_SENT,
                    False,
                    error="not sent: the lease could have run out before the request left",
                    lease_lapsed=True,
                )
            task.handed = True
        result = self._send(task)
        task.done = time.monotonic()
        faults.point("dispatch.after_send_before_finish")
        return result

    def _count_deliveries(self, sent: collections.Counter[tuple[str, str]]) -> None:
        """Count sends where their results are taken in, not on the runners that sent them,
        one ``inc`` per adapter and outcome of each batch taken.

        The counter's and the histogram's locks are shared: taken by every runner after
        every send, they cost a one-process drain with a no-op adapter 13% (interleaved
        runs, medians of 3: 8,062 effects/s counting on the runners, 9,112 here)."""
        for (adapter, outcome), count in sent.items():
            metrics.labelled(metrics.DELIVERIES, adapter, outcome).inc(count)

    def _send(self, task: _Task) -> _Result:
        effect = task.effect
        if task.adapter is None:
            return _Result(
                AttemptOutcome.ADAPTER_ERROR,
                False,
                error=f"no adapter named {effect.adapter!r} is configured in this dispatcher",
            )
        try:
            payload = json.loads(effect.payload)
        except ValueError as exc:
            return _Result(AttemptOutcome.ADAPTER_ERROR, False, error=f"bad payload: {exc}")
        if not isinstance(payload, dict):
            return _Result(
                AttemptOutcome.ADAPTER_ERROR, False, error="bad payload: not a JSON object"
            )
        request = adapters.DeliveryRequest(
            effect_id=effect.id,
            effect_key=effect.effect_key,  # the stored key, on every attempt, and no other
            tenant=effect.tenant,
            operation_id=effect.operation_id,
            effect=effect.effect,
            payload=payload,
            attempt=effect.attempt_no,
        )
        try:
            result = task.adapter.deliver(request)
        except adapters.AdapterError as exc:
            # The protocol: an AdapterError is raised only before anything was sent.
            return _Result(AttemptOutcome.ADAPTER_ERROR, False, error=_short(exc))
        except Exception as exc:  # noqa: BLE001 - a bug in an adapter fails its row, not the batch
            # Outside the protocol we cannot know whether bytes left: assume they may have.
            return _Result(
                AttemptOutcome.AMBIGUOUS,
                True,
                error=f"adapter raised {type(exc).__name__}: {_short(exc)}",
            )
        return _Result(
            _OUTCOMES[result.outcome],
            result.may_have_happened,
            status_code=result.status_code,
            provider_ref=result.provider_ref,
            retry_after=result.retry_after,
            error=result.error,
        )

    def _finish(self, task: _Task, result: _Result, at: datetime) -> store.Finish:
        effect = task.effect
        caps = task.adapter.capabilities if task.adapter is not None else None
        provider_ref, error = result.provider_ref, result.error
        if result.outcome is AttemptOutcome.DELIVERED:
            # after_attempt's answer to every delivery: no retry to time, no key window.
            decision = policy.DELIVERED
        else:
            honours = caps is not None and caps.honours_idempotency_keys
            retry_at = self.backoff.retry_at(
                now=at, attempts=effect.attempt_no, retry_after=result.retry_after
            )
            key_expires_at = policy.key_expires_at(
                effect.key_first_sent_at, caps.key_retention_seconds if caps is not None else None
            )
            decision = policy.after_attempt(
                outcome=result.outcome,
                may_have_happened=result.may_have_happened,
                honours_keys=honours,
                maybe_sent_before=effect.maybe_sent,
                attempts=effect.attempt_no,
                max_attempts=self.settings.max_attempts,
                retry_at=retry_at,
                deadline_at=effect.deadline_at,
                key_expires_at=key_expires_at,
            )
            if (
                decision.status is S.OUTCOME_UNKNOWN
                and honours
                and not policy.key_window_open(retry_at, key_expires_at)
            ):
                error = (
                    f"{error}; {policy.KEY_RETENTION_PASSED}"
                    if error
                    else policy.KEY_RETENTION_PASSED
                )
        if decision.status is S.SUCCEEDED and not provider_ref:
            # The schema needs a reference for a success; say where this one came from.
            provider_ref = store.NO_REFERENCE_MARKER.format(status_code=result.status_code)
            error = f"the provider confirmed without a reference; recorded {provider_ref!r}"
        next_lookup_at = None
        if decision.status is S.OUTCOME_UNKNOWN:
            settle = caps.lookup_settle_seconds if caps is not None else 0.0
            next_lookup_at = at + timedelta(seconds=settle)
        self._observe(effect, result, decision, at)
        return store.Finish(
            effect_id=effect.id,
            fence=effect.fence,
            attempt_no=effect.attempt_no,
            at=at,
            outcome=result.outcome,
            decision=decision,
            status_code=result.status_code,
            error=error,
            provider_ref=provider_ref,
            attempt_provider_ref=result.provider_ref,
            next_lookup_at=next_lookup_at,
        )

    def _observe(
        self, effect: store.Claimed, result: _Result, decision: policy.Decision, at: datetime
    ) -> None:
        """Feed the breaker and the counters; log what an operator should see."""
        name = effect.adapter
        breaker = self.breaker(name)
        if result.lease_lapsed:
            pass  # says nothing about the provider
        elif result.outcome in _PROVIDER_FAILURES:
            if breaker.record_failure(at):
                metrics.BREAKER_OPEN.labels(name).set(1)
                logger.warning(
                    "circuit breaker open: %s paused for %.1fs",
                    name,
                    breaker.cooldown.total_seconds(),
                    extra=self._context(effect, result),
                )
        elif result.outcome is not AttemptOutcome.ADAPTER_ERROR:
            if effect.attempt_no > 1:
                # The provider answers retries again: let the next one go now.
                self.budget(name).record_answered_retry(at)
            if breaker.record_success(at):
                metrics.BREAKER_OPEN.labels(name).set(0)
                logger.info(
                    "circuit breaker closed: %s answers again",
                    name,
                    extra=self._context(effect, result),
                )
        if decision.status is S.PENDING:
            metrics.RETRIES.labels(name).inc()
        if result.outcome is AttemptOutcome.ADAPTER_ERROR:
            logger.warning("adapter error: %s", result.error, extra=self._context(effect, result))
        elif decision.status is S.OUTCOME_UNKNOWN:
            logger.warning(
                "outcome unknown: %s", decision.reason.value, extra=self._context(effect, result)
            )
        elif logger.isEnabledFor(logging.INFO):  # its context costs more than a no-op send
            # One line per attempt, ids only: never the payload, never a credential.
            logger.info(
                "attempt %d %s: effect %s",
                effect.attempt_no,
                result.outcome.value,
                decision.status.value,
                extra=self._context(effect, result),
            )

    def _context(self, effect: store.Claimed, result: _Result) -> dict[str, object]:
        """An attempt's log fields: ids only, never the payload, never a credential."""
        return {
            "tenant": effect.tenant,
            "operation_id": effect.operation_id,
            "effect_id": effect.id,
            "attempt": effect.attempt_no,
            "adapter": effect.adapter,
            "outcome": result.outcome.value,
            "status_code": result.status_code,
            "worker": self.worker_id,
        }

    def _record(self, finishes: list[store.Finish]) -> None:
        if not finishes:
            return
        recorded = store.finish_attempts(self.engine, finishes)
        if recorded.late:
            self.late_results += len(recorded.late)
            logger.warning(
                "late results kept on their attempt rows only: the lease had been lost",
                extra={"count": len(recorded.late), "worker": self.worker_id},
            )

    def _record_behind(self, finishes: list[store.Finish], tasks: list[_Task]) -> None:
        """Give a pass's last batch to the recorder thread and return at once.

        At most one batch is behind: this first waits for the one before. Until its
        batch commits, a pass's rows stay in flight under leases this worker renews:
        should the process die meanwhile, they are settled when those leases end,
        as rows whose results were never written.
        """
        self._settle_recording()
        self._recording = self._recorder.submit(self._write_behind_batch, finishes, tasks)

    def _write_behind_batch(self, finishes: list[store.Finish], tasks: list[_Task]) -> None:
        """The recorder thread: one pass's last batch."""
        try:
            self._record(finishes)
        except Exception:  # the leases protect the rows, as after a failed pass
            logger.exception("recording results failed", extra={"worker": self.worker_id})
        finally:
            self._done_with(tasks)

    def _settle_recording(self) -> None:
        """Wait for the batch being written behind, if any (a crash in it is raised here)."""
        recording, self._recording = self._recording, None
        if recording is not None:
            recording.result()

    def _release(
        self,
        running: list[_Task],
        withdrawn: list[_Task],
        fixed_now: datetime | None,
        claimed_at: datetime,
    ) -> None:
        items = []
        for task in running:
            with task.lock:
                if not task.handed:
                    task.withdrawn = True
            withdrawn_now = task.withdrawn
            if withdrawn_now:
                withdrawn.append(task)
            else:
                items.append(self._release_item(task, handed=True))
                self.abandoned_sends += 1
        for task in withdrawn:
            items.append(self._release_item(task, handed=False))
            # If it was the half-open breaker's probe, it never went out: let another.
            self.breaker(task.effect.adapter).release_probe()
        now = fixed_now or claimed_at + timedelta(
            seconds=time.monotonic() - min(t.started for t in running + withdrawn)
        )
        recorded = store.release(
            self.engine, items, now=now, max_attempts=self.settings.max_attempts
        )
        self.released += len(recorded.recorded)
        logger.info(
            "released rows at shutdown",
            extra={"count": len(recorded.recorded), "worker": self.worker_id},
        )

    def _release_item(self, task: _Task, *, handed: bool) -> store.Release:
        caps = task.adapter.capabilities if task.adapter is not None else None
        return store.Release(
            effect=task.effect,
            handed_to_adapter=handed,
            honours_keys=caps is not None and caps.honours_idempotency_keys,
            lookup_settle_seconds=caps.lookup_settle_seconds if caps is not None else 0.0,
            key_retention_seconds=caps.key_retention_seconds if caps is not None else None,
        )

    # --- leases ----------------------------------------------------------------------

    def renew_leases(self, now: datetime | None = None) -> int:
        """Extend this worker's live leases (a slow delivery keeps its row)."""
        began = time.monotonic()
        renewed = store.renew_leases(
            self.engine, self.worker_id, self.settings.lease_duration, now=now
        )
        # A lease that was still live when the renewal began now lasts until
        # began + lease; one that may have lapsed was not revived.
        with self._in_flight_lock:
            for task in itertools.chain.from_iterable(self._holding):
                if began <= task.held_until:
                    task.held_until = began + self.settings.lease_duration.total_seconds()
        if renewed:
            logger.debug("renewed leases", extra={"count": renewed, "worker": self.worker_id})
        return renewed

    def _renew_job(self) -> None:
        if self._in_flight <= 0:
            return  # nothing held: skip the write
        try:
            self.renew_leases()
        except Exception:  # a blip must not kill the job; the next run tries again
            logger.exception("lease renewal failed", extra={"worker": self.worker_id})

    # --- the loop -----------------------------------------------------------------------

    def _listen_wanted(self) -> bool:
        """LISTEN needs a session of its own: through a transaction pooler only with a
        direct ``OUTBOX_LISTEN_URL``; without one, the loop polls (``poll_interval``)."""
        s = self.settings
        return s.database_pooler != "transaction" or s.listen_url is not None

    def request_stop(self) -> None:
        """Stop claiming; in-flight deliveries get ``shutdown_grace``, then are released."""
        if self._stop_requested_at is None:
            self._stop_requested_at = time.monotonic()
        self._stop.set()
        self._wake.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def wake(self) -> None:
        """Make a waiting ``run()`` claim now (new rows committed)."""
        self._wake.set()

    def run(self, *, once: bool = False, ready: threading.Event | None = None) -> int:
        """Loop over ``run_once`` until ``request_stop()``; ``once``: until nothing is due.

        Returns the number of rows handled.
        """
        from apscheduler.schedulers.background import BackgroundScheduler

        s = self.settings
        scheduler = BackgroundScheduler(timezone=UTC)
        job = {"max_instances": 1, "coalesce": True, "misfire_grace_time": None}
        scheduler.add_job(
            self._renew_job,
            "interval",
            seconds=s.lease_renew_interval.total_seconds(),
            id="renew_leases",
            **job,
        )
        if not once:
            scheduler.add_job(
                self._wake.set,
                "interval",
                seconds=s.poll_interval.total_seconds(),
                id="poll",
                **job,
            )
        scheduler.start()
        listener = None
        if not once and self.engine.dialect.name == "postgresql" and self._listen_wanted():
            listener = wakeup.Listener(
                db.libpq_params(self.engine, s.listen_url),
                schema.NOTIFY_CHANNEL,
                woken=self._wake,
                listening=self._listening,
                worker=self.worker_id,
            )
        # With LISTEN, creates notify only while some dispatcher sleeps (the gate).
        gate = None if listener is None else wakeup.Gate(self.engine, worker=self.worker_id)
        # The loop's claim runs on a connection it holds (PostgreSQL), not the pool's.
        pinned = db.Pinned(self.engine) if self.engine.dialect.name == "postgresql" else None
        self._wake.open()
        handled = 0
        failures = 0
        if ready is not None:
            ready.set()
        try:
            while not self._stop.is_set():
                self._wake.clear()
                if listener is not None:
                    listener.drain()  # this pass covers the rows they announced
                try:
                    count = self._run_pass(
                        None, detach=not once, behind=self._write_behind, pinned=pinned
                    )
                    failures = 0
                except Exception:
                    # The database blinked (or a bug hit one pass): keep the
                    # process, back off, and try again; the leases protect rows.
                    failures += 1
                    logger.exception("dispatch pass failed", extra={"worker": self.worker_id})
                    self._stop.wait(min(s.poll_interval.total_seconds() * failures, 30.0))
                    continue
                handled += count
                if gate is not None and self._more_due:
                    gate.count_out()  # a backlog: we will not sleep, nobody need notify us
                # Go again at once when more may be due: the last select was full,
                # or nothing else would tell us of a row committed during the pass.
                # While LISTEN is up such a row's NOTIFY is waiting on the socket,
                # so a short pass waits for it instead of running an empty select.
                if count and (self._more_due or not self._listening.is_set()):
                    continue
                if self._recording is not None:
                    # Before sleeping (or ending ``once``): the batch written behind may
                    # have let rows go (a group's next row, a retry due now). Look again.
                    self._settle_recording()
                    continue
                if once:
                    break
                # One more pass before sleeping once counted in: the creates that saw
                # no sleeper, and so sent no NOTIFY, have committed by now. A new
                # LISTEN connection is a new backend pid: count in again under it.
                pid = None if listener is None else listener.backend_pid
                if (
                    gate is not None
                    and pid is not None
                    and gate.pid != pid
                    and self._listening.is_set()
                    and gate.count_in(pid)
                ):
                    continue
                # A wake-up, a NOTIFY on the LISTEN connection, or the poll interval
                # (while LISTEN is down, its next attempt if that comes first).
                timeout = s.poll_interval.total_seconds()
                also = None
                if listener is not None:
                    also = listener.fileno()
                    retry_in = listener.retry_in()
                    if retry_in is not None:
                        timeout = min(timeout, retry_in)
                self._wake.wait(timeout, also)
        finally:
            if self._stop_requested_at is None:
                self._stop_requested_at = time.monotonic()  # the grace counts from here
            self._stop.set()
            # Slow sends still out finish (or are released) within the shutdown grace;
            # their leases are renewed until then. The batch written behind commits.
            for collector in list(self._collectors):
                collector.join()
            self._settle_recording()
            scheduler.shutdown(wait=False)
            if gate is not None:
                gate.count_out()
            if listener is not None:
                listener.close()
            if pinned is not None:
                pinned.close()
            self._wake.close()
        return handled

    def close(self) -> None:
        """Stop the delivery threads. Deliveries still running are not waited for."""
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._recorder.shutdown(wait=False)


def _short(exc: BaseException, limit: int = 300) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


# --- the command ------------------------------------------------------------------------


def cli_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--once", action="store_true", help="deliver every row due now, then exit")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=None,
        metavar="K",
        help="deliveries at once (default OUTBOX_CONCURRENCY, 8)",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=None,
        metavar="N",
        help="rows claimed per transaction (default OUTBOX_CLAIM_BATCH_SIZE, 100)",
    )
    parser.add_argument(
        "--worker-id",
        default=None,
        metavar="ID",
        help="name in leases and attempt rows (default host:pid:random)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve /metrics, /healthz, /readyz here; 0: none "
        "(default OUTBOX_DISPATCHER_METRICS_PORT, 0)",
    )
    parser.add_argument(
        "--log-format",
        choices=["text", "json"],
        default=None,
        help="log lines as text or one JSON object each (default OUTBOX_LOG_FORMAT, text)",
    )


def cli_run(args: argparse.Namespace) -> int:
    overrides: dict[str, Any] = {}
    if args.concurrency is not None:
        overrides["concurrency"] = args.concurrency
    if args.batch is not None:
        overrides["claim_batch_size"] = args.batch
    if args.metrics_port is not None:
        overrides["dispatcher_metrics_port"] = args.metrics_port
    if args.log_format is not None:
        overrides["log_format"] = args.log_format
    config = settings.load(**overrides)
    logs.configure(config.log_format, config.log_level)
    logging.getLogger("alembic").setLevel(logging.WARNING)  # the schema check is not news
    app = apps.from_args(args)
    # The app's adapters (OUTBOX_ADAPTERS, when set, replaces the app's file), first:
    # a broken file stops us before the database is touched.
    registry: adapters.Registry | None = app.build_adapters(config.adapters)
    engine = db.create_engine(config, url=args.database_url)
    dispatcher: Dispatcher | None = None
    try:
        db.check_schema(engine)
        app.check_schema(engine)
        assert registry is not None
        dispatcher = Dispatcher(engine, registry, config, worker_id=args.worker_id)
        for name in registry.names():
            # A series from the start: "absent" and "closed" look different on a dashboard.
            metrics.BREAKER_OPEN.labels(name).set(0)
        if config.dispatcher_metrics_port:
            metrics.serve(engine, config.metrics_host, config.dispatcher_metrics_port)
            logger.info(
                "metrics on http://%s:%d/metrics",
                config.metrics_host,
                config.dispatcher_metrics_port,
                extra={"worker": dispatcher.worker_id},
            )
        stopper = dispatcher

        def on_signal(signum: int, _frame: FrameType | None) -> None:
            logger.info(
                "%s: stopping; in-flight deliveries have %.0fs",
                signal.Signals(signum).name,
                config.shutdown_grace.total_seconds(),
                extra={"worker": stopper.worker_id},
            )
            stopper.request_stop()

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        logger.info(
            "dispatcher started on %s (adapters: %s)",
            db.database_label(engine),
            ", ".join(registry.names()),
            extra={"worker": dispatcher.worker_id},
        )
        try:
            handled = dispatcher.run(once=args.once)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        logger.info(
            "dispatcher stopped",
            extra={"count": handled, "worker": dispatcher.worker_id},
        )
    finally:
        if dispatcher is not None:
            dispatcher.close()
        if registry is not None:
            registry.close()
        engine.dispose()
    if dispatcher.abandoned_sends:
        # Their rows are released already. A thread still blocked in a send
        # would otherwise hold the process at exit (concurrent.futures joins
        # its workers), and a supervisor would wait out the provider's timeout.
        logging.shutdown()
        os._exit(0)
    return 0
