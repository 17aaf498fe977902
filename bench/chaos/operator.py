"""The automatic operator: resolves review items the way a person with access to
the provider would, through the real review API (``reconciler.review``), never SQL.

For each item awaiting review it reads the provider's ledger
(``GET /_admin/effects``) for a ticket carrying the effect's key (as client
reference or idempotency key):

- found: ``happened``, with that ticket's id as the provider reference;
- not found: ``not_happened_requeue``, so the dispatchers deliver it again
  under the same key.

Each action names the attempt count it saw (``expected_attempts``) and an
action id made of the effect id and that count, so a repeated pass is a replay
and a row that moved meanwhile is a conflict, not a second action.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import httpx
from sqlalchemy.engine import Engine

from outbox import errors
from reconciler import review

ACTOR = "chaos-operator"
LIST_LIMIT = 1000


def ledger(provider_url: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{provider_url}/_admin/effects", timeout=30.0)
    response.raise_for_status()
    tickets: list[dict[str, Any]] = response.json()["effects"]
    return tickets


def resolve_pass(engine: Engine, provider_url: str, effect_deadline: Any) -> Counter[str]:
    """One pass over everything awaiting review; what was decided, by choice."""
    done: Counter[str] = Counter()
    items = review.list_items(engine, group=review.Group.AWAITING_REVIEW, limit=LIST_LIMIT)
    if not items:
        return done
    by_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for ticket in ledger(provider_url):
        for field in ("client_reference", "idempotency_key"):
            if ticket.get(field):
                by_key[ticket[field]].append(ticket)
    for item in items:
        tickets = sorted(
            {t["id"]: t for t in by_key.get(item["effect_key"], [])}.values(), key=lambda t: t["id"]
        )
        if tickets:
            choice = review.Choice.HAPPENED
            provider_ref: str | None = tickets[0]["id"]
            reason = f"provider ledger shows ticket {provider_ref} for this effect key"
        else:
            choice = review.Choice.NOT_HAPPENED_REQUEUE
            provider_ref = None
            reason = "provider ledger has no ticket for this effect key"
        try:
            result = review.resolve(
                engine,
                item["id"],
                choice=choice,
                reason=reason,
                actor=ACTOR,
                action_id=f"chaos-{item['id']}-{item['attempts']}",
                expected_attempts=item["attempts"],
                provider_ref=provider_ref,
                effect_deadline=effect_deadline,
            )
        except errors.ReviewConflict:
            done["conflict"] += 1  # it moved since we listed it: the next pass sees it again
            continue
        done["replayed" if result.replayed else choice.value] += 1
    return done
