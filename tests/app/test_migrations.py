"""``outbox db upgrade``: Outbox's migrations, then the app's, in the app's own version table.

On SQLite and PostgreSQL, from an empty database and from one Outbox has
already migrated; twice is a no-op; and a process refuses to serve an app
whose tables are behind its migrations.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from outbox import Outbox, cli, db, settings
from outbox.app import AppSchemaNotCurrent
from tests.app.conftest import EXAMPLE_APP


def tables(url: str) -> set[str]:
    engine = db.create_engine(settings.load(), url=url)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def versions(url: str) -> dict[str, str]:
    engine = db.create_engine(settings.load(), url=url)
    try:
        with engine.connect() as conn:
            return {
                table: conn.execute(sa.text(f"SELECT version_num FROM {table}")).scalar_one()
                for table in ("alembic_version", "alembic_version_refunds")
            }
    finally:
        engine.dispose()


def test_upgrade_applies_the_apps_migrations_after_outboxs_and_twice_is_a_no_op(
    db_url, example_path, capsys
):
    # db_url is migrated for Outbox already: only the app's migrations are new.
    with pytest.raises(AppSchemaNotCurrent, match="app 'refunds' are not migrated"):
        Outbox(db_url, app=_app())
    assert cli.main(["db", "upgrade", "--app", EXAMPLE_APP, "--database-url", db_url]) == 0
    out = capsys.readouterr().out
    assert f"already at {db.head_revision()}; nothing to do" in out
    assert "app refunds: upgraded empty -> refunds_0001" in out
    assert {"refunds", "alembic_version_refunds", "operations"} <= tables(db_url)
    assert versions(db_url) == {
        "alembic_version": db.head_revision(),
        "alembic_version_refunds": "refunds_0001",
    }

    assert cli.main(["db", "upgrade", "--app", EXAMPLE_APP, "--database-url", db_url]) == 0
    assert "app refunds: already at refunds_0001; nothing to do" in capsys.readouterr().out
    assert cli.main(["db", "current", "--app", EXAMPLE_APP, "--database-url", db_url]) == 0
    assert "app refunds: current: refunds_0001; code: refunds_0001" in capsys.readouterr().out
    with Outbox(db_url, app=_app()) as box:
        assert box.tools.names() == ["issue_refund", "notify_customer"]


def test_upgrade_of_an_empty_database_creates_both(tmp_path: Path, example_path, capsys):
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    assert cli.main(["--app", EXAMPLE_APP, "--database-url", url, "db", "upgrade"]) == 0
    out = capsys.readouterr().out
    assert (
        f"upgraded empty -> {db.head_revision()}" in out and "upgraded empty -> refunds_0001" in out
    )
    assert versions(url)["alembic_version_refunds"] == "refunds_0001"


def test_the_apps_tables_match_its_metadata(app_db_url, refunds_app):
    engine = db.create_engine(settings.load(), url=app_db_url)
    try:
        columns = {c["name"] for c in sa.inspect(engine).get_columns("refunds")}
    finally:
        engine.dispose()
    assert columns == set(refunds_app.metadata.tables["refunds"].columns.keys())


def test_the_default_app_has_no_migrations_of_its_own(db_url, capsys):
    assert cli.main(["db", "upgrade", "--database-url", db_url]) == 0
    assert "app " not in capsys.readouterr().out
    assert "alembic_version_demo" not in tables(db_url)


def _app():
    from refunds_app.app import app

    return app
