"""Alembic environment: runs on the connection the caller hands over (``outbox db upgrade``).

Outbox's own migrations use ``schema.metadata`` and alembic's default version
table. An app's migrations (``outbox.app.App.upgrade``) run through this same
file with their own metadata and version table, passed in the config's
attributes, so the two histories never mix.
"""

from __future__ import annotations

from alembic import context

from outbox import schema


def run_migrations() -> None:
    attributes = context.config.attributes
    connection = attributes.get("connection")
    if connection is None:
        raise RuntimeError("run migrations through `outbox db upgrade`, which supplies the engine")
    context.configure(
        connection=connection,
        target_metadata=attributes.get("target_metadata", schema.metadata),
        version_table=attributes.get("version_table", "alembic_version"),
        render_as_batch=connection.dialect.name == "sqlite",
        transactional_ddl=True,
    )
    with context.begin_transaction():
        context.run_migrations()


run_migrations()
