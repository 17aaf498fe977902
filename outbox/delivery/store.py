# Longer than 500 lines on purpose: every statement of an effect's life (claim, attempt,
# finish, release, expiry) lives here, in both dialects, so the fencing rules read in one place.
"""The persistence port of delivery: claim, renew, finish, release, expire.

Named by protocol, not CRUD. Every function takes the engine and opens its own
short write transaction, so no transaction is ever held open across a send.

The guarantees, and the statement that keeps each one:

- **A claim is exclusive.** ``claim_due`` picks due ``pending`` rows (on
  PostgreSQL ``FOR UPDATE SKIP LOCKED``, on SQLite under ``BEGIN IMMEDIATE``),
  sets them ``in_flight`` under a lease (``lease_owner``, ``lease_expires_at``),
  raises each row's ``fence`` and inserts one open attempt row per claimed
  effect, all in one transaction. The attempt row is committed before anything
  is sent: an attempt with ``started_at`` and no ``finished_at`` is the evidence
  that the provider may have acted.
- **Only the lease holder writes the row's state.** ``finish_attempts`` updates
  a row only ``WHERE id = :id AND fence = :fence AND status = 'in_flight'``. A
  result that misses (the lease expired and the row moved on) is kept on its own
  attempt row with ``late = true`` and changes nothing else.
- **Batched.** One transaction per batch: on PostgreSQL one ``UPDATE ... FROM
  unnest(...)`` per table, on SQLite ``executemany`` inside the write lock.
- **Time.** ``now=None`` means the database clock on PostgreSQL (hosts with
  skewed clocks still agree on who holds a lease) and the host clock on SQLite.
  An explicit ``now`` always wins, so tests can move time.

The state decisions come from ``outbox.policy``; this module only writes them.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection, Engine

import adapters
from outbox import db, schema, states
from outbox.delivery import policy
from outbox.states import AttemptOutcome, EffectStatus, Reason

S = EffectStatus
_out = schema.outbox
_att = schema.attempts

LEASE_EXPIRED_ERROR = "lease expired before the result was recorded; the send may have happened"
NO_REFERENCE_MARKER = "http-{status_code}"
"""Stands in for ``provider_ref`` when a provider confirmed an effect without naming it."""

CapabilitiesFor = Callable[[str], "adapters.Capabilities | None"]


# --- values ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ClaimParams:
    """One claim: who, for how long, how many, and what to leave alone."""

    owner: str
    lease: timedelta
    limit: int
    now: datetime | None = None  # None: the database clock (PostgreSQL) or the host's
    # Adapters whose breaker is open: their rows are not even selected.
    paused_adapters: frozenset[str] = frozenset()
    # Adapters whose retry budget is spent: their retries (attempts > 0) are not selected.
    no_retry_adapters: frozenset[str] = frozenset()
    # Adapters whose breaker is not closed (PostgreSQL, the database's clock). When
    # given, the caller promises that ``admit`` accepts the first attempt of any
    # other adapter's row, so the claim takes those in the statement that selects
    # them (one round trip less) and asks ``admit`` afterwards, for its counts.
    # None: every due row is offered to ``admit`` before it is claimed.
    unsettled_adapters: frozenset[str] | None = None
    # Adapters whose provider forgets keys, and after how many seconds. A due row
    # that may have been sent before is not resent past its window (policy.before_resend).
    key_retention: Mapping[str, float] = field(default_factory=dict)


# The values built once per row (``Candidate``, ``Claimed``, ``Finish``) are named
# tuples: as immutable as the frozen dataclasses around them, and built in half the
# time (a frozen dataclass's ``__init__`` sets each field through
# ``object.__setattr__``: 2.5 µs for eleven fields against 1.2).
class Candidate(NamedTuple):
    """A due row as the claim first sees it, before deciding to send it."""

    id: int
    adapter: str
    attempts: int  # attempts started so far; 0 means this would be the first
    maybe_sent: bool
    deadline_at: datetime


class Claimed(NamedTuple):
    """A row this worker now holds, with its open attempt."""

    id: int
    tenant: str
    operation_id: str
    effect: str
    adapter: str
    payload: str  # canonical JSON text, as stored
    effect_key: str
    attempt_no: int  # this attempt; equals the row's ``attempts`` after the claim
    fence: int
    maybe_sent: bool  # before this attempt
    deadline_at: datetime
    lease_expires_at: datetime
    started_at: datetime
    # When the earliest attempt that may have reached the provider started: this
    # attempt's start unless an earlier one may have been sent (then the first
    # attempt's). Filled for adapters with a key retention; None elsewhere.
    first_sent_at: datetime | None = None

    @property
    def key_first_sent_at(self) -> datetime:
        """The start of the provider's key window for this effect (see ``first_sent_at``)."""
        if self.first_sent_at is not None:
            return self.first_sent_at
        return self.started_at


@dataclass(frozen=True, slots=True)
class Claim:
    effects: list[Claimed]
    expired: int  # due rows past their deadline (or key window), settled by policy, not sent
    skipped: int  # due rows the admission check refused this time (left pending, untouched)
    now: datetime | None  # the clock the claim used (None when nothing was due)


class Finish(NamedTuple):
    """One attempt's end and the row's next state (``policy.Decision``)."""

    effect_id: int
    fence: int
    attempt_no: int
    at: datetime
    outcome: AttemptOutcome
    decision: policy.Decision
    status_code: int | None = None
    error: str | None = None
    provider_ref: str | None = None  # the row's reference (required when succeeded)
    attempt_provider_ref: str | None = None
    next_lookup_at: datetime | None = None  # when outcome_unknown: first lookup not before


@dataclass(frozen=True, slots=True)
class Recorded:
    """What ``finish_attempts`` did: rows whose state it wrote, and late results."""

    recorded: frozenset[int] = field(default_factory=frozenset)
    late: frozenset[int] = field(default_factory=frozenset)


# --- helpers ------------------------------------------------------------------


def _is_pg(conn: Connection) -> bool:
    return conn.dialect.name == "postgresql"


def _now_expr(conn: Connection, now: datetime | None) -> sa.ColumnElement[datetime]:
    if now is not None:
        return sa.literal(now, schema.UTCDateTime())
    if _is_pg(conn):
        return sa.func.now(type_=schema.UTCDateTime())
    return sa.literal(schema.utcnow(), schema.UTCDateTime())


def _ids_match(conn: Connection, column: sa.ColumnElement[Any], ids: Sequence[int]) -> Any:
    if _is_pg(conn):
        # One array parameter: the statement text is the same for every batch
        # size, so PostgreSQL can keep it prepared.
        return column == sa.any_(sa.literal(list(ids), postgresql.ARRAY(sa.BigInteger())))
    return column.in_(list(ids))


def _check(decision: policy.Decision) -> None:
    states.check_transition(S.IN_FLIGHT, decision.status)


# --- claim ----------------------------------------------------------------------

# Ordering groups, in every claim statement below (the one place the rule lives): a
# grouped row is claimable only when no earlier row of its (tenant, adapter,
# ordering_key) is still open. An earlier one waiting on a retry, an unknown outcome
# or review, or in flight, holds its group back, and no other group; a terminal one
# (succeeded or failed) lets the next go. Ungrouped rows skip the probe (the OR
# short-circuits), and the probe reads only ``ix_outbox_ordering_open``.
_ORDERED = f"""(outbox.ordering_key IS NULL OR NOT EXISTS (
    SELECT 1 FROM outbox AS earlier
    WHERE earlier.{schema.ORDERING_OPEN_SQL.replace(" AND status", " AND earlier.status")}
      AND earlier.tenant = outbox.tenant AND earlier.adapter = outbox.adapter
      AND earlier.ordering_key = outbox.ordering_key AND earlier.id < outbox.id))"""


def claim_due(
    engine: Engine,
    params: ClaimParams,
    admit: Callable[[Candidate, datetime], bool] | None = None,
    *,
    pinned: db.Pinned | None = None,
) -> Claim:
    """Claim up to ``params.limit`` due rows and open one attempt for each before any send.

    ``admit(candidate, now)`` may refuse a row (retry budget, breaker probe
    already out): it stays ``pending``, untouched, for a later claim. Due rows
    already past their deadline are never sent: ``policy.at_deadline`` settles
    them here (failed, or outcome_unknown when a send may have happened).

    The two steps (select, then admit and claim) run in one transaction. On
    PostgreSQL, with ``params.unsettled_adapters`` given, first attempts are
    claimed before them by one statement that commits alone, and the two
    steps run only if other due rows were seen, for the rest of the batch.
    That statement runs on ``pinned``'s connection when one is given (the
    dispatcher's loop holds one), else on one from the pool.
    """
    admitted = False  # admit() keeps counts in memory: a second try must not repeat it
    # The common pass: the current clock, no adapter held back.
    common = params.now is None and not (params.paused_adapters or params.no_retry_adapters)

    def admitted_by(candidate: Candidate, at: datetime) -> bool:
        nonlocal admitted
        if admit is None:
            return True
        admitted = True
        return admit(candidate, at)

    first: list[Claimed] = []
    first_now: datetime | None = None
    if common and engine.dialect.name == "postgresql" and params.unsettled_adapters is not None:
        first, first_now, others = _claim_first_attempts(engine, params, admitted_by, pinned)
        if not others or len(first) >= params.limit:
            return Claim(first, 0, 0, first_now if first else None)
        # Due rows that need a decision remain: the two steps, for the rest of the batch.
        params = replace(params, limit=params.limit - len(first))
        admitted = False

    def body(conn: Connection) -> Claim:
        # The common pass goes straight to the driver: SQLAlchemy's statement building
        # and result processing were about a quarter of a one-row claim's select.
        rows: Sequence[Any] = (
            _due_direct(conn, params.limit) if common else _select_due(conn, params)
        )
        if not rows:
            return Claim([], 0, 0, None)
        now: datetime = rows[0].db_now
        send: list[int] = []
        expired: list[Candidate] = []
        forgotten: list[Candidate] = []
        skipped = 0
        first_sends = _first_sends(
            conn,
            [r.id for r in rows if r.maybe_sent and r.adapter in params.key_retention],
        )
        for row in rows:
            candidate = Candidate(
                row.id, row.adapter, row.attempts, row.maybe_sent, row.deadline_at
            )
            stop = policy.before_resend(
                now=now,
                maybe_sent=candidate.maybe_sent,
                key_expires_at=policy.key_expires_at(
                    first_sends.get(candidate.id), params.key_retention.get(candidate.adapter)
                ),
            )
            if candidate.deadline_at <= now:
                expired.append(candidate)
            elif stop is not None:
                forgotten.append(candidate)
            elif admitted_by(candidate, now):
                send.append(candidate.id)
            else:
                skipped += 1
        claimed = _claim(conn, send, params.owner, now, now + params.lease) if send else []
        if first_sends:
            claimed = [
                c._replace(first_sent_at=first_sends[c.id]) if c.id in first_sends else c
                for c in claimed
            ]
        if expired:
            _settle_at_deadline(conn, expired, now)
        if forgotten:
            _settle_past_key_window(conn, forgotten, now)
        return Claim(claimed, len(expired) + len(forgotten), skipped, now)

    # No pre-ping (a round trip per pass): a pooled connection found dead before
    # anything was committed or admitted is replaced, and the claim runs again.
    claim = db.transact(engine, body, repeatable=lambda: not admitted)
    if first_now is None:
        return claim
    effects = sorted([*first, *claim.effects], key=lambda c: c.id)
    return Claim(effects, claim.expired, claim.skipped, first_now)


# What every claim statement returns for a claimed row, in this order
# (``_claimed_row`` reads it by position).
_CLAIMED = (
    "id",
    "tenant",
    "operation_id",
    "effect",
    "adapter",
    "payload",
    "effect_key",
    "attempts",
    "fence",
    "maybe_sent",
    "deadline_at",
)
_CLAIMED_SQL = ", ".join(_CLAIMED)


# The pieces every claim shares, so that the one-statement claim and the two
# steps cannot drift apart: which rows are due (oldest first, skipping rows
# another dispatcher holds), what a claim writes on the row, and the attempt rows
# it opens before anything is sent.
def _due_where(now: str) -> str:
    return f"status = '{S.PENDING.value}' AND next_attempt_at <= {now} AND {_ORDERED}"


_PG_DUE_WHERE = _due_where("now()")
_PG_DUE_ORDER = "ORDER BY next_attempt_at, id LIMIT %(limit)s FOR UPDATE SKIP LOCKED"


def _claim_set(owner: str, lease_expires_at: str, now: str, row: str = "") -> str:
    """The SET list of a claim, each value an SQL expression or placeholder."""
    return (
        f"status = '{S.IN_FLIGHT.value}', reason = '{Reason.CLAIMED.value}',"
        f" lease_owner = {owner}, lease_expires_at = {lease_expires_at},"
        f" fence = {row}fence + 1, attempts = {row}attempts + 1, updated_at = {now}"
    )


_PG_OPEN_ATTEMPTS = (
    "INSERT INTO attempts (effect_id, attempt_no, worker, fence, effect_key, started_at, late)"
    " SELECT id, attempts, %(owner)s, fence, effect_key, {started_at}, false FROM claimed"
)


# The common pass on PostgreSQL as one statement, committed alone (no BEGIN,
# no COMMIT: one round trip): among the due rows, oldest first (the select of
# ``_select_due``), the first attempts of adapters whose breaker is closed are
# claimed with their attempt rows (as ``_PG_CLAIM``) and returned; whether any
# other due row (a retry, one past its deadline, an unsettled adapter's) was
# among them comes back too, so that only then the two steps run for those.
_PG_CLAIM_FIRST = f"""
WITH due AS (
    SELECT id, attempts = 0 AND deadline_at > now() AND adapter <> ALL(%(unsettled)s::varchar[])
        AS first
    FROM outbox WHERE {_PG_DUE_WHERE} {_PG_DUE_ORDER}
), claimed AS (
    UPDATE outbox AS o SET {_claim_set("%(owner)s", "now() + %(lease)s", "now()", "o.")}
    FROM due
    WHERE o.id = due.id AND due.first
    RETURNING {", ".join(f"o.{c}" for c in _CLAIMED)}
), opened AS (
    {_PG_OPEN_ATTEMPTS.format(started_at="now()")}
)
SELECT true, {_CLAIMED_SQL}, now()
FROM claimed
UNION ALL
SELECT false, count(*), {", ".join(["NULL"] * (len(_CLAIMED) - 1))}, now()
FROM due WHERE NOT first
"""


@functools.lru_cache(maxsize=8)
def _claim_first_sql(limit: int) -> str:
    """``_PG_CLAIM_FIRST`` with its limit written in, not a parameter.

    Given a ``LIMIT`` parameter, PostgreSQL prices the prepared statement's generic
    plan as if it returned a tenth of the due rows, so once the statistics know a
    backlog every claim was planned afresh (a claim of 100 about 9% slower). A
    dispatcher's batch size is fixed, so with it written in the statement settles
    on its generic plan after the driver prepares it.
    """
    return _PG_CLAIM_FIRST.replace("%(limit)s", str(int(limit)))


def _claim_first_attempts(
    engine: Engine,
    params: ClaimParams,
    admitted_by: Callable[[Candidate, datetime], bool],
    pinned: db.Pinned | None = None,
) -> tuple[list[Claimed], datetime, bool]:
    """The one-statement claim: (claimed rows, the database's now, other due rows seen)."""
    assert params.unsettled_adapters is not None
    sql = _claim_first_sql(params.limit)
    statement = {
        "owner": params.owner,
        "lease": params.lease,
        "unsettled": sorted(params.unsettled_adapters),
    }

    # Safe to run twice: a claim whose reply was lost holds its rows only until
    # their lease ends, as a claim whose process died does.
    def body(conn: db.Direct) -> Any:
        return db.driver_execute(conn, sql, statement).fetchall()

    rows = pinned.autocommit(body) if pinned is not None else db.autocommit(engine, body)
    now: datetime = rows[0][-1].astimezone(UTC)
    others = False
    claimed: list[Claimed] = []
    refused: list[Finish] = []
    for r in rows:
        if not r[0]:  # the count of the other due rows
            others = r[1] > 0
            continue
        effect = _claimed_row(r[1:-1], now, now + params.lease)
        # admit() still sees every first attempt, for its counts. Should it refuse
        # one after all, the row goes back as it was, its attempt ``not_sent``.
        if admitted_by(
            Candidate(effect.id, effect.adapter, 0, effect.maybe_sent, effect.deadline_at), now
        ):
            claimed.append(effect)
            continue
        refused.append(
            Finish(
                effect.id,
                effect.fence,
                effect.attempt_no,
                now,
                AttemptOutcome.NOT_SENT,
                policy.Decision(S.PENDING, Reason.NOT_SENT, effect.maybe_sent, now),
                error="refused by admission after the claim; never sent",
            )
        )
    if refused:
        finish_attempts(engine, refused)
    return claimed, now, others or bool(refused)


class _Due(NamedTuple):
    id: int
    adapter: str
    attempts: int
    maybe_sent: bool
    deadline_at: datetime
    db_now: datetime


# ``_select_due`` without held-back adapters, on the database's clock.
_PG_DUE = f"""
SELECT id, adapter, attempts, maybe_sent, deadline_at, now() AS db_now FROM outbox
WHERE {_PG_DUE_WHERE} {_PG_DUE_ORDER}
"""


_SQLITE_DUE = f"""
SELECT id, adapter, attempts, maybe_sent, deadline_at FROM outbox
WHERE {_due_where("?")} ORDER BY next_attempt_at, id LIMIT ?
"""


def _due_direct(conn: Connection, limit: int) -> list[_Due]:
    """``_select_due`` for the common pass, as the driver's SQL (a test holds them equal)."""
    if _is_pg(conn):
        return [
            _Due(r[0], r[1], r[2], r[3], r[4].astimezone(UTC), r[5].astimezone(UTC))
            for r in db.driver_execute(conn, _PG_DUE, {"limit": limit}).fetchall()
        ]
    now = schema.utcnow()
    rows = db.driver_execute(conn, _SQLITE_DUE, (schema.sqlite_time(now), limit)).fetchall()
    return [
        _Due(r[0], r[1], r[2], bool(r[3]), datetime.fromisoformat(r[4]).replace(tzinfo=UTC), now)
        for r in rows
    ]


def _select_due(conn: Connection, params: ClaimParams) -> Sequence[Any]:
    """Due rows, oldest first, without the held-back adapters' (except past their deadline)."""
    now_expr = _now_expr(conn, params.now)
    query = sa.select(
        _out.c.id,
        _out.c.adapter,
        _out.c.attempts,
        _out.c.maybe_sent,
        _out.c.deadline_at,
        now_expr.label("db_now"),
    ).where(_out.c.status == S.PENDING, _out.c.next_attempt_at <= now_expr, sa.text(_ORDERED))
    held_back: list[sa.ColumnElement[bool]] = []
    if params.paused_adapters:
        held_back.append(_out.c.adapter.in_(sorted(params.paused_adapters)))
    if params.no_retry_adapters:
        held_back.append(
            sa.and_(_out.c.adapter.in_(sorted(params.no_retry_adapters)), _out.c.attempts > 0)
        )
    if held_back:
        # A row past its deadline is settled whatever its adapter's state.
        query = query.where(sa.or_(sa.not_(sa.or_(*held_back)), _out.c.deadline_at <= now_expr))
    query = query.order_by(_out.c.next_attempt_at, _out.c.id).limit(params.limit)
    if _is_pg(conn):
        query = query.with_for_update(skip_locked=True)
    return conn.execute(query).all()


# The claim of chosen ids, with their open attempts, as one statement on
# PostgreSQL: the attempt rows are written by the same statement (a
# data-modifying CTE) and commit with the claim, before anything is sent.
_PG_CLAIM = f"""
WITH claimed AS (
    UPDATE outbox SET {_claim_set("%(owner)s", "%(lease_expires_at)s", "%(now)s")}
    WHERE id = ANY(%(ids)s::bigint[]) AND status = '{S.PENDING.value}'
    RETURNING {_CLAIMED_SQL}
), opened AS (
    {_PG_OPEN_ATTEMPTS.format(started_at="%(now)s")}
)
SELECT {_CLAIMED_SQL}
FROM claimed ORDER BY id
"""
_SQLITE_CLAIM = f"""
UPDATE outbox SET {_claim_set("?", "?", "?")}
WHERE id IN ({{marks}}) AND status = '{S.PENDING.value}'
RETURNING {_CLAIMED_SQL}
"""
_SQLITE_OPEN_ATTEMPTS = (
    "INSERT INTO attempts (effect_id, attempt_no, worker, fence, effect_key, started_at, late)"
    " VALUES (?, ?, ?, ?, ?, ?, 0)"
)


def _claimed_row(r: Sequence[Any], now: datetime, lease_expires_at: datetime) -> Claimed:
    """A claim's row of ``_CLAIMED`` columns, from either driver."""
    deadline = r[10]
    if isinstance(deadline, str):  # SQLite: UTCDateTime's text
        deadline = datetime.fromisoformat(deadline).replace(tzinfo=UTC)
    elif deadline.tzinfo is not UTC:
        deadline = deadline.astimezone(UTC)
    # Positional, in ``Claimed``'s order (keywords cost a batch of 100 rows 40 us more):
    # id, tenant, operation_id, effect, adapter, payload, effect_key, attempt_no, fence,
    # maybe_sent (SQLite: 0 or 1), deadline_at, lease_expires_at, started_at.
    return Claimed(
        r[0],
        r[1],
        r[2],
        r[3],
        r[4],
        r[5],
        r[6],
        r[7],
        r[8],
        bool(r[9]),
        deadline,
        lease_expires_at,
        now,
    )


def _claim(
    conn: Connection, ids: list[int], owner: str, now: datetime, lease_expires_at: datetime
) -> list[Claimed]:
    # Straight to the driver on both backends: this runs once per batch, and
    # SQLAlchemy's per-row bind and result processing cost more than the SQL.
    if _is_pg(conn):
        rows = conn.exec_driver_sql(
            _PG_CLAIM,
            {"ids": ids, "owner": owner, "now": now, "lease_expires_at": lease_expires_at},
        ).fetchall()
        return [_claimed_row(r, now, lease_expires_at) for r in rows]
    started = schema.sqlite_time(now)
    rows = conn.exec_driver_sql(
        _SQLITE_CLAIM.format(marks=", ".join("?" * len(ids))),
        (owner, schema.sqlite_time(lease_expires_at), started, *ids),
    ).fetchall()
    claimed = sorted(
        (_claimed_row(r, now, lease_expires_at) for r in rows),
        key=lambda c: c.id,
    )
    if claimed:
        # Commit before sending: an open attempt is our only evidence that the
        # provider may have acted if this process dies mid-send.
        conn.exec_driver_sql(
            _SQLITE_OPEN_ATTEMPTS,
            [(c.id, c.attempt_no, owner, c.fence, c.effect_key, started) for c in claimed],
        )
    return claimed


def _first_sends(conn: Connection, effect_ids: Sequence[int]) -> dict[int, datetime]:
    """When each effect's first attempt started (the conservative start of its key window)."""
    if not effect_ids:
        return {}
    rows = conn.execute(
        sa.select(_att.c.effect_id, sa.func.min(_att.c.started_at))
        .where(_ids_match(conn, _att.c.effect_id, effect_ids))
        .group_by(_att.c.effect_id)
    ).all()
    return {effect_id: started for effect_id, started in rows if started is not None}


def _settle_past_key_window(conn: Connection, rows: list[Candidate], now: datetime) -> None:
    """Due rows that may have been sent, whose provider has forgotten the key: look up."""
    for row in rows:
        decision = policy.before_resend(now=now, maybe_sent=True, key_expires_at=now)
        assert decision is not None
        states.check_transition(S.PENDING, decision.status)
        conn.execute(
            sa.update(_out)
            .where(_out.c.id == row.id, _out.c.status == S.PENDING)
            .values(
                status=decision.status,
                reason=decision.reason,
                maybe_sent=True,
                next_lookup_at=now,
                needs_review=False,
                last_error=policy.KEY_RETENTION_PASSED,
                updated_at=now,
            )
        )


def _settle_at_deadline(conn: Connection, rows: list[Candidate], now: datetime) -> None:
    params = []
    for row in rows:
        decision = policy.at_deadline(row.maybe_sent)
        states.check_transition(S.PENDING, decision.status)
        params.append(
            {
                "b_id": row.id,
                "status": decision.status,
                "reason": decision.reason,
                "maybe_sent": decision.maybe_sent,
                "finished_at": now if decision.terminal else None,
                "next_lookup_at": now if decision.status is S.OUTCOME_UNKNOWN else None,
                "last_error": "deadline passed before the next attempt could start",
                "updated_at": now,
            }
        )
    conn.execute(
        sa.update(_out)
        .where(_out.c.id == sa.bindparam("b_id"), _out.c.status == S.PENDING)
        .values(
            status=sa.bindparam("status"),
            reason=sa.bindparam("reason"),
            maybe_sent=sa.bindparam("maybe_sent"),
            finished_at=sa.bindparam("finished_at"),
            next_lookup_at=sa.bindparam("next_lookup_at"),
            last_error=sa.bindparam("last_error"),
            needs_review=False,
            updated_at=sa.bindparam("updated_at"),
        ),
        params,
    )


# --- leases ---------------------------------------------------------------------------


def renew_leases(engine: Engine, owner: str, lease: timedelta, now: datetime | None = None) -> int:
    """Extend every live lease ``owner`` holds to ``now + lease``; returns how many.

    A lease that has already run out is not revived: once it expired, the row
    may be someone else's (or the reconciler's) to decide, and the fence makes
    our eventual result late.
    """
    with db.write(engine) as conn:
        now_expr = _now_expr(conn, now)
        expires: Any = (
            now_expr + sa.literal(lease, sa.Interval())
            if now is None and _is_pg(conn)
            else sa.literal(
                (now if now is not None else schema.utcnow()) + lease, schema.UTCDateTime()
            )
        )
        result = conn.execute(
            sa.update(_out)
            .where(
                _out.c.status == S.IN_FLIGHT,
                _out.c.lease_owner == owner,
                _out.c.lease_expires_at > now_expr,
            )
            .values(lease_expires_at=expires)
        )
        return int(result.rowcount)


# --- finish --------------------------------------------------------------------------


def finish_attempts(engine: Engine, finishes: Sequence[Finish]) -> Recorded:
    """Record a batch of finished attempts, in one transaction.

    Each row's state is written only while its fence still holds (``id``,
    ``fence`` and ``status = 'in_flight'`` all match). Every attempt row is
    finished either way; one whose row had moved on is marked ``late``.
    """
    if not finishes:
        return Recorded()
    for finish in finishes:
        _check(finish.decision)
        if finish.decision.status is S.SUCCEEDED and not finish.provider_ref:
            raise ValueError(f"effect {finish.effect_id}: succeeded needs a provider_ref")
    # No pre-ping: a dead pooled connection fails the one statement before COMMIT,
    # so nothing was written, and the batch is written again on a new connection.
    held = db.transact(engine, lambda conn: _write_finishes(conn, finishes))
    ids = frozenset(f.effect_id for f in finishes)
    return Recorded(recorded=frozenset(held), late=ids - held)


def _write_finishes(conn: Connection, finishes: Sequence[Finish]) -> set[int]:
    if _is_pg(conn):
        return _write_finishes_pg(conn, finishes)
    return _write_finishes_sqlite(conn, finishes)


# One statement per batch on PostgreSQL: the fenced row updates (a
# data-modifying CTE whose RETURNING says whose fence held) and the attempt
# rows, marked late where the fence did not hold. The batch travels as one
# JSON parameter: adapting a dozen typed arrays cost more than the update.
#
# Both updates find their rows by primary key, ``id = ANY(ARRAY(...))``, so the
# statement's cost does not grow with the tables. Joined to the batch instead,
# the planner (which sees the batch as 100 rows of unknown ids) hashed the whole
# attempts table whenever its statistics were young or missing (a new
# database, the first minutes of a drain: the finish slowed as attempts
# accumulated, 4 ms to 11 ms a batch of 100 over 35,000 rows), and read every
# ``in_flight`` row through the partial lease index (17 ms with 13,500 in
# flight). An attempt's id comes from the unique (effect, attempt number)
# index, one probe per result; the fence's ``status`` test is written
# ``IS TRUE`` so that it does not match the lease index's predicate.
_PG_FINISH = f"""
WITH v AS (
    SELECT r.*, to_timestamp(r.at_s) AS at FROM jsonb_to_recordset(%(batch)s::jsonb) AS r(
        id bigint, fence bigint, attempt_no integer, at_s double precision, status varchar,
        reason varchar, maybe_sent boolean, terminal boolean, next_attempt_at timestamptz,
        next_lookup_at timestamptz, provider_ref varchar, attempt_provider_ref varchar,
        error text, outcome varchar, status_code integer)
), held AS (
    UPDATE outbox AS o SET
        status = v.status,
        reason = v.reason,
        maybe_sent = v.maybe_sent,
        next_attempt_at = COALESCE(v.next_attempt_at, o.next_attempt_at),
        lease_owner = NULL,
        lease_expires_at = NULL,
        provider_ref = COALESCE(v.provider_ref, o.provider_ref),
        last_error = v.error,
        finished_at = CASE WHEN v.terminal THEN v.at END,
        next_lookup_at = CASE WHEN v.status = '{S.OUTCOME_UNKNOWN.value}' THEN v.next_lookup_at END,
        needs_review = false,
        updated_at = v.at
    FROM v
    WHERE o.id = ANY(ARRAY(SELECT id FROM v)) AND o.id = v.id AND o.fence = v.fence
        AND (o.status = '{S.IN_FLIGHT.value}') IS TRUE
    RETURNING o.id
), finished AS (
    UPDATE attempts AS a SET
        finished_at = v.at,
        outcome = v.outcome,
        status_code = v.status_code,
        error = v.error,
        provider_ref = v.attempt_provider_ref,
        late = NOT EXISTS (SELECT 1 FROM held WHERE held.id = a.effect_id)
    FROM v
    WHERE a.id = ANY(ARRAY(
        SELECT (SELECT x.id FROM attempts AS x
                WHERE x.effect_id = w.id AND x.attempt_no = w.attempt_no)
        FROM v AS w))
      AND a.effect_id = v.id AND a.attempt_no = v.attempt_no AND a.fence = v.fence
)
SELECT id FROM held
"""


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _write_finishes_pg(conn: Connection, finishes: Sequence[Finish]) -> set[int]:
    # Planned on every call, never prepared. A prepared statement keeps the generic
    # plan PostgreSQL chose after its first few runs, when a new database's
    # attempts table held a few hundred rows: a sequential scan, which stayed
    # until autovacuum next analysed the table (a minute or more) while the table
    # grew by a batch a pass: 18 ms a batch of 100 over 27,000 attempt rows,
    # against 5 ms by key. Planning costs 0.34 ms a batch, 6% of the statement on
    # analysed tables.
    batch = {"batch": _pg_batch(finishes)}
    rows = db.driver_execute(conn, _PG_FINISH, batch, prepare=False).fetchall()
    return {r[0] for r in rows}


def _pg_batch(finishes: Sequence[Finish]) -> str:
    """``_PG_FINISH``'s one parameter: the batch as JSON.

    ``at`` travels as seconds since the epoch, which ``to_timestamp`` turns back into
    the same microsecond (a double holds today's instants to a quarter of one):
    an aware datetime's ``isoformat`` took 2.2 µs, a third of the batch's encoding.
    """
    batch = [
        {
            "id": f.effect_id,
            "fence": f.fence,
            "attempt_no": f.attempt_no,
            "at_s": f.at.timestamp(),
            "status": f.decision.status,  # StrEnums: JSON strings as they are
            "reason": f.decision.reason,
            "maybe_sent": f.decision.maybe_sent,
            "terminal": f.decision.terminal,
            "next_attempt_at": _iso(
                f.decision.next_attempt_at if f.decision.status is S.PENDING else None
            ),
            "next_lookup_at": _iso(f.next_lookup_at),
            "provider_ref": f.provider_ref,
            "attempt_provider_ref": f.attempt_provider_ref,
            "error": f.error,
            "outcome": f.outcome,
            "status_code": f.status_code,
        }
        for f in finishes
    ]
    return json.dumps(batch)


_SQLITE_FINISH_ROW = """
UPDATE outbox SET
    status = ?, reason = ?, maybe_sent = ?,
    next_attempt_at = COALESCE(?, next_attempt_at),
    lease_owner = NULL, lease_expires_at = NULL,
    provider_ref = COALESCE(?, provider_ref),
    last_error = ?, finished_at = ?, next_lookup_at = ?, needs_review = 0, updated_at = ?
WHERE id = ? AND fence = ? AND status = 'in_flight'
"""
_SQLITE_FINISH_ATTEMPT = """
UPDATE attempts SET finished_at = ?, outcome = ?, status_code = ?, error = ?, provider_ref = ?,
    late = ?
WHERE effect_id = ? AND attempt_no = ? AND fence = ?
"""


_SQLITE_FENCES = "SELECT id, fence, status FROM outbox WHERE id IN ({marks})"


def _write_finishes_sqlite(conn: Connection, finishes: Sequence[Finish]) -> set[int]:
    # Under BEGIN IMMEDIATE nobody else writes between this read and the
    # updates, so the rows whose fence holds are known before writing.
    ids = [f.effect_id for f in finishes]
    sql = _SQLITE_FENCES.format(marks=", ".join("?" * len(ids)))
    current = {r[0]: (r[1], r[2]) for r in db.driver_execute(conn, sql, ids).fetchall()}
    held = {f.effect_id for f in finishes if current.get(f.effect_id) == (f.fence, S.IN_FLIGHT)}
    # Straight to the driver's executemany: SQLAlchemy's per-row bind processing
    # costs more than SQLite's update, and this is the hot path. Each finish's time
    # is converted once (``at``, ``updated_at``, the attempt's ``finished_at``).
    t = schema.sqlite_time
    rows = []
    attempts = []
    for f in finishes:
        d = f.decision
        at = t(f.at)
        attempts.append(
            (
                at,
                f.outcome.value,
                f.status_code,
                f.error,
                f.attempt_provider_ref,
                f.effect_id not in held,
                f.effect_id,
                f.attempt_no,
                f.fence,
            )
        )
        if f.effect_id not in held:
            continue
        rows.append(
            (
                d.status.value,
                d.reason.value,
                d.maybe_sent,
                t(d.next_attempt_at) if d.status is S.PENDING else None,
                f.provider_ref,
                f.error,
                at if d.terminal else None,
                t(f.next_lookup_at) if d.status is S.OUTCOME_UNKNOWN else None,
                at,
                f.effect_id,
                f.fence,
            )
        )
    if rows:
        cursor = db.driver_execute(conn, _SQLITE_FINISH_ROW, rows, many=True)
        if cursor.rowcount != len(rows):  # pragma: no cover - the write lock forbids it
            raise RuntimeError("a fenced update missed a row it had just seen under the lock")
    db.driver_execute(conn, _SQLITE_FINISH_ATTEMPT, attempts, many=True)
    return held


# --- release (shutdown) and lease expiry (reconciler) ----------------------------------


@dataclass(frozen=True, slots=True)
class Release:
    """A row this worker gives back at shutdown, and whether its request left us."""

    effect: Claimed
    handed_to_adapter: bool  # True: the send may have happened (or be happening)
    honours_keys: bool
    lookup_settle_seconds: float = 0.0
    key_retention_seconds: float | None = None


def release(
    engine: Engine,
    releases: Sequence[Release],
    *,
    now: datetime,
    max_attempts: int,
) -> Recorded:
    """Give rows back at shutdown without pretending a possible send did not happen.

    - Never handed to the adapter: back to ``pending`` (reason ``released``),
      due now, its attempt finished ``not_sent``.
    - Handed to the adapter: its attempt is finished ``abandoned`` and policy
      decides as for a lost lease: ``pending`` with the same key when the
      provider honours keys, else ``outcome_unknown`` (no automatic resend).
    """
    finishes = []
    for item in releases:
        c = item.effect
        if not item.handed_to_adapter:
            decision = policy.Decision(S.PENDING, Reason.RELEASED, c.maybe_sent, now)
            finishes.append(
                Finish(
                    c.id,
                    c.fence,
                    c.attempt_no,
                    now,
                    AttemptOutcome.NOT_SENT,
                    decision,
                    error="released at shutdown before it was sent",
                )
            )
            continue
        decision = policy.after_attempt(
            outcome=AttemptOutcome.ABANDONED,
            may_have_happened=True,
            honours_keys=item.honours_keys,
            maybe_sent_before=c.maybe_sent,
            attempts=c.attempt_no,
            max_attempts=max_attempts,
            retry_at=now,
            deadline_at=c.deadline_at,
            key_expires_at=policy.key_expires_at(c.key_first_sent_at, item.key_retention_seconds),
        )
        finishes.append(
            Finish(
                c.id,
                c.fence,
                c.attempt_no,
                now,
                AttemptOutcome.ABANDONED,
                decision,
                error="released at shutdown while the send was in progress; it may have happened",
                next_lookup_at=now + timedelta(seconds=item.lookup_settle_seconds),
            )
        )
    return finish_attempts(engine, finishes)


def expire_leases(
    engine: Engine,
    *,
    capabilities_for: CapabilitiesFor,
    max_attempts: int,
    now: datetime | None = None,
    retry_at: Callable[[datetime, int], datetime] | None = None,
    limit: int = 500,
) -> int:
    """Settle ``in_flight`` rows whose lease ran out (their worker died or stalled).

    For the reconciler's lease-expiry sweep (call it until it returns 0). Each
    expired row's open attempt is finished ``abandoned`` (the send may have
    happened) and ``policy.after_attempt`` decides the row as the dispatcher
    would have: ``pending`` with the same key, due at ``retry_at(now, attempts)``
    (default: now), when the adapter honours keys; ``outcome_unknown`` (first
    lookup after the adapter's settle time, ``needs_review`` left false)
    otherwise; failed/outcome_unknown past the deadline or the attempt cap.

    ``capabilities_for(adapter_name)`` returns the adapter's capabilities; an
    unknown adapter (``None``, ``KeyError`` or ``adapters.UnknownAdapter``) is
    treated as one that ignores keys, so nothing is resent on a guess.
    ``now=None`` uses the database clock on PostgreSQL. Returns the rows settled.
    """
    with db.write(engine) as conn:
        now_expr = _now_expr(conn, now)
        query = (
            sa.select(
                _out.c.id,
                _out.c.adapter,
                _out.c.attempts,
                _out.c.fence,
                _out.c.maybe_sent,
                _out.c.deadline_at,
                now_expr.label("db_now"),
                # The start of the key window: the first attempt if an earlier one may
                # have been sent, else this (open, latest) attempt.
                sa.select(sa.func.min(_att.c.started_at))
                .where(_att.c.effect_id == _out.c.id)
                .scalar_subquery()
                .label("first_started_at"),
                sa.select(sa.func.max(_att.c.started_at))
                .where(_att.c.effect_id == _out.c.id)
                .scalar_subquery()
                .label("last_started_at"),
            )
            .where(_out.c.status == S.IN_FLIGHT, _out.c.lease_expires_at < now_expr)
            .order_by(_out.c.lease_expires_at)
            .limit(limit)
        )
        if _is_pg(conn):
            query = query.with_for_update(skip_locked=True)
        rows = conn.execute(query).all()
        if not rows:
            return 0
        at: datetime = rows[0].db_now
        finishes = []
        for row in rows:
            caps = _capabilities(capabilities_for, row.adapter)
            honours = caps is not None and caps.honours_idempotency_keys
            settle = caps.lookup_settle_seconds if caps is not None else 0.0
            decision = policy.after_attempt(
                outcome=AttemptOutcome.ABANDONED,
                may_have_happened=True,
                honours_keys=honours,
                maybe_sent_before=row.maybe_sent,
                attempts=row.attempts,
                max_attempts=max_attempts,
                retry_at=retry_at(at, row.attempts) if retry_at else at,
                deadline_at=row.deadline_at,
                key_expires_at=policy.key_expires_at(
                    row.first_started_at if row.maybe_sent else row.last_started_at,
                    caps.key_retention_seconds if caps is not None else None,
                ),
            )
            finishes.append(
                Finish(
                    row.id,
                    row.fence,
                    row.attempts,
                    at,
                    AttemptOutcome.ABANDONED,
                    decision,
                    error=LEASE_EXPIRED_ERROR,
                    next_lookup_at=at + timedelta(seconds=settle),
                )
            )
        return len(_write_finishes(conn, finishes))


def _capabilities(lookup: CapabilitiesFor, adapter: str) -> adapters.Capabilities | None:
    try:
        return lookup(adapter)
    except (KeyError, adapters.UnknownAdapter):
        return None
