from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from outbox import Outbox, db, schema


@pytest.fixture
def box(db_url: str, clock) -> Iterator[Outbox]:
    with Outbox(db_url, clock=clock) as outbox:
        outbox.create_tenant("acme")
        outbox.create_tenant("globex")
        yield outbox
        # No connection may leak out of a test (a leaked one holds SQLite's lock).
        assert db.in_use(outbox.engine) == 0


def counts(box: Outbox) -> dict[str, int]:
    with db.read(box.engine) as conn:
        return {
            name: conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one()
            for name, table in (
                ("tasks", schema.tasks),
                ("operations", schema.operations),
                ("outbox", schema.outbox),
            )
        }
