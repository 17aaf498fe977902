"""The chaos run, reduced to fit the test suite: one small phase per database.

Each phase is the real thing at a small size: the API, three dispatchers, the
reconciler and a fake provider as processes started from their command lines,
kill -9 of dispatchers and the API, reconciler restarts, the provider's fault
plan (lost replies, 500s after and before commit, 429s, latency), on
PostgreSQL ``pg_terminate_backend`` of the service's connections; then the
drain, the automatic operator, and every invariant of ``bench.chaos``, checked
by the same code as ``make chaos``. SQLite runs the provider that ignores keys
and has no lookup (every ambiguous send goes to the operator); PostgreSQL runs
the one that ignores keys and answers lookups. ``make chaos`` runs all three
modes on both databases.

The reduced runs are bounded by count, never by the clock: every one of the
150 calls is made, the 3 kills are paced by the load's progress, the drain
waits until every effect is settled, and no assertion reads how long anything
took. A busy machine makes them slower, not different; pytest's timeout is the
only clock.

The first tests feed the checks hand-made evidence, to show that each one can
fail: a check that never fails proves nothing.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from bench.chaos import invariants, load, run
from outbox.client import Outcome, Result
from outbox.states import AttemptOutcome, EffectStatus, LookupOutcome, ReviewChoice

POSTGRES_URL = os.environ.get("OUTBOX_TEST_POSTGRES_URL", "")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# Effects still moving this long past their deadline are a breach. ``make chaos``
# holds the service to one sweep, one lease and one restart; on a machine of unknown
# speed (a restart can take seconds under load) the suite checks that they settle.
DEADLINE_TOLERANCE = timedelta(minutes=2)

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


# --- the checks can fail ----------------------------------------------------------------


def _effect(**fields: Any) -> SimpleNamespace:
    base = {
        "id": 1,
        "operation_id": "k1",
        "effect_key": "obx_1",
        "status": EffectStatus.SUCCEEDED,
        "reason": "delivered",
        "attempts": 1,
        "provider_ref": "tkt_000001",
    }
    return SimpleNamespace(**(base | fields))


def _attempt(no: int, outcome: AttemptOutcome | None, at: float, **fields: Any) -> Any:
    base = {
        "effect_id": 1,
        "attempt_no": no,
        "effect_key": "obx_1",
        "outcome": outcome,
        "started_at": T0 + timedelta(seconds=at),
        "late": False,
    }
    return SimpleNamespace(**(base | fields))


def _evidence(
    *,
    effects: list[Any] | None = None,
    attempts: list[Any] | None = None,
    lookups: list[Any] | None = None,
    actions: list[Any] | None = None,
    tickets: list[dict[str, Any]] | None = None,
    honours_keys: bool = False,
    stored: bool = True,
) -> invariants.Evidence:
    body = b'{"operation_id":"k1","status":"created","task_id":1}'
    record = load.KeyRecord("k1", True, {"subject": "s"})
    answer = Result(Outcome.CREATED, "k1", 1, status_code=201, body=body)
    record.first_answer = answer
    record.answers.append(("first", answer))
    operations = [
        SimpleNamespace(operation_id="k1", receipt=body.decode(), status_code=201, task_id=1)
    ]
    tasks = [SimpleNamespace(id=1, operation_id="k1")]
    return invariants.Evidence(
        honours_keys=honours_keys,
        keys={"k1": record},
        tables=invariants.Tables(
            operations=operations if stored else [],
            tasks=tasks if stored else [],
            effects=effects if effects is not None else [_effect()],
            attempts=attempts
            if attempts is not None
            else [_attempt(1, AttemptOutcome.DELIVERED, 0)],
            lookups=lookups or [],
            actions=actions or [],
        ),
        tickets=tickets
        if tickets is not None
        else [{"id": "tkt_000001", "client_reference": "obx_1", "idempotency_key": "obx_1"}],
    )


def _failed(checked: invariants.Checked) -> set[str]:
    return {v.name for v in checked.violations}


def test_checks_pass_on_a_clean_history() -> None:
    checked = invariants.check(_evidence())
    assert checked.ok, [v.render() for v in checked.violations]


def test_a_resend_after_an_ambiguous_attempt_without_authorisation_fails() -> None:
    attempts = [_attempt(1, AttemptOutcome.AMBIGUOUS, 0), _attempt(2, AttemptOutcome.DELIVERED, 5)]
    checked = invariants.check(_evidence(effects=[_effect(attempts=2)], attempts=attempts))
    assert "no resend after an ambiguous attempt without a lookup or a resolution" in _failed(
        checked
    )


def test_a_resend_after_a_not_found_lookup_or_a_requeue_is_allowed() -> None:
    attempts = [
        _attempt(1, AttemptOutcome.AMBIGUOUS, 0),
        _attempt(2, None, 5, late=True),  # abandoned by the reconciler, result came late
        _attempt(3, AttemptOutcome.DELIVERED, 20),
    ]
    lookups = [
        SimpleNamespace(effect_id=1, at=T0 + timedelta(seconds=2), outcome=LookupOutcome.NOT_FOUND)
    ]
    actions = [
        SimpleNamespace(
            effect_id=1, at=T0 + timedelta(seconds=12), choice=ReviewChoice.NOT_HAPPENED_REQUEUE
        )
    ]
    checked = invariants.check(
        _evidence(
            effects=[_effect(attempts=3)], attempts=attempts, lookups=lookups, actions=actions
        )
    )
    assert checked.ok, [v.render() for v in checked.violations]
    assert checked.figures["resends authorised by a lookup or an operator"] == 2


def test_a_second_ticket_for_a_succeeded_effect_fails() -> None:
    tickets = [
        {"id": "tkt_000001", "client_reference": "obx_1", "idempotency_key": "obx_1"},
        {"id": "tkt_000002", "client_reference": "obx_1", "idempotency_key": "obx_1"},
    ]
    checked = invariants.check(_evidence(tickets=tickets, honours_keys=True))
    assert "exactly 1 ticket per succeeded effect" in _failed(checked)


def test_a_key_the_creating_transaction_did_not_store_fails() -> None:
    tickets = [{"id": "tkt_000001", "client_reference": "obx_1", "idempotency_key": "obx_other"}]
    checked = invariants.check(_evidence(tickets=tickets))
    assert "keys minted for retries: 0" in _failed(checked)


def test_an_accepted_call_without_its_records_is_a_lost_operation() -> None:
    checked = invariants.check(_evidence(stored=False, effects=[], attempts=[], tickets=[]))
    assert "lost operations: 0" in _failed(checked)
    assert "tasks created = valid keys" in _failed(checked)


def test_a_failed_effect_with_a_ticket_fails() -> None:
    effects = [_effect(status=EffectStatus.FAILED, provider_ref=None, reason="permanent")]
    checked = invariants.check(_evidence(effects=effects))
    assert "failed means nothing happened" in _failed(checked)


# --- the reduced run --------------------------------------------------------------------


def _reduced(database: str, phase: str, tmp_path: Path, pg_url: str = "") -> None:
    options = run.PhaseOptions(
        database=database,
        operations=150,
        kills=3,
        seconds=None,
        seed=7,
        dispatchers=3,
        workers=6,
        run_dir=tmp_path,
        pg_admin_url=pg_url or run.PG_ADMIN_URL_DEFAULT,
        deadline_tolerance=DEADLINE_TOLERANCE,
    )
    result = run.run_phase(run.PHASES[phase], options, log=lambda _message: None)
    report = "\n".join(
        [f"{k}: {v}" for k, v in result.figures.items()]
        + [v.render() for v in result.violations]
        + [result.error or ""]
    )
    assert result.ok, report
    figures = result.figures
    assert figures["calls made"] == 150, report
    assert figures["calls skipped (time bound)"] == 0, report
    assert figures["kills (kill -9)"] == 3, report
    assert figures["provider faults injected"] > 0, report
    assert figures["outcome_unknown reached"] > 0, report  # the hard path was taken
    assert figures["lost operations"] == 0 and figures["keys minted for retries"] == 0, report
    assert figures["tasks created"] == figures["keys with a valid first call"], report
    assert "drain" not in figures, report  # settled, not cut off by the safety net


@pytest.mark.e2e
@pytest.mark.slow
def test_reduced_chaos_run_on_sqlite(tmp_path: Path) -> None:
    _reduced("sqlite", "ignore_nolookup", tmp_path)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.postgres
def test_reduced_chaos_run_on_postgres(tmp_path: Path) -> None:
    if not POSTGRES_URL:
        if IN_CI:
            pytest.fail(
                "CI=true but OUTBOX_TEST_POSTGRES_URL is not set: PostgreSQL tests must run"
            )
        pytest.skip("OUTBOX_TEST_POSTGRES_URL is not set")
    _reduced("postgres", "ignore_lookup", tmp_path, POSTGRES_URL)
