"""Each enum column's CHECK as one constant list (PostgreSQL only).

The CHECKs SQLAlchemy wrote for the enum columns (``status IN ('held', ...)``) are
stored by PostgreSQL as an ``ARRAY['held'::varchar, ...]`` cast to ``text[]``, and
the server rebuilds that array in every statement that writes the table: reading a
create's plan part by part (``python -m bench.perf.create_explain``), the outbox
row's three enum CHECKs cost it about 45 µs, and written as
``status::text = ANY ('{held,...}'::text[])`` (one constant) about 25. The values
are the same, so every row that met the old CHECK meets the new one.

Each table is altered by one statement (its drops and adds), which checks its rows
once against the new constraints, under the ALTER's lock: 0.23 to 0.33 s for an
outbox table of 500,000 rows. SQLite reads a CHECK once per prepared statement: nothing to
do there (``schema.OneOf`` keeps ``IN`` for it).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-08
"""

from __future__ import annotations

from collections.abc import Callable

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

# The values of this revision, not the schema module's (which may change later):
# (constraint, column, values) by table.
_CHECKS: dict[str, list[tuple[str, str, list[str]]]] = {
    "api_tokens": [
        ("ck_api_tokens_role", "role", ["agent", "operator"]),
    ],
    "operations": [
        ("ck_operations_approval", "approval", ["awaiting_approval", "approved", "rejected"]),
    ],
    "tasks": [
        ("ck_tasks_priority", "priority", ["low", "normal", "high"]),
    ],
    "approval_actions": [
        ("ck_approval_actions_decision", "decision", ["approve", "reject"]),
    ],
    "outbox": [
        (
            "ck_outbox_status",
            "status",
            ["held", "pending", "in_flight", "succeeded", "failed", "outcome_unknown"],
        ),
        (
            "ck_outbox_reason",
            "reason",
            [
                "created",
                "claimed",
                "delivered",
                "permanent",
                "not_sent",
                "retryable",
                "ambiguous_keys_honoured",
                "ambiguous_no_key_support",
                "lease_expired",
                "released",
                "deadline_nothing_sent",
                "deadline_may_have_sent",
                "max_attempts",
                "adapter_error",
                "lookup_found",
                "lookup_not_found",
                "review_no_lookup",
                "review_lookup_exhausted",
                "operator_happened",
                "operator_requeue",
                "operator_abandon",
                "awaiting_approval",
                "approved",
                "rejected",
            ],
        ),
        ("ck_outbox_settled_by", "settled_by", ["lookup", "webhook", "operator"]),
    ],
    "attempts": [
        (
            "ck_attempts_outcome",
            "outcome",
            [
                "delivered",
                "not_sent",
                "retryable",
                "permanent",
                "ambiguous",
                "adapter_error",
                "abandoned",
            ],
        ),
    ],
    "lookups": [
        ("ck_lookups_lookup_outcome", "outcome", ["found", "not_found", "inconclusive", "error"]),
    ],
    "review_actions": [
        (
            "ck_review_actions_choice",
            "choice",
            ["happened", "not_happened_requeue", "not_happened_abandon"],
        ),
    ],
    "webhook_events": [
        (
            "ck_webhook_events_disposition",
            "disposition",
            ["unmatched", "settled", "confirmed", "conflict", "ignored"],
        ),
    ],
}


def upgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    for table, checks in _CHECKS.items():
        _replace(table, checks, _constant)


def downgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    for table, checks in _CHECKS.items():
        _replace(table, checks, _in)


def _constant(column: str, values: list[str]) -> str:
    return f"{column}::text = ANY ('{{{','.join(values)}}}'::text[])"


def _in(column: str, values: list[str]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def _replace(
    table: str, checks: list[tuple[str, str, list[str]]], form: Callable[[str, list[str]], str]
) -> None:
    actions = [f"DROP CONSTRAINT {name}" for name, _, _ in checks] + [
        f"ADD CONSTRAINT {name} CHECK ({form(column, values)})" for name, column, values in checks
    ]
    op.execute(f"ALTER TABLE {table} " + ", ".join(actions))
