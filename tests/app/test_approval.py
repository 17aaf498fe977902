"""The example's one approval rule: a refund over 500.00 waits for an operator.

``Tool.requires_approval`` may be a function of the validated arguments. The
call it holds answers 202 awaiting_approval with its effect held; a retry of
the same call is held the same way (a replay); a refund under the limit goes
straight to the dispatcher. And a refund declares itself destructive.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from outbox import Outbox, db, errors, schema, settings, states
from outbox.app import App

SMALL = {"order_id": "ord_1", "amount_cents": 1999, "currency": "EUR", "reason": "damaged"}
LARGE = {**SMALL, "order_id": "ord_2", "amount_cents": 75_000}


def _effect(box: Outbox, operation_id: str) -> sa.Row:
    with db.read(box.engine) as conn:
        query = sa.select(schema.outbox).where(schema.outbox.c.operation_id == operation_id)
        return conn.execute(query).one()


def test_a_refund_over_the_limit_is_held_and_one_under_it_is_not(
    app_db_url: str, refunds_app: App, clock
) -> None:
    tool = refunds_app.tools.get("issue_refund")
    assert tool.destructive
    with Outbox(app_db_url, app=refunds_app, clock=clock) as box:
        box.create_tenant("shop")
        small = box.execute("shop", "small", "issue_refund", SMALL)
        large = box.execute("shop", "large", "issue_refund", LARGE)
        again = box.execute("shop", "large", "issue_refund", LARGE)
        assert (small.status_code, large.status_code) == (201, 202)
        assert (again.replayed, again.status_code, again.receipt_json) == (
            True,
            202,
            large.receipt_json,
        )
        assert _effect(box, "small").status == states.EffectStatus.PENDING
        assert _effect(box, "large").status == states.EffectStatus.HELD
        box.decide_approval("shop", "large", "approve", actor="alice")
        assert _effect(box, "large").status == states.EffectStatus.PENDING


def test_a_rule_that_raises_writes_nothing(app_db_url: str, refunds_app: App, clock) -> None:
    """The rule is the app's code, run in the create: if it fails, the create fails whole."""
    import dataclasses

    def broken(args: object) -> bool:
        raise RuntimeError("the limits service is down")

    tool = dataclasses.replace(refunds_app.tools.get("issue_refund"), requires_approval=broken)
    app = App(
        "refunds",
        tools=[tool],
        adapters_file=refunds_app.adapters_file,
        metadata=refunds_app.metadata,
        migrations=refunds_app.migrations,
    )
    with Outbox(app_db_url, app=app, clock=clock) as box:
        box.create_tenant("shop")
        with pytest.raises(RuntimeError, match="limits service"):
            box.execute("shop", "op", "issue_refund", LARGE)
        from refunds_app import tables

        with db.read(box.engine) as conn:
            counts = [
                conn.execute(sa.select(sa.func.count()).select_from(t)).scalar_one()
                for t in (tables.refunds, schema.operations, schema.outbox)
            ]
        assert counts == [0, 0, 0]


@pytest.mark.postgres
def test_only_a_statement_that_wrote_a_pending_row_wakes_the_dispatchers(
    postgres_url: str, refunds_app: App, clock
) -> None:
    """A NOTIFY costs every notifying commit a cluster-wide lock and wakes every
    dispatcher: a created pending effect sends one; a replay (whose statement looks
    the key up and inserts nothing), a held effect and a refused create send none;
    the approval that releases a held effect sends its own."""
    from tests.support import notify

    engine = db.create_engine(settings.load(), url=postgres_url)
    try:
        refunds_app.upgrade(engine)
    finally:
        engine.dispose()
    with (
        notify.listener(postgres_url) as listener,
        Outbox(postgres_url, app=refunds_app, clock=clock) as box,
    ):
        box.create_tenant("shop")
        # A dispatcher sleeps (the gate: tests/dispatcher/test_wakeup_gate.py).
        with db.write(box.engine) as conn:
            conn.execute(sa.update(schema.dispatch_wakeup).values(sleepers=1))

        def sent(action) -> int:
            """Notifications the action's commits sent."""
            action()
            return notify.notifications(listener, postgres_url)

        assert sent(lambda: box.execute("shop", "small", "issue_refund", SMALL)) == 1
        assert sent(lambda: box.execute("shop", "small", "issue_refund", SMALL)) == 0
        assert sent(lambda: box.execute("shop", "large", "issue_refund", LARGE)) == 0
        assert sent(lambda: box.execute("shop", "large", "issue_refund", LARGE)) == 0
        with pytest.raises(errors.IdempotencyKeyReused):
            sent(lambda: box.execute("shop", "small", "issue_refund", LARGE))
        assert sent(lambda: None) == 0  # the refused create sent nothing
        assert sent(lambda: box.decide_approval("shop", "large", "approve", actor="alice")) == 1
