"""The load generator: calls of the tool boundary over HTTP, from a fixed, seeded plan.

A plan is a list of jobs over a fixed set of keys, built from the seed alone,
so the same seed asks for the same things in the same order (the timing, and
so which call meets which kill, is the only thing that varies):

- ``first``: the first call of a valid key;
- ``concurrent``: the first call of a valid key, made by 2-3 threads at once;
- ``resubmit``: a later call with the same key and the same arguments (a
  caller whose reply was lost), sometimes from 2 threads at once;
- ``changed``: a later call with the same key and other arguments (must be
  answered 422 ``idempotency-key-reused``, and write nothing);
- ``invalid``: a call with arguments the tool refuses, on a key of its own
  (must be answered 422 ``after_fix``, and write nothing).

A later call of a key waits (bounded) for the key's first answer, so a changed
call never races the call it conflicts with. Each call goes through
``outbox.client.Client``, which retries transport errors and 5xx with the same
key; a call that still ends ``unavailable`` (the API was down for the client's
whole deadline) is made again, with the same key, up to ``RECALLS_MAX`` times.
Every answer is recorded per key, bytes included, for the checks.
"""

from __future__ import annotations

import bisect
import contextlib
import queue
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from outbox.client import Client, Outcome, Result

TOOL_PATH_CLIENT_TIMEOUT_S = 5.0
CLIENT_DEADLINE_S = 20.0
CLIENT_MAX_ATTEMPTS = 12
RECALLS_MAX = 4
FOLLOW_UP_WAIT_S = 30.0
FOLLOW_UP_DISTANCE = 24  # a later call of a key is planned at least this many jobs later

# Shares of the plan's calls, by job kind.
MIX = {"first": 0.62, "concurrent": 0.08, "resubmit": 0.14, "changed": 0.08, "invalid": 0.08}
NO_HELPDESK_SHARE = 0.05  # valid keys whose task opens no ticket (no effect)


@dataclass(frozen=True, slots=True)
class Job:
    kind: str
    key: str
    arguments: dict[str, Any]
    copies: int = 1  # threads making this call at the same moment


@dataclass
class KeyRecord:
    """Everything one key was asked and answered."""

    key: str
    valid: bool
    arguments: dict[str, Any] | None = None  # the original (valid) arguments
    first_answer: Result | None = None
    answered: threading.Event = field(default_factory=threading.Event)
    answers: list[tuple[str, Result]] = field(default_factory=list)  # (job kind, result)


@dataclass
class LoadReport:
    planned_calls: int = 0
    calls_made: int = 0
    calls_skipped: int = 0  # not made: the time bound came first
    http_attempts: int = 0  # requests on the wire, client retries included
    recalls: int = 0  # calls made again after ending unavailable
    unavailable_final: int = 0  # calls still unavailable after every re-call
    outcomes: Counter[str] = field(default_factory=Counter)
    by_kind: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0


def _valid_arguments(rng: random.Random, n: int, phase: str) -> dict[str, Any]:
    args: dict[str, Any] = {
        "subject": f"chaos {phase} #{n}: parcel {rng.randrange(10**6):06d} is late",
        "body": "x" * rng.randrange(0, 400),
        "priority": rng.choice(["low", "normal", "high"]),
    }
    if rng.random() < NO_HELPDESK_SHARE:
        args["helpdesk"] = False
    return args


def _invalid_arguments(rng: random.Random) -> dict[str, Any]:
    return rng.choice(
        [
            {"subject": ""},
            {"subject": "ok", "priority": "urgent"},
            {"subject": "ok", "colour": "red"},
            {"subject": 42},
            {"body": "no subject"},
        ]
    )


def _changed(arguments: dict[str, Any]) -> dict[str, Any]:
    changed = dict(arguments)
    changed["subject"] = arguments["subject"] + " (edited)"
    return changed


def build_plan(operations: int, seed: int, phase: str) -> tuple[list[Job], dict[str, KeyRecord]]:
    """Jobs whose calls add up to ``operations``, and the record of every key they use."""
    rng = random.Random(f"{seed}:{phase}:plan")
    jobs: list[Job] = []
    keys: dict[str, KeyRecord] = {}
    valid_at: list[int] = []  # job index of each valid key's first call, ascending
    valid_keys: list[str] = []
    calls = 0
    n = 0
    kinds, weights = zip(*MIX.items(), strict=True)
    while calls < operations:
        kind = rng.choices(kinds, weights)[0]
        older = bisect.bisect_right(valid_at, len(jobs) - FOLLOW_UP_DISTANCE)
        if kind in ("resubmit", "changed") and not older:
            kind = "first"
        left = operations - calls
        if kind == "concurrent" and left < 2:
            kind = "first"
        if kind in ("first", "concurrent"):
            n += 1
            key = f"{phase}-{seed}-{n:06d}"
            arguments = _valid_arguments(rng, n, phase)
            keys[key] = KeyRecord(key, True, arguments)
            copies = min(left, rng.choice([2, 3])) if kind == "concurrent" else 1
            jobs.append(Job(kind, key, arguments, copies))
            valid_at.append(len(jobs) - 1)
            valid_keys.append(key)
        elif kind == "invalid":
            n += 1
            key = f"{phase}-{seed}-{n:06d}-bad"
            keys[key] = KeyRecord(key, False)
            jobs.append(Job(kind, key, _invalid_arguments(rng)))
        else:
            key = valid_keys[rng.randrange(older)]
            original = keys[key].arguments
            assert original is not None
            if kind == "resubmit":
                copies = 2 if rng.random() < 0.25 and left >= 2 else 1
                jobs.append(Job(kind, key, original, copies))
            else:
                jobs.append(Job(kind, key, _changed(original)))
        calls += jobs[-1].copies
    return jobs, keys


class LoadGenerator:
    """Runs a plan with ``workers`` threads against ``base_url`` until done or ``stop_at``
    (None: until every call of the plan is made)."""

    def __init__(
        self,
        base_url: str,
        token: str,
        jobs: list[Job],
        keys: dict[str, KeyRecord],
        *,
        workers: int = 8,
        stop_at: float | None,
    ) -> None:
        self.base_url = base_url
        self.token = token
        self.jobs = jobs
        self.keys = keys
        self.workers = workers
        self.stop_at = stop_at
        self.report = LoadReport(planned_calls=sum(j.copies for j in jobs))
        self._lock = threading.Lock()
        self._queue: queue.Queue[Job] = queue.Queue()
        self.done_calls = 0  # read by the chaos thread to pace its kills
        self.started_at = 0.0

    def _client(self) -> Client:
        return Client(
            self.base_url,
            self.token,
            timeout=TOOL_PATH_CLIENT_TIMEOUT_S,
            deadline=CLIENT_DEADLINE_S,
            max_attempts=CLIENT_MAX_ATTEMPTS,
            backoff_initial=0.05,
            backoff_max=1.0,
        )

    def run(self) -> LoadReport:
        for job in self.jobs:
            self._queue.put(job)
        self.started_at = time.monotonic()
        threads = [
            threading.Thread(target=self._worker, name=f"load-{i}", daemon=True)
            for i in range(self.workers)
        ]
        for thread in threads:
            thread.start()
        if self.stop_at is None:
            for thread in threads:
                thread.join()  # each call is bounded by the client's deadline and recalls
        else:
            bound = max(0.0, self.stop_at - time.monotonic())
            bound += CLIENT_DEADLINE_S * (RECALLS_MAX + 2)
            for thread in threads:
                thread.join(max(0.1, bound))
        self.report.seconds = time.monotonic() - self.started_at
        # Whatever a stuck worker did not take is skipped, not silently lost.
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            self.report.calls_skipped += job.copies
        return self.report

    def _worker(self) -> None:
        client = self._client()
        try:
            while True:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    return
                if self.stop_at is not None and time.monotonic() >= self.stop_at:
                    with self._lock:
                        self.report.calls_skipped += job.copies
                    continue
                self._run_job(client, job)
        finally:
            client.close()

    def _run_job(self, client: Client, job: Job) -> None:
        record = self.keys[job.key]
        if job.kind in ("resubmit", "changed"):
            record.answered.wait(FOLLOW_UP_WAIT_S)
        if job.copies == 1:
            self._call(client, job)
            return
        barrier = threading.Barrier(job.copies)

        def together() -> None:
            extra = self._client()
            try:
                barrier.wait(5)
                self._call(extra, job)
            except threading.BrokenBarrierError:
                self._call(extra, job)
            finally:
                extra.close()

        helpers = [threading.Thread(target=together, daemon=True) for _ in range(job.copies - 1)]
        for helper in helpers:
            helper.start()
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(5)
        self._call(client, job)
        for helper in helpers:
            helper.join(CLIENT_DEADLINE_S * (RECALLS_MAX + 2))

    def _call(self, client: Client, job: Job) -> None:
        result = client.create_task(job.key, job.arguments)
        attempts = result.attempts
        recalls = 0
        while result.outcome is Outcome.UNAVAILABLE and recalls < RECALLS_MAX:
            # The client gave up for now; the caller's answer is to call again, same key.
            recalls += 1
            time.sleep(0.5)
            result = client.create_task(job.key, job.arguments)
            attempts += result.attempts
        record = self.keys[job.key]
        with self._lock:
            report = self.report
            report.calls_made += 1
            report.http_attempts += attempts
            report.recalls += recalls
            report.by_kind[job.kind] += 1
            report.outcomes[f"{job.kind}:{result.outcome.value}"] += 1
            if result.outcome is Outcome.UNAVAILABLE:
                report.unavailable_final += 1
            record.answers.append((job.kind, result))
            if record.first_answer is None and result.outcome is not Outcome.UNAVAILABLE:
                record.first_answer = result
            self.done_calls += 1
        if record.first_answer is not None:
            record.answered.set()
