"""Counting the wake-up's NOTIFYs on a LISTEN connection of a test's own."""

from __future__ import annotations

from typing import Any

import psycopg
import sqlalchemy as sa

from outbox import schema


def dsn(url: str) -> str:
    """libpq's form of a SQLAlchemy PostgreSQL URL."""
    return sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def listener(url: str) -> psycopg.Connection[Any]:
    conn = psycopg.connect(dsn(url), autocommit=True)
    conn.execute(f"LISTEN {schema.NOTIFY_CHANNEL}")
    return conn


def notifications(listening: psycopg.Connection[Any], url: str) -> int:
    """The NOTIFYs that arrived since the last call: delivered in commit order, so
    once our own marker arrives, every one committed before it has."""
    with psycopg.connect(dsn(url), autocommit=True) as other:
        other.execute("SELECT pg_notify(%s, 'marker')", [schema.NOTIFY_CHANNEL])
    for count, note in enumerate(listening.notifies()):
        if note.payload == "marker":
            return count
    raise AssertionError("unreachable")
