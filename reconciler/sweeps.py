"""The reconciler's sweeps: each one moves rows the dispatcher cannot move itself.

Every sweep is an object built from the engine (and, where it talks to
providers, the adapter registry), the settings and a worker id, with one
method, ``run_once(now=None) -> int``, that does one pass and returns how many
rows it handled. The scheduler calls these; so do tests (with an injected
clock) and scripts::

    from reconciler import sweeps
    for sweep in sweeps.build(engine, registry, config, worker="r1"):
        print(sweep.name, sweep.run_once(now))

Every sweep is safe to run while other reconcilers run the same sweep: rows
are selected with ``FOR UPDATE SKIP LOCKED`` on PostgreSQL (SQLite serialises
writers with ``BEGIN IMMEDIATE``), and every write is a guarded UPDATE that
names the state it expects, so a row that changed underneath is left alone.

No sweep ever writes ``effect_key``: a rescheduled effect goes out again under
the key it was created with.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

import adapters
from outbox import db, schema, states
from outbox import settings as outbox_settings
from outbox.creating import retention
from outbox.delivery import policy, store
from outbox.settling import settle, webhooks

logger = logging.getLogger("reconciler.sweeps")

Clock = Callable[[], datetime]
S = states.EffectStatus

EXPIRE_BATCH_DEFAULT = 500
# Bounds one pass; whatever is left is handled at the next interval.
EXPIRE_ROUNDS_MAX = 20
DEADLINE_BATCH_DEFAULT = 200
DEADLINE_ERROR = "deadline passed before the next attempt could start"
LOOKUP_BATCH_DEFAULT = 50
# Inconclusive lookups back off exponentially from OUTBOX_LOOKUP_BACKOFF, up to this.
LOOKUP_BACKOFF_MAX = timedelta(hours=1)


class Sweep(Protocol):
    """One pass over the rows a sweep is responsible for."""

    name: str

    def run_once(self, now: datetime | None = None) -> int: ...


class _Base:
    name = "sweep"

    def __init__(
        self,
        engine: Engine,
        config: outbox_settings.Settings | None = None,
        *,
        worker: str = "reconciler",
        clock: Clock = schema.utcnow,
    ) -> None:
        self.engine = engine
        self.settings = config or outbox_settings.load()
        self.worker = worker
        self.clock = clock

    def _now(self, now: datetime | None) -> datetime:
        value = now or self.clock()
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass a timezone-aware UTC datetime")
        return value


def _context(row: Any, **more: Any) -> dict[str, Any]:
    """The ``extra=`` of a log line about one effect: the ids that find it again
    in every process's logs (the operation id above all)."""
    return {
        "tenant": row.tenant,
        "operation_id": row.operation_id,
        "effect_id": getattr(row, "effect_id", None) or row.id,
        "adapter": row.adapter,
    } | more


def _skip_locked(query: sa.Select[Any], conn: Connection) -> sa.Select[Any]:
    # PostgreSQL: a second reconciler skips rows the first is deciding on instead
    # of waiting for them and then deciding again on stale data.
    if conn.dialect.name == "postgresql":
        return query.with_for_update(skip_locked=True)
    return query


def _capabilities(registry: adapters.Registry, name: str) -> adapters.Capabilities | None:
    return registry.get(name).capabilities if name in registry else None


# --- lease expiry --------------------------------------------------------------


class ExpireLeases(_Base):
    """In-flight rows whose worker died: rescheduled with the same key when nothing
    may have been sent or the provider honours keys, otherwise ``outcome_unknown``.

    The transition itself is the store's (``store.expire_leases``), the same code
    the dispatcher's own decisions go through, so the two can never disagree.
    """

    name = "expire_leases"

    def __init__(
        self,
        engine: Engine,
        registry: adapters.Registry,
        config: outbox_settings.Settings | None = None,
        *,
        worker: str = "reconciler",
        clock: Clock = schema.utcnow,
        batch: int = EXPIRE_BATCH_DEFAULT,
    ) -> None:
        super().__init__(engine, config, worker=worker, clock=clock)
        self.registry = registry
        self.batch = batch

    def run_once(self, now: datetime | None = None) -> int:
        # Production (no injected clock): let the store read the database clock
        # on PostgreSQL, the clock the dispatchers' leases were written with, so
        # a reconciler host whose clock runs fast does not expire live leases.
        at = now if now is not None else None if self.clock is schema.utcnow else self.clock()
        handled = 0
        for _ in range(EXPIRE_ROUNDS_MAX):
            done = store.expire_leases(
                self.engine,
                capabilities_for=self._capabilities,
                max_attempts=self.settings.max_attempts,
                now=at,
                limit=self.batch,
            )
            handled += done
            if done < self.batch:
                break
        return handled

    def _capabilities(self, name: str) -> adapters.Capabilities | None:
        return _capabilities(self.registry, name)


# --- deadlines ------------------------------------------------------------------


class EnforceDeadlines(_Base):
    """Pending rows past their deadline: failed if nothing may have reached the
    provider, else ``outcome_unknown`` (for a lookup or a person, never a resend)."""

    name = "enforce_deadlines"

    def __init__(
        self,
        engine: Engine,
        config: outbox_settings.Settings | None = None,
        *,
        worker: str = "reconciler",
        clock: Clock = schema.utcnow,
        batch: int = DEADLINE_BATCH_DEFAULT,
    ) -> None:
        super().__init__(engine, config, worker=worker, clock=clock)
        self.batch = batch

    def run_once(self, now: datetime | None = None) -> int:
        at = self._now(now)
        handled = 0
        while True:
            done, seen = self._batch(at)
            handled += done
            # Every row seen left 'pending' (or was taken by someone else), so
            # this loop ends; a short batch means nothing more is due.
            if seen < self.batch:
                return handled

    def _batch(self, now: datetime) -> tuple[int, int]:
        out = schema.outbox
        with db.write(self.engine) as conn:
            rows = conn.execute(
                _skip_locked(
                    sa.select(
                        out.c.id, out.c.maybe_sent, out.c.tenant, out.c.operation_id, out.c.adapter
                    )
                    .where(out.c.status == S.PENDING, out.c.deadline_at <= now)
                    .order_by(out.c.deadline_at, out.c.id)
                    .limit(self.batch),
                    conn,
                )
            ).all()
            done = 0
            for row in rows:
                decision = policy.at_deadline(bool(row.maybe_sent))
                states.check_transition(S.PENDING, decision.status)
                values: dict[str, Any] = {
                    "status": decision.status,
                    "reason": decision.reason,
                    "maybe_sent": decision.maybe_sent,
                    "updated_at": now,
                    "lease_owner": None,
                    "lease_expires_at": None,
                    "last_error": DEADLINE_ERROR,
                }
                if decision.terminal:
                    values["finished_at"] = now
                else:
                    # outcome_unknown: the lookup sweep takes it from here (settle
                    # time, then lookup or review); start its lookup budget afresh.
                    values.update(needs_review=False, next_lookup_at=None, lookup_attempts=0)
                result = conn.execute(
                    sa.update(out)
                    .where(out.c.id == row.id, out.c.status == S.PENDING, out.c.deadline_at <= now)
                    .values(**values)
                )
                if result.rowcount:
                    done += 1
                    logger.info(
                        "effect %s past its deadline: %s (%s)",
                        row.id,
                        decision.status.value,
                        decision.reason.value,
                        extra=_context(row, sweep=self.name, outcome=decision.status.value),
                    )
        return done, len(rows)


# --- lookups --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Claim:
    effect_id: int
    adapter: str
    effect_key: str
    provider_ref: str | None
    tries: int  # lookup_attempts after our claim: the guard for applying the answer
    deadline_at: datetime
    fence: int  # as read at the claim: the settle step compares it
    tenant: str
    operation_id: str


class RunLookups(_Base):
    """Ask the provider about ``outcome_unknown`` rows, where it can answer.

    - found: succeeded, with the provider's reference;
    - authoritative not found: pending again with the same key (failed past the deadline);
    - inconclusive, or the lookup raised: tried again with backoff; after
      ``OUTBOX_LOOKUP_MAX_TRIES`` tries the row goes to the review queue;
    - the adapter has no lookup (or is not configured here): the review queue.

    A lookup is never made before the adapter's settle time has passed since the
    last attempt started or finished: a provider that indexes late would
    otherwise answer "not found" for an effect it is about to show, and we would
    send it a second time.
    """

    name = "run_lookups"

    def __init__(
        self,
        engine: Engine,
        registry: adapters.Registry,
        config: outbox_settings.Settings | None = None,
        *,
        worker: str = "reconciler",
        clock: Clock = schema.utcnow,
        batch: int = LOOKUP_BATCH_DEFAULT,
    ) -> None:
        super().__init__(engine, config, worker=worker, clock=clock)
        self.registry = registry
        self.batch = batch

    def run_once(self, now: datetime | None = None) -> int:
        at = self._now(now)
        claims, handled = self._claim(at)
        for claim in claims:
            self._look_up(claim, at)
        return handled + len(claims)

    def backoff(self, tries: int) -> timedelta:
        """How long to wait after the ``tries``-th inconclusive lookup."""
        step: timedelta = self.settings.lookup_backoff * (2 ** max(0, min(tries - 1, 20)))
        return min(step, LOOKUP_BACKOFF_MAX)

    def _claim(self, now: datetime) -> tuple[list[_Claim], int]:
        """Select due rows and take each one by moving ``next_lookup_at`` forward.

        Returns the rows to look up now and how many went straight to review.
        """
        out = schema.outbox
        claims: list[_Claim] = []
        to_review = 0
        hold = self.settings.lease_duration
        with db.write(self.engine) as conn:
            rows = conn.execute(
                _skip_locked(
                    sa.select(
                        out.c.id,
                        out.c.adapter,
                        out.c.effect_key,
                        out.c.provider_ref,
                        out.c.lookup_attempts,
                        out.c.next_lookup_at,
                        out.c.deadline_at,
                        out.c.fence,
                        out.c.tenant,
                        out.c.operation_id,
                    )
                    .where(
                        out.c.status == S.OUTCOME_UNKNOWN,
                        out.c.needs_review.is_(False),
                        sa.or_(out.c.next_lookup_at.is_(None), out.c.next_lookup_at <= now),
                    )
                    .order_by(out.c.next_lookup_at.nulls_first(), out.c.id)
                    .limit(self.batch),
                    conn,
                )
            ).all()
            settled = _last_activity(conn, [r.id for r in rows])
            for row in rows:
                # The guard every write below carries: the row is as we read it.
                guard = (
                    out.c.id == row.id,
                    out.c.status == S.OUTCOME_UNKNOWN,
                    out.c.needs_review.is_(False),
                    out.c.lookup_attempts == row.lookup_attempts,
                )
                caps = _capabilities(self.registry, row.adapter)
                if caps is None or not caps.supports_lookup:
                    error = (
                        f"adapter {row.adapter!r} is not configured in this reconciler"
                        if caps is None
                        else f"adapter {row.adapter!r} cannot look effects up"
                    )
                    result = conn.execute(
                        sa.update(out)
                        .where(*guard)
                        .values(
                            needs_review=True,
                            review_since=now,
                            reason=states.Reason.REVIEW_NO_LOOKUP,
                            next_lookup_at=None,
                            last_error=error,
                            updated_at=now,
                        )
                    )
                    to_review += result.rowcount
                    if result.rowcount:
                        logger.info(
                            "effect %s needs review: %s",
                            row.id,
                            error,
                            extra=_context(row, sweep=self.name),
                        )
                    continue
                last = settled.get(row.id)
                settle_at = last + timedelta(seconds=caps.lookup_settle_seconds) if last else None
                if settle_at is not None and now < settle_at:
                    conn.execute(sa.update(out).where(*guard).values(next_lookup_at=settle_at))
                    continue
                tries = row.lookup_attempts + 1
                # Take the row: a second reconciler finds next_lookup_at in the
                # future (or the count moved) and leaves it alone. If we die
                # mid-lookup, the row is due again when the hold runs out.
                result = conn.execute(
                    sa.update(out)
                    .where(*guard)
                    .values(lookup_attempts=tries, next_lookup_at=now + hold, updated_at=now)
                )
                if result.rowcount:
                    claims.append(
                        _Claim(
                            row.id,
                            row.adapter,
                            row.effect_key,
                            row.provider_ref,
                            tries,
                            row.deadline_at,
                            row.fence,
                            row.tenant,
                            row.operation_id,
                        )
                    )
        return claims, to_review

    def _look_up(self, claim: _Claim, now: datetime) -> None:
        adapter = self.registry.get(claim.adapter)
        try:
            answer: adapters.LookupResult | None = adapter.lookup(
                claim.effect_key, claim.provider_ref
            )
            error = answer.error if answer else None
        except Exception as exc:  # noqa: BLE001 - an adapter bug must not stop the sweep
            # The protocol says lookup() never raises for transport problems; if
            # it does anyway, that is an inconclusive answer, not a crash.
            answer = None
            error = f"{type(exc).__name__}: {exc}"[:300]
            logger.warning(
                "lookup of effect %s raised %s",
                claim.effect_id,
                error,
                extra=_context(claim, sweep=self.name),
            )
        outcome = _lookup_outcome(answer)
        out = schema.outbox
        guard = (
            out.c.id == claim.effect_id,
            out.c.status == S.OUTCOME_UNKNOWN,
            out.c.needs_review.is_(False),
            out.c.lookup_attempts == claim.tries,
        )
        with db.write(self.engine) as conn:
            # The answer is evidence even when the row has moved on (an operator
            # resolved it meanwhile): record it either way.
            conn.execute(
                sa.insert(schema.lookups),
                {
                    "effect_id": claim.effect_id,
                    "worker": self.worker,
                    "at": now,
                    "outcome": outcome,
                    "provider_ref": answer.provider_ref if answer else None,
                    "error": error,
                },
            )
            if outcome is states.LookupOutcome.FOUND:
                assert answer is not None and answer.provider_ref
                # Found: the one settle step, shared with webhooks and operators.
                written = settle.settle(
                    conn,
                    settle.Settlement(
                        effect_id=claim.effect_id,
                        expected_status=S.OUTCOME_UNKNOWN,
                        expected_fence=claim.fence,
                        to=S.SUCCEEDED,
                        reason=states.Reason.LOOKUP_FOUND,
                        source=states.SettleSource.LOOKUP,
                        at=now,
                        provider_ref=answer.provider_ref,
                    ),
                    guard=guard[2:],
                )
                status: Any = S.SUCCEEDED
            else:
                values = self._decide(claim, outcome, answer, error, now)
                written = bool(conn.execute(sa.update(out).where(*guard).values(**values)).rowcount)
                status = values["status"]
        if written:
            logger.info(
                "lookup of effect %s: %s -> %s",
                claim.effect_id,
                outcome.value,
                status,
                extra=_context(claim, sweep=self.name, outcome=outcome.value),
            )
        else:
            logger.info(
                "effect %s changed during its lookup; answer kept as evidence only",
                claim.effect_id,
                extra=_context(claim, sweep=self.name, outcome=outcome.value),
            )

    def _decide(
        self,
        claim: _Claim,
        outcome: states.LookupOutcome,
        answer: adapters.LookupResult | None,
        error: str | None,
        now: datetime,
    ) -> dict[str, Any]:
        base: dict[str, Any] = {"updated_at": now, "next_lookup_at": None}
        if outcome is states.LookupOutcome.NOT_FOUND:
            decision = policy.after_lookup_not_found(now=now, deadline_at=claim.deadline_at)
            states.check_transition(S.OUTCOME_UNKNOWN, decision.status)
            values = base | {
                "status": decision.status,
                "reason": decision.reason,
                "maybe_sent": decision.maybe_sent,
                # A fresh lookup budget if it ever becomes unknown again.
                "lookup_attempts": 0,
                "lease_owner": None,
                "lease_expires_at": None,
            }
            if decision.terminal:
                return values | {"finished_at": now}
            assert decision.next_attempt_at is not None
            return values | {"next_attempt_at": decision.next_attempt_at}
        # Inconclusive or error: try again later, or hand it to a person.
        if claim.tries >= self.settings.lookup_max_tries:
            return base | {
                "status": S.OUTCOME_UNKNOWN,
                "reason": states.Reason.REVIEW_LOOKUP_EXHAUSTED,
                "needs_review": True,
                "review_since": now,
                "last_error": error,
            }
        return base | {
            "status": S.OUTCOME_UNKNOWN,
            "next_lookup_at": now + self.backoff(claim.tries),
            "last_error": error,
        }


def _lookup_outcome(answer: adapters.LookupResult | None) -> states.LookupOutcome:
    if answer is None:
        return states.LookupOutcome.ERROR
    return {
        adapters.LookupStatus.FOUND: states.LookupOutcome.FOUND,
        adapters.LookupStatus.NOT_FOUND: states.LookupOutcome.NOT_FOUND,
        adapters.LookupStatus.INCONCLUSIVE: states.LookupOutcome.INCONCLUSIVE,
    }[answer.status]


def _last_activity(conn: Connection, effect_ids: Sequence[int]) -> dict[int, datetime]:
    """The latest time an attempt of each effect started or finished."""
    if not effect_ids:
        return {}
    a = schema.attempts
    rows = conn.execute(
        sa.select(a.c.effect_id, sa.func.max(a.c.started_at), sa.func.max(a.c.finished_at))
        .where(a.c.effect_id.in_(effect_ids))
        .group_by(a.c.effect_id)
    ).all()
    out: dict[int, datetime] = {}
    for effect_id, started, finished in rows:
        # max() keeps the column's type, so these are aware UTC datetimes.
        times = [t for t in (started, finished) if t is not None]
        if times:
            out[effect_id] = max(times)
    return out


# --- webhooks ------------------------------------------------------------------


class MatchWebhooks(_Base):
    """Provider events kept because no effect matched them when they arrived: matched
    (and applied, through the settle step) once their effect appears."""

    name = "match_webhooks"

    def run_once(self, now: datetime | None = None) -> int:
        matched = webhooks.match_unmatched(self.engine, now=self._now(now))
        if matched:
            logger.info("webhooks: %s kept events found their effect", matched)
        return matched


# --- retention ------------------------------------------------------------------


class ApplyRetention(_Base):
    """The prune of the foundation, on a schedule: receipts past retention become
    tombstones once every effect is terminal; expired tombstones are forgotten."""

    name = "apply_retention"

    def run_once(self, now: datetime | None = None) -> int:
        result = retention.prune(
            self.engine,
            now=self._now(now),
            tombstone_retention=self.settings.tombstone_retention,
        )
        if result.total:
            logger.info(
                "retention: %s tombstoned, %s forgotten", result.tombstoned, result.forgotten
            )
        return result.total


# --- all of them ----------------------------------------------------------------


def build(
    engine: Engine,
    registry: adapters.Registry,
    config: outbox_settings.Settings | None = None,
    *,
    worker: str = "reconciler",
    clock: Clock = schema.utcnow,
) -> list[Sweep]:
    """Every sweep, in the order a single pass should run them."""
    config = config or outbox_settings.load()
    return [
        ExpireLeases(engine, registry, config, worker=worker, clock=clock),
        EnforceDeadlines(engine, config, worker=worker, clock=clock),
        RunLookups(engine, registry, config, worker=worker, clock=clock),
        MatchWebhooks(engine, config, worker=worker, clock=clock),
        ApplyRetention(engine, config, worker=worker, clock=clock),
    ]


def run_all_once(sweeps: Sequence[Sweep], now: datetime | None = None) -> dict[str, int]:
    """One pass of every sweep; what each handled, by name."""
    return {sweep.name: sweep.run_once(now) for sweep in sweeps}
