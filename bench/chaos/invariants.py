"""The invariants of a chaos phase, checked from three independent records.

1. What the callers were answered (the load generator's record of every call).
2. What the service stored (the database: operations, tasks, effects, attempts,
   lookups, review actions).
3. What the provider did (its ledger, ``GET /_admin/effects``: one row per
   ticket, with the key and client reference it came with).

``check(evidence)`` returns the figures and every violation, each with the
rows that break it. It only reads; the tests import it as is.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from bench.chaos.load import KeyRecord
from outbox import db, schema
from outbox.client import Outcome
from outbox.states import AttemptOutcome, EffectStatus, LookupOutcome, Reason, ReviewChoice

S = EffectStatus
# An attempt after which the provider may have acted: nothing may be resent to a
# provider that ignores keys until a lookup or a person says it did not happen.
RISKY = frozenset({AttemptOutcome.AMBIGUOUS, AttemptOutcome.ABANDONED, AttemptOutcome.DELIVERED})
SHOWN_ROWS = 20
AT_DEADLINE = frozenset(
    {Reason.DEADLINE_NOTHING_SENT, Reason.DEADLINE_MAY_HAVE_SENT, Reason.MAX_ATTEMPTS}
)


@dataclass
class Violation:
    name: str
    detail: str
    rows: list[dict[str, Any]] = field(default_factory=list)

    def render(self) -> str:
        lines = [f"FAILED {self.name}: {self.detail} ({len(self.rows)} rows)"]
        for row in self.rows[:SHOWN_ROWS]:
            lines.append("    " + json.dumps(row, default=str, sort_keys=True))
        if len(self.rows) > SHOWN_ROWS:
            lines.append(f"    ... and {len(self.rows) - SHOWN_ROWS} more")
        return "\n".join(lines)


@dataclass
class Tables:
    operations: list[Any]
    tasks: list[Any]
    effects: list[Any]
    attempts: list[Any]
    lookups: list[Any]
    actions: list[Any]


def read_tables(engine: Engine) -> Tables:
    def rows(table: sa.Table, *order: Any) -> list[Any]:
        with db.read(engine) as conn:
            return list(conn.execute(sa.select(table).order_by(*order)).all())

    return Tables(
        operations=rows(schema.operations, schema.operations.c.operation_id),
        tasks=rows(schema.tasks, schema.tasks.c.id),
        effects=rows(schema.outbox, schema.outbox.c.id),
        attempts=rows(schema.attempts, schema.attempts.c.effect_id, schema.attempts.c.attempt_no),
        lookups=rows(schema.lookups, schema.lookups.c.at, schema.lookups.c.id),
        actions=rows(schema.review_actions, schema.review_actions.c.at, schema.review_actions.c.id),
    )


@dataclass
class Evidence:
    """Everything one phase left behind, gathered after it drained."""

    honours_keys: bool
    keys: dict[str, KeyRecord]
    tables: Tables
    tickets: list[dict[str, Any]]
    key_snapshots: dict[int, str] = field(default_factory=dict)  # effect id -> key first seen
    deadline_breaches: list[dict[str, Any]] = field(default_factory=list)
    unknown_seen: set[int] = field(default_factory=set)


@dataclass
class Checked:
    figures: dict[str, Any]
    violations: list[Violation]

    @property
    def ok(self) -> bool:
        return not self.violations


def check(evidence: Evidence) -> Checked:
    figures: dict[str, Any] = {}
    violations: list[Violation] = []
    _check_calls(evidence, figures, violations)
    _check_effects(evidence, figures, violations)
    return Checked(figures, [v for v in violations if v.rows])


# --- the tool boundary: answers against stored records -------------------------------


def _check_calls(ev: Evidence, figures: dict[str, Any], out: list[Violation]) -> None:
    t = ev.tables
    operations = {op.operation_id: op for op in t.operations}
    tasks = {task.id: task for task in t.tasks}
    effects_of: dict[str, list[Any]] = defaultdict(list)
    for effect in t.effects:
        effects_of[effect.operation_id].append(effect)
    valid = [r for r in ev.keys.values() if r.valid]
    invalid = [r for r in ev.keys.values() if not r.valid]

    never = Violation("every valid key answered", "keys whose calls never got an answer")
    receipts = Violation(
        "receipts byte for byte", "a key answered with different bodies or statuses"
    )
    conflicts = Violation(
        "changed arguments refused", "same key, other arguments, not answered 422 reused"
    )
    refused = Violation("invalid arguments refused", "invalid call not answered 422 after_fix")
    lost = Violation("lost operations: 0", "an accepted request without its task/receipt/effects")
    written = Violation("refused calls write nothing", "a refused key has stored records")
    counted = Violation("tasks created = valid keys", "the counts differ")

    conflicts_answered = replays = lost_reply_recovered = 0
    for record in valid:
        accepted = [(k, r) for k, r in record.answers if k != "changed" and r.ok]
        if not accepted:
            never.rows.append(
                {"key": record.key, "answers": [_answer(k, r) for k, r in record.answers]}
            )
            continue
        first = record.first_answer
        if first is not None and first.outcome is Outcome.REPLAYED:
            lost_reply_recovered += 1  # its first call's own reply was lost, then replayed
        bodies = {(r.status_code, r.body) for _, r in accepted}
        replays += sum(1 for _, r in accepted if r.outcome is Outcome.REPLAYED)
        if len(bodies) != 1:
            receipts.rows.append(
                {"key": record.key, "answers": [_answer(k, r) for k, r in accepted]}
            )
        for kind, result in record.answers:
            if kind != "changed":
                continue
            if result.outcome is Outcome.UNAVAILABLE:
                continue  # no answer at all: nothing to hold against the service
            if result.status_code == 422 and result.problem_slug == "idempotency-key-reused":
                conflicts_answered += 1
            else:
                conflicts.rows.append({"key": record.key, "answer": _answer(kind, result)})
        status, body = next(iter(bodies))
        problem = _stored_problem(record, status, body, operations, tasks, effects_of)
        if problem:
            lost.rows.append({"key": record.key, "problem": problem})
    for record in invalid:
        for kind, result in record.answers:
            if result.outcome is Outcome.UNAVAILABLE:
                continue
            if not (result.status_code == 422 and result.retry == "after_fix"):
                refused.rows.append({"key": record.key, "answer": _answer(kind, result)})
        if record.key in operations or effects_of.get(record.key):
            written.rows.append({"key": record.key})
    valid_keys = {r.key for r in valid}
    strays = [op.operation_id for op in t.operations if op.operation_id not in valid_keys]
    written.rows.extend(
        {"operation_id": key, "problem": "not a planned valid key"} for key in strays
    )
    orphans = [task.id for task in t.tasks if task.operation_id not in operations]
    lost.rows.extend({"task_id": i, "problem": "task without an operation"} for i in orphans)
    if len(t.tasks) != len(valid):
        counted.rows.append({"tasks": len(t.tasks), "valid_keys": len(valid)})

    calls = sum(len(r.answers) for r in ev.keys.values())
    figures.update(
        {
            "operations requested": calls,
            "distinct keys": len(ev.keys),
            "keys with a valid first call": len(valid),
            "keys with invalid arguments": len(invalid),
            # Valid keys the service answered with their receipt (a 2xx): each must be stored.
            "acknowledged creates": sum(
                1 for r in valid if any(k != "changed" and a.ok for k, a in r.answers)
            ),
            "tasks created": len(t.tasks),
            "replays answered": replays,
            "first calls whose reply was lost, then replayed": lost_reply_recovered,
            "conflicts answered (422 reused)": conflicts_answered,
            "invalid calls refused (422)": sum(
                1 for r in invalid for _, a in r.answers if a.status_code == 422
            ),
            "lost operations": len(lost.rows),
        }
    )
    out.extend([never, receipts, conflicts, refused, lost, written, counted])


def _stored_problem(
    record: KeyRecord,
    status: int | None,
    body: bytes,
    operations: dict[str, Any],
    tasks: dict[int, Any],
    effects_of: dict[str, list[Any]],
) -> str | None:
    op = operations.get(record.key)
    if op is None:
        return "answered ok, but no operation record"
    if op.receipt.encode("utf-8") != body or op.status_code != status:
        return f"stored receipt differs from the answer ({op.status_code} vs {status})"
    task = tasks.get(op.task_id)
    if task is None:
        return f"no task {op.task_id}"
    if task.operation_id != record.key:
        return f"task {task.id} belongs to {task.operation_id}"
    assert record.arguments is not None
    expected = 1 if record.arguments.get("helpdesk", True) else 0
    found = len(effects_of.get(record.key, []))
    if found != expected:
        return f"{found} effects, expected {expected}"
    return None


def _answer(kind: str, result: Any) -> dict[str, Any]:
    return {
        "kind": kind,
        "outcome": result.outcome.value,
        "status": result.status_code,
        "problem": result.problem_type,
        "attempts": result.attempts,
        "body": result.body[:200].decode("utf-8", "replace"),
    }


# --- effects: the database against the provider's ledger -----------------------------

_MAY_HAVE_ACTED = frozenset({AttemptOutcome.AMBIGUOUS.value, AttemptOutcome.ABANDONED.value})


def _resends_after_ambiguity(attempts: list[Any]) -> int:
    """Attempts that followed one which may have acted (ambiguous, abandoned, never finished)."""
    ordered = sorted(attempts, key=lambda a: a.attempt_no)
    return sum(1 for a in ordered[:-1] if a.outcome is None or str(a.outcome) in _MAY_HAVE_ACTED)


def _check_effects(ev: Evidence, figures: dict[str, Any], out: list[Violation]) -> None:
    t = ev.tables
    by_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for ticket in ev.tickets:
        by_key[ticket.get("client_reference") or ticket.get("idempotency_key") or ""].append(ticket)
    effect_keys = {e.effect_key: e for e in t.effects}
    attempts_of: dict[int, list[Any]] = defaultdict(list)
    for attempt in t.attempts:
        attempts_of[attempt.effect_id].append(attempt)

    minted = Violation(
        "keys minted for retries: 0", "a key or reference the creating transaction did not store"
    )
    exactly_one = Violation(
        "exactly 1 ticket per succeeded effect", "a succeeded effect with 0 or 2+ tickets"
    )
    failed_clean = Violation("failed means nothing happened", "a failed effect with tickets")
    unsettled = Violation("drained", "an effect still not terminal after the drain")
    resent = Violation(
        "no resend after an ambiguous attempt without a lookup or a resolution",
        "an attempt to a provider that ignores keys, after one that may have acted, "
        "with no not-found lookup or requeue between them",
    )
    deadlines = Violation(
        "terminal or outcome_unknown within deadline + sweep interval",
        "an effect still pending/in flight past its deadline (sampled during the run)",
        list(ev.deadline_breaches),
    )

    for ticket in ev.tickets:
        ref, key = ticket.get("client_reference"), ticket.get("idempotency_key")
        if ref not in effect_keys or (key is not None and key != ref):
            minted.rows.append(ticket)
    for effect in t.effects:
        for attempt in attempts_of[effect.id]:
            if attempt.effect_key != effect.effect_key:
                minted.rows.append(
                    {
                        "effect_id": effect.id,
                        "attempt": attempt.attempt_no,
                        "sent": attempt.effect_key,
                    }
                )
        first_seen = ev.key_snapshots.get(effect.id)
        if first_seen is not None and first_seen != effect.effect_key:
            minted.rows.append(
                {"effect_id": effect.id, "first_seen": first_seen, "now": effect.effect_key}
            )

    lookups_of: dict[int, list[Any]] = defaultdict(list)
    for lookup in t.lookups:
        lookups_of[lookup.effect_id].append(lookup)
    actions_of: dict[int, list[Any]] = defaultdict(list)
    for action in t.actions:
        actions_of[action.effect_id].append(action)

    authorised_resends = 0
    duplicates = 0
    per_effect: Counter[int] = Counter()
    for effect in t.effects:
        tickets = by_key.get(effect.effect_key, [])
        per_effect[len(tickets)] += 1
        duplicates += max(0, len(tickets) - 1)
        row = _effect_row(effect, tickets)
        if effect.status == S.SUCCEEDED:
            if len(tickets) != 1 or tickets[0]["id"] != effect.provider_ref:
                exactly_one.rows.append(row)
        elif effect.status == S.FAILED:
            if tickets:
                failed_clean.rows.append(row)
        else:
            unsettled.rows.append(row)
        if not ev.honours_keys:
            bad, authorised = _resends(
                attempts_of[effect.id], lookups_of[effect.id], actions_of[effect.id]
            )
            authorised_resends += authorised
            if bad:
                resent.rows.append(row | {"attempts": bad})
            elif len(tickets) > 1:
                resent.rows.append(row | {"problem": "2+ tickets at a provider that ignores keys"})

    outcomes = Counter(str(a.outcome) for a in t.attempts)
    lookups = Counter(str(lk.outcome) for lk in t.lookups)
    choices = Counter(str(a.choice) for a in t.actions)
    reached = (
        set(ev.unknown_seen)
        | {lk.effect_id for lk in t.lookups}
        | {a.effect_id for a in t.actions}
        | {e.id for e in t.effects if e.status == S.OUTCOME_UNKNOWN}
    )
    settled_by_lookup = {
        lk.effect_id
        for lk in t.lookups
        if lk.outcome in (LookupOutcome.FOUND, LookupOutcome.NOT_FOUND)
    }
    status = Counter(str(e.status) for e in t.effects)
    figures.update(
        {
            "effects": len(t.effects),
            "effects succeeded": status.get(S.SUCCEEDED, 0),
            "effects failed": status.get(S.FAILED, 0),
            "effects not settled": len(unsettled.rows),
            "tickets at the provider": len(ev.tickets),
            "tickets per effect": dict(sorted(per_effect.items())),
            "duplicate tickets": duplicates,
            "keys minted for retries": len(minted.rows),
            "attempts": len(t.attempts),
            "attempts by outcome": dict(sorted(outcomes.items())),
            "late results (lease lost)": sum(1 for a in t.attempts if a.late),
            "outcome_unknown reached": len(reached),
            "lookups by outcome": dict(sorted(lookups.items())),
            "resolved by lookup": len(settled_by_lookup),
            "review actions by choice": dict(sorted(choices.items())),
            "resolved by review": len({a.effect_id for a in t.actions}),
            "resends authorised by a lookup or an operator": authorised_resends,
            # An attempt after one that may have acted (ambiguous, abandoned or never
            # finished): the same key again, which a key-honouring provider absorbs.
            "resends after ambiguity (same key)": sum(
                _resends_after_ambiguity(attempts_of[e.id]) for e in t.effects
            ),
            "effects settled at their deadline or attempt cap": sum(
                1 for e in t.effects if str(e.reason) in AT_DEADLINE
            ),
            "deadline breaches": len(deadlines.rows),
        }
    )
    out.extend([minted, exactly_one, failed_clean, unsettled, resent, deadlines])


def _effect_row(effect: Any, tickets: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "effect_id": effect.id,
        "operation_id": effect.operation_id,
        "status": str(effect.status),
        "reason": str(effect.reason),
        "attempts": effect.attempts,
        "provider_ref": effect.provider_ref,
        "tickets": [t["id"] for t in tickets],
    }


def _resends(
    attempts: list[Any], lookups: list[Any], actions: list[Any]
) -> tuple[list[dict[str, Any]], int]:
    """Attempts made after one that may have acted, with no authorisation in between.

    An authorisation is a lookup that found nothing, or an operator's "did not
    happen, requeue", recorded after the risky attempt started and before the
    next one started. Returns the offending attempts and how many resends were
    authorised.
    """
    grants: list[datetime] = [lk.at for lk in lookups if lk.outcome == LookupOutcome.NOT_FOUND]
    grants += [a.at for a in actions if a.choice == ReviewChoice.NOT_HAPPENED_REQUEUE]
    grants.sort()
    bad: list[dict[str, Any]] = []
    authorised = 0
    risk_since: datetime | None = None
    for attempt in attempts:
        if risk_since is not None:
            since = risk_since
            if any(since <= g <= attempt.started_at for g in grants):
                authorised += 1
            else:
                bad.append(
                    {
                        "attempt": attempt.attempt_no,
                        "started_at": attempt.started_at.isoformat(),
                        "after_risky_since": since.isoformat(),
                    }
                )
            risk_since = None
        # Unfinished, abandoned, ambiguous, delivered, or finished late (the lease
        # was lost, so the reconciler treated it as abandoned): it may have acted.
        if attempt.outcome is None or attempt.outcome in RISKY or attempt.late:
            risk_since = attempt.started_at
    return bad, authorised
