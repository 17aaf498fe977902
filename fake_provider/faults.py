"""Fault injection for ``POST /v1/tickets``: which failure the next request gets.

A :class:`FaultPlan` answers one question per ticket-creating request: what goes
wrong this time? It holds

- a *script*: outcomes for the next N requests, consumed first, in order;
- *rates*: a probability per outcome, drawn from a seeded :class:`random.Random`
  (whatever the rates leave over is ``ok``);
- a *latency* range in milliseconds, drawn from the same generator.

Determinism is the point: every decision draws exactly two numbers from the
generator (one for the outcome, one for the latency), whether or not the script
decided the outcome. So request *i* of a run gets the same random outcome for
the same seed, and a scripted prefix does not shift the random tail.

Outcomes and where they strike relative to the commit of the ticket:

========================  =====  ======================================  ==========
outcome                   HTTP   what the client sees                    ticket?
========================  =====  ======================================  ==========
ok                        201    the ticket                              created
fail_before_commit        500    an error                                no
fail_after_commit         500    an error                                created
drop_after_commit         none   aborted connection, or a reply held     created
                                 past the client's read timeout
timeout_before_commit     504    a reply held for ``hold_seconds``       no
rate_limit                429    ``Retry-After``                         no
unavailable               503    ``Retry-After``                         no
reject                    400    a permanent refusal                     no
========================  =====  ======================================  ==========
"""

from __future__ import annotations

import random
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Outcome(StrEnum):
    """What the provider does with one ticket-creating request."""

    OK = "ok"  # the ticket is created and the 201 reply is sent
    FAIL_BEFORE_COMMIT = "fail_before_commit"  # 500, nothing stored
    FAIL_AFTER_COMMIT = "fail_after_commit"  # ticket committed, then a 500 that hides it
    DROP_AFTER_COMMIT = "drop_after_commit"  # ticket committed, then no usable reply
    TIMEOUT_BEFORE_COMMIT = "timeout_before_commit"  # hang, nothing stored, then 504
    RATE_LIMIT = "rate_limit"  # 429 with Retry-After, nothing stored
    UNAVAILABLE = "unavailable"  # 503 with Retry-After, nothing stored
    REJECT = "reject"  # 400, nothing stored: a permanent refusal


BEFORE_COMMIT: frozenset[Outcome] = frozenset(
    {
        Outcome.FAIL_BEFORE_COMMIT,
        Outcome.TIMEOUT_BEFORE_COMMIT,
        Outcome.RATE_LIMIT,
        Outcome.UNAVAILABLE,
        Outcome.REJECT,
    }
)
"""Outcomes that answer before anything is stored: no ticket, no key claimed."""

AFTER_COMMIT: frozenset[Outcome] = frozenset({Outcome.FAIL_AFTER_COMMIT, Outcome.DROP_AFTER_COMMIT})
"""Outcomes that spoil the reply after the request has been fully processed."""


class FaultSpecError(ValueError):
    """A fault plan description that cannot be used; the message names the field."""


@dataclass(frozen=True)
class FaultSpec:
    """A description of a fault plan: what the CLI flags and ``POST /_admin/faults`` set.

    ``rates`` must not include ``ok`` (it is the remainder) and must sum to at
    most 1. ``latency_min_ms``..``latency_max_ms`` is a uniform range.
    """

    rates: Mapping[Outcome, float] = field(default_factory=dict)
    script: tuple[Outcome, ...] = ()
    latency_min_ms: int = 0
    latency_max_ms: int = 0

    def validate(self) -> None:
        """Raise :class:`FaultSpecError` naming the field and the bound it breaks."""
        total = 0.0
        for outcome, rate in self.rates.items():
            if outcome is Outcome.OK:
                raise FaultSpecError("rates: 'ok' is the remainder and cannot be given a rate")
            if not 0.0 <= rate <= 1.0:
                raise FaultSpecError(f"rates.{outcome}: {rate} is outside [0, 1]")
            total += rate
        if total > 1.0 + 1e-9:
            raise FaultSpecError(f"rates: they sum to {total:g}, more than 1")
        if self.latency_min_ms < 0:
            raise FaultSpecError(f"latency_ms.min: {self.latency_min_ms} is negative")
        if self.latency_max_ms < self.latency_min_ms:
            raise FaultSpecError(
                f"latency_ms.max: {self.latency_max_ms} is below latency_ms.min "
                f"({self.latency_min_ms})"
            )

    def to_json(self) -> dict[str, Any]:
        """The shape ``POST /_admin/faults`` accepts and ``GET /_admin/faults`` returns."""
        return {
            "rates": {str(outcome): rate for outcome, rate in self.rates.items()},
            "script": [str(outcome) for outcome in self.script],
            "latency_ms": {"min": self.latency_min_ms, "max": self.latency_max_ms},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FaultSpec:
        """Parse and validate ``{"rates": {...}, "script": [...], "latency_ms": {...}}``.

        Missing parts mean "none": no rates, no script, no latency. Unknown
        top-level fields are refused so that a typo does not silently leave
        faults off.
        """
        unknown = set(data) - {"rates", "script", "latency_ms", "seed"}
        if unknown:
            raise FaultSpecError(f"unknown fields: {', '.join(sorted(unknown))}")
        raw_rates = data.get("rates") or {}
        if not isinstance(raw_rates, Mapping):
            raise FaultSpecError("rates: expected an object of outcome -> probability")
        rates: dict[Outcome, float] = {}
        for name, rate in raw_rates.items():
            outcome = parse_outcome(name, field_name="rates")
            if isinstance(rate, bool) or not isinstance(rate, int | float):
                raise FaultSpecError(f"rates.{name}: expected a number")
            rates[outcome] = float(rate)
        raw_script = data.get("script") or []
        if isinstance(raw_script, str) or not isinstance(raw_script, Sequence):
            raise FaultSpecError("script: expected a list of outcomes")
        script = tuple(parse_outcome(name, field_name="script") for name in raw_script)
        latency = data.get("latency_ms") or {}
        if isinstance(latency, int) and not isinstance(latency, bool):
            latency = {"min": latency, "max": latency}
        if not isinstance(latency, Mapping):
            raise FaultSpecError("latency_ms: expected {'min': ms, 'max': ms} or a number")
        low = latency.get("min", 0)
        high = latency.get("max", low)
        for name, value in (("min", low), ("max", high)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise FaultSpecError(f"latency_ms.{name}: expected an integer")
        spec = cls(rates=rates, script=script, latency_min_ms=low, latency_max_ms=high)
        spec.validate()
        return spec


def parse_outcome(name: object, *, field_name: str) -> Outcome:
    """Turn ``"rate_limit"`` into :attr:`Outcome.RATE_LIMIT`, or say what was wrong."""
    try:
        return Outcome(str(name))
    except ValueError:
        known = ", ".join(outcome.value for outcome in Outcome)
        raise FaultSpecError(f"{field_name}: unknown outcome {name!r} (known: {known})") from None


@dataclass(frozen=True)
class Decision:
    """The fault applied to one request: its outcome and how long to stall first."""

    index: int  # 0-based position of the request since the plan was seeded
    outcome: Outcome
    latency_ms: int
    scripted: bool  # True when the script, not the rates, chose the outcome


class FaultPlan:
    """The live, thread-safe fault plan of one provider.

    Thread-safe because tests change it from their own thread while a uvicorn
    thread serves requests.
    """

    def __init__(self, spec: FaultSpec | None = None, *, seed: int | None = None) -> None:
        self._lock = threading.Lock()
        self._spec = FaultSpec()
        self._script: deque[Outcome] = deque()
        self._seed = 0
        self._rng = random.Random(0)
        self._decisions = 0
        self._counts: dict[Outcome, int] = dict.fromkeys(Outcome, 0)
        self.replace(spec or FaultSpec(), seed=_fresh_seed() if seed is None else seed)

    @property
    def seed(self) -> int:
        """The seed in use; reported so that an unseeded run can be replayed."""
        return self._seed

    def replace(self, spec: FaultSpec, *, seed: int | None = None) -> None:
        """Install ``spec``. With ``seed``, restart the generator, so the sequence restarts.

        Without ``seed`` the generator carries on where it was: changing the
        rates mid-run does not replay earlier draws. Counts are kept (they
        describe the run, not the plan); :meth:`reset_counts` clears them.
        """
        spec.validate()
        with self._lock:
            self._spec = spec
            self._script = deque(spec.script)
            if seed is not None:
                self._seed = seed
                self._rng = random.Random(seed)
                self._decisions = 0

    def reset_counts(self) -> None:
        """Forget how many requests got each outcome."""
        with self._lock:
            self._counts = dict.fromkeys(Outcome, 0)

    def decide(self) -> Decision:
        """Choose the outcome and latency of the next request, and count it."""
        with self._lock:
            # Always two draws per decision, so the random stream lines up with
            # the request index whatever the script did.
            u_outcome = self._rng.random()
            u_latency = self._rng.random()
            scripted = bool(self._script)
            outcome = self._script.popleft() if scripted else self._pick(u_outcome)
            spec = self._spec
            span = spec.latency_max_ms - spec.latency_min_ms
            latency_ms = spec.latency_min_ms + min(int(u_latency * (span + 1)), span)
            decision = Decision(self._decisions, outcome, latency_ms, scripted)
            self._decisions += 1
            self._counts[outcome] += 1
            return decision

    def _pick(self, u: float) -> Outcome:
        # Walk the outcomes in declaration order (not dict order), so the same
        # rates given in a different order still give the same sequence.
        threshold = 0.0
        for outcome in Outcome:
            rate = self._spec.rates.get(outcome, 0.0)
            if rate <= 0.0:
                continue
            threshold += rate
            if u < threshold:
                return outcome
        return Outcome.OK

    def counts(self) -> dict[str, int]:
        """Requests per outcome applied since start or the last reset (zeros included)."""
        with self._lock:
            return {str(outcome): count for outcome, count in self._counts.items()}

    def snapshot(self) -> dict[str, Any]:
        """What ``GET /_admin/faults`` shows: the plan, what is left of the script, counts."""
        with self._lock:
            body = self._spec.to_json()
            body["script"] = [str(outcome) for outcome in self._script]
            body["seed"] = self._seed
            body["decisions"] = self._decisions
            body["counts"] = {str(outcome): count for outcome, count in self._counts.items()}
            return body


def _fresh_seed() -> int:
    # An unseeded plan still has a seed, chosen here and reported, so a
    # surprising run can be reproduced with --seed.
    return random.SystemRandom().randrange(2**32)
