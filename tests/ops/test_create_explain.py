"""``python -m bench.perf.create_explain``: the server's side of a create, part by part.

The timings are never tested; that each part is read off the plans of the very
statements a create and the minimal transaction send, and adds up, is.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from bench.perf import create_explain, harness
from outbox import db, schema, settings

pytestmark = pytest.mark.postgres


def test_each_part_of_the_servers_time_is_read_off_the_plans(postgres_url: str) -> None:
    engine = db.create_engine(settings.load(), url=postgres_url, poolclass=sa.pool.NullPool)
    try:
        harness.prepare(engine)
        parts = create_explain.measure(3, postgres_url)
        with engine.connect() as conn:
            # Every create ran and committed: the warm-up's and the measured ones.
            made = create_explain.WARMUP + 3
            assert conn.scalar(sa.select(sa.func.count()).select_from(schema.outbox)) == made
            assert conn.scalar(sa.text("SELECT count(*) FROM minimal_outbox")) == made
    finally:
        engine.dispose()

    ours = {part for part, by in parts.items() if create_explain.OUTBOX in by}
    # Our statement writes the three tables and fires each trigger a create pays for.
    assert {"insert operations", "insert tasks", "insert outbox"} <= ours
    assert {
        "foreign key tasks -> tenants",
        "foreign key operations -> tenants",
        "foreign key outbox -> operations",
        "trigger trg_outbox_notify_pending",
    } <= ours
    # The minimal transaction writes its two tables and fires nothing.
    minimal = {part for part, by in parts.items() if create_explain.MINIMAL in by}
    assert {"insert minimal_tasks", "insert minimal_outbox"} <= minimal
    assert not any(part.startswith(("foreign key", "trigger")) for part in minimal)
    for system in (create_explain.OUTBOX, create_explain.MINIMAL):
        assert parts[create_explain.EXECUTION][system] > 0
        # The whole create's WAL holds its inserts' and its commit record.
        assert parts[create_explain.WAL_BYTES][system] > parts[create_explain.WAL_INSERTS][system]
        assert parts[create_explain.WAL_INSERTS][system] > 0

    lines = create_explain.table(parts)
    assert create_explain.OUTBOX in lines[0] and create_explain.MINIMAL in lines[0]
    assert any(line.strip().startswith("foreign key outbox -> operations") for line in lines)
    assert len(lines) == 1 + len(parts)


def test_a_transactions_parts_sum_its_statements_and_nothing_is_lost() -> None:
    plan = {
        "Node Type": "ModifyTable",
        "Relation Name": "t",
        "Actual Total Time": 0.05,
        "WAL Bytes": 100,
        "Plans": [{"Node Type": "Result", "Actual Total Time": 0.01}],
    }
    document = {
        "Plan": plan,
        "Execution Time": 0.08,
        "Planning Time": 0.02,
        "Triggers": [{"Trigger Name": "RI_x", "Time": 0.02, "Calls": 1}],
    }
    parts = create_explain._parts([document, document], {"RI_x": "foreign key t -> u"}, 250)
    assert parts["insert t"] == pytest.approx(0.08)  # 0.04 each, without its feeding child
    assert parts["foreign key t -> u"] == pytest.approx(0.04)
    assert parts[create_explain.EXECUTION] == pytest.approx(0.16)
    assert parts[create_explain.OTHER] == pytest.approx(0.16 - 0.08 - 0.04)
    assert parts[create_explain.WAL_INSERTS] == 200  # each insert's own, summed
    assert parts[create_explain.WAL_BYTES] == 250  # the whole create's, as measured
