"""Recording a batch's results costs the same whatever the tables hold (PostgreSQL).

The finish statement (``store._PG_FINISH``) updates each outbox row and its
attempt row. Joined to the batch by value, the planner hashed the whole
attempts table when its statistics were young (every new database, the first
minutes of a drain) and read every ``in_flight`` row through the partial lease
index, so a drain slowed as it went. These hold the plan to primary-key
lookups on a table with a history and other workers' leases, never analyzed.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy.engine import Engine

from outbox import db, schema, settings
from outbox.delivery import policy, store
from outbox.states import AttemptOutcome, EffectStatus, Reason
from tests.dispatcher.support import attempts, bulk, rows, seed

S = EffectStatus
LEASE = timedelta(seconds=60)
HISTORY = 5_000  # finished effects, each with its attempt row
LEASED = 1_000  # effects in flight at another worker


@pytest.fixture
def engine(postgres_url: str) -> Iterator[Engine]:
    engine = db.create_engine(settings.load(), url=postgres_url)
    yield engine
    engine.dispose()


def _claim(engine: Engine, owner: str, limit: int) -> list[store.Claimed]:
    params = store.ClaimParams(
        owner=owner, lease=LEASE, limit=limit, unsettled_adapters=frozenset()
    )
    return list(store.claim_due(engine, params, lambda _candidate, _now: True).effects)


def _history(engine: Engine) -> None:
    """Finished effects with their attempt rows, and others leased to a slow worker."""
    bulk(engine, HISTORY, prefix="old", delivered=True)
    bulk(engine, LEASED, prefix="slow", leased_to="slow-worker")


def _delivered(c: store.Claimed) -> store.Finish:
    at = schema.utcnow()
    decision = policy.Decision(S.SUCCEEDED, Reason.DELIVERED, True)
    return store.Finish(
        c.id, c.fence, c.attempt_no, at, AttemptOutcome.DELIVERED, decision, 200,
        provider_ref=f"ref-{c.id}", attempt_provider_ref=f"ref-{c.id}",
    )  # fmt: skip


def _scans(node: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Every scan of a table or an index in a plan: (node type, relation, index), '' if none."""
    found = []
    if "Scan" in node["Node Type"] and ("Relation Name" in node or "Index Name" in node):
        found.append((node["Node Type"], node.get("Relation Name", ""), node.get("Index Name", "")))
    for child in node.get("Plans", []):
        found += _scans(child)
    return found


def test_a_finish_looks_its_rows_up_by_key_however_big_the_tables(engine) -> None:
    _history(engine)
    seed(engine, 100, now=schema.utcnow() - timedelta(seconds=1), prefix="new")
    claimed = _claim(engine, "w1", 100)
    assert len(claimed) == 100 and all(c.operation_id.startswith("new") for c in claimed)
    finishes = [_delivered(c) for c in claimed]

    with db.write(engine) as conn:
        (plan,) = conn.exec_driver_sql(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + store._PG_FINISH,
            {"batch": store._pg_batch(finishes)},
        ).one()
    top = (json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"]
    scans = _scans(top)
    # Neither table is read beyond the batch's rows: no sequential scan, and not
    # the lease index, which holds every row in flight (the slow worker's too).
    assert not [s for s in scans if s[0] == "Seq Scan"], scans
    assert not [s for s in scans if s[2] == "ix_outbox_leased"], scans
    assert {s[1] for s in scans} >= {"outbox", "attempts"}, scans
    # What the database read for 100 results: a few pages per row, not the tables.
    assert top["Shared Hit Blocks"] + top.get("Shared Read Blocks", 0) < 40 * 100

    # And the statement did its work: every row succeeded, every attempt finished.
    after = rows(engine)
    for c in claimed:
        r = after[c.id]
        assert (r.status, r.provider_ref, r.lease_owner) == (S.SUCCEEDED, f"ref-{c.id}", None)
        (a,) = attempts(engine, c.id)
        assert (a.outcome, a.late, a.provider_ref) == (
            AttemptOutcome.DELIVERED,
            False,
            f"ref-{c.id}",
        )
    # The slow worker's leases are untouched.
    leased = [r for r in after.values() if r.status == S.IN_FLIGHT]
    assert len(leased) == LEASED and {r.lease_owner for r in leased} == {"slow-worker"}


def _plans_of_finishes(engine: Engine) -> list[dict[str, Any]]:
    """From now on, the plan of every finish statement run on the engine's one
    connection, as PostgreSQL's ``auto_explain`` reports it to the client."""
    plans: list[dict[str, Any]] = []

    def on_notice(diag: Any) -> None:
        text = diag.message_primary or ""
        if "plan:" in text and "jsonb_to_recordset" in text:
            plans.append(json.loads(text.split("plan:", 1)[1])["Plan"])

    with engine.connect() as conn:
        conn.connection.driver_connection.add_notice_handler(on_notice)  # type: ignore[union-attr]
        for sql in (
            "LOAD 'auto_explain'",
            "SET auto_explain.log_min_duration = 0",
            "SET auto_explain.log_format = 'json'",
            "SET client_min_messages = 'log'",
        ):
            conn.exec_driver_sql(sql)
        conn.commit()
    return plans


def test_a_finish_first_run_on_a_small_table_still_reads_by_key_once_it_has_grown(
    postgres_url: str,
) -> None:
    # One connection for everything: what a dispatcher's connection sees over a drain.
    engine = db.create_engine(settings.load(), url=postgres_url, pool_size=1, max_overflow=0)
    try:
        # A new database: the first batches finish while attempts holds a few rows.
        # A statement the driver prepares (after 5 runs) gets PostgreSQL's generic
        # plan after 5 more, priced on the tables as they were then.
        for round_no in range(15):
            seed(engine, 1, now=schema.utcnow() - timedelta(seconds=1), prefix=f"early{round_no}")
            early = _claim(engine, "w1", 1)
            assert store.finish_attempts(engine, [_delivered(c) for c in early]).recorded
        # The drain goes on: thousands of attempt rows later, not yet analysed.
        bulk(engine, 20_000, prefix="old", delivered=True)
        seed(engine, 100, now=schema.utcnow() - timedelta(seconds=1), prefix="new")
        claimed = _claim(engine, "w1", 100)
        assert len(claimed) == 100
        plans = _plans_of_finishes(engine)
        recorded = store.finish_attempts(engine, [_delivered(c) for c in claimed])

        assert recorded.recorded == {c.id for c in claimed} and not recorded.late
        (plan,) = plans
        scans = _scans(plan)
        assert {s[1] for s in scans} >= {"outbox", "attempts"}, scans
        assert not [s for s in scans if s[0] == "Seq Scan"], scans
    finally:
        engine.dispose()


def test_a_finish_writes_each_instant_to_the_microsecond(engine) -> None:
    """The batch carries ``at`` as seconds since the epoch: every microsecond must
    come back as it was, today's instants and the century's last ones alike."""
    seed(engine, 300, now=schema.utcnow() - timedelta(seconds=1), prefix="t")
    claimed = _claim(engine, "w1", 300)
    rng = random.Random(7)
    base = [schema.utcnow(), datetime(2099, 12, 31, 23, 59, 59, tzinfo=UTC)]
    finishes = []
    for i, c in enumerate(claimed):
        at = base[i % 2] - timedelta(
            seconds=rng.randrange(10**8), microseconds=rng.randrange(10**6)
        )
        delivered = AttemptOutcome.DELIVERED
        finish = store.Finish(
            c.id, c.fence, c.attempt_no, at, delivered, policy.DELIVERED, 200, None, "r", "r"
        )
        finishes.append(finish)
    assert store.finish_attempts(engine, finishes).recorded == {c.id for c in claimed}

    after = rows(engine)
    tried = {a.effect_id: a for a in attempts(engine)}
    for f in finishes:
        assert after[f.effect_id].finished_at == f.at
        assert after[f.effect_id].updated_at == f.at
        assert tried[f.effect_id].finished_at == f.at
