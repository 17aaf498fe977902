"""Alembic environment: runs on the connection the caller hands over (``outbox db upgrade``)."""

from __future__ import annotations

from alembic import context

from outbox import schema

target_metadata = schema.metadata


def run_migrations() -> None:
    connection = context.config.attributes.get("connection")
    if connection is None:
        raise RuntimeError("run migrations through `outbox db upgrade`, which supplies the engine")
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        transactional_ddl=True,
    )
    with context.begin_transaction():
        context.run_migrations()


run_migrations()
