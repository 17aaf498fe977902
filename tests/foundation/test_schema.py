"""The database itself refuses illegal rows, and the schema guard refuses stale schemas."""

from __future__ import annotations

import re
import threading
from datetime import timedelta

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from outbox import Outbox, db, errors, schema, settings


@pytest.fixture
def effect_id(box: Outbox) -> int:
    box.execute("acme", "op-1", "create_support_task", {"subject": "s"})
    with db.read(box.engine) as conn:
        return int(conn.execute(sa.select(schema.outbox.c.id)).scalar_one())


def _update(box: Outbox, effect_id: int, **values) -> None:
    with db.write(box.engine) as conn:
        conn.execute(
            sa.update(schema.outbox).where(schema.outbox.c.id == effect_id).values(**values)
        )


def test_effect_key_update_is_refused_by_the_database(box: Outbox, effect_id: int):
    with pytest.raises(sa.exc.DBAPIError, match="effect_key is immutable"):
        _update(box, effect_id, effect_key="obx_minted_again")
    # Through raw SQL too: the trigger, not Python, is the guard.
    with (
        pytest.raises(sa.exc.DBAPIError, match="effect_key is immutable"),
        db.write(box.engine) as conn,
    ):
        conn.exec_driver_sql("UPDATE outbox SET effect_key = 'x'")


def test_same_effect_key_write_is_allowed(box: Outbox, effect_id: int):
    with db.read(box.engine) as conn:
        key = conn.execute(sa.select(schema.outbox.c.effect_key)).scalar_one()
    _update(box, effect_id, effect_key=key)  # a no-op update of the column is harmless


@pytest.mark.parametrize(
    ("values", "constraint"),
    [
        ({"status": "exploded"}, "ck_outbox_status"),
        ({"status": "succeeded", "provider_ref": "T-1"}, "terminal_has_finished_at"),
        ({"status": "failed"}, "terminal_has_finished_at"),
        ({"status": "in_flight"}, "in_flight_has_lease"),
        ({"needs_review": True}, "review_only_when_unknown"),
        ({"attempts": -1}, "counts_not_negative"),
    ],
)
def test_illegal_rows_are_refused_by_the_database(box: Outbox, effect_id: int, values, constraint):
    with pytest.raises(sa.exc.IntegrityError, match=constraint), db.write(box.engine) as conn:
        # Raw SQL: bypass the enum validation SQLAlchemy would do in Python.
        sets = ", ".join(f"{k} = :{k}" for k in values)
        conn.execute(
            sa.text(f"UPDATE outbox SET {sets} WHERE id = :id"), {**values, "id": effect_id}
        )


def test_succeeded_needs_a_provider_ref(box: Outbox, effect_id: int, clock):
    with pytest.raises(sa.exc.IntegrityError, match="succeeded_has_provider_ref"):
        _update(box, effect_id, status="succeeded", finished_at=clock())
    _update(box, effect_id, status="succeeded", finished_at=clock(), provider_ref="T-1")


def test_migrated_schema_matches_the_code(db_url):
    engine = db.create_engine(settings.load(), url=db_url)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), schema.metadata)
        assert diff == []
    finally:
        engine.dispose()


def _enum_checks() -> list[tuple[str, str, str, list[str]]]:
    """(table, constraint, column, values) of every enum column the code declares."""
    return [
        (table.name, f"ck_{table.name}_{column.type.name}", column.name, list(column.type.enums))
        for table in schema.metadata.sorted_tables
        for column in table.columns
        if isinstance(column.type, sa.Enum)
    ]


def _checks_in_database(conn: sa.Connection) -> dict[str, str]:
    if conn.dialect.name == "postgresql":
        rows = conn.exec_driver_sql(
            "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint WHERE contype = 'c'"
        )
        return {name: text for name, text in rows}
    found = {}
    for (sql,) in conn.exec_driver_sql("SELECT sql FROM sqlite_master WHERE type = 'table'"):
        for match in re.finditer(r"CONSTRAINT (ck_\w+) CHECK \(([^\n]*)", sql or ""):
            found[match.group(1)] = match.group(2)
    return found


def test_each_enum_columns_check_admits_exactly_its_values(db_url):
    """A migration that adds a value to an enum must add it to the column's CHECK; and
    on PostgreSQL the list is one constant (migration 0010), not an ARRAY[...] that the
    server rebuilds in every statement writing the table."""
    engine = db.create_engine(settings.load(), url=db_url)
    try:
        with engine.connect() as conn:
            found = _checks_in_database(conn)
            postgres = conn.dialect.name == "postgresql"
    finally:
        engine.dispose()
    checks = _enum_checks()
    assert len(checks) == 11
    for table, name, column, values in checks:
        assert name in found, f"{table}.{column}: no CHECK named {name}"
        text = found[name]
        if postgres:
            assert "ARRAY[" not in text, (
                f"{name} is {text}: write it as schema.OneOf does, "
                f"{column}::text = ANY ('{{...}}'::text[])"
            )
            listed = re.fullmatch(
                rf"CHECK \(\(\({column}\)::text = ANY \('\{{([a-z0-9_,]*)\}}'::text\[\]\)\)\)", text
            )
            assert listed, f"{name}: {text}"
            assert listed.group(1).split(",") == values, name
        else:
            assert re.findall(r"'([a-z0-9_]+)'", text.split(")", 1)[0]) == values, name


def test_the_constant_form_refuses_what_the_list_does(box: Outbox, effect_id: int):
    # Case matters, and so does a value of another enum column.
    for column, value in (("status", "PENDING"), ("reason", "lookup"), ("settled_by", "x")):
        sql = f"UPDATE outbox SET {column} = '{value}' WHERE id = {effect_id}"
        with (
            pytest.raises(sa.exc.IntegrityError, match=f"ck_outbox_{column}"),
            db.write(box.engine) as conn,
        ):
            conn.exec_driver_sql(sql)


def test_migrations_from_empty_and_twice(tmp_path):
    engine = db.create_engine(settings.load(), url=f"sqlite:///{tmp_path / 'fresh.db'}")
    try:
        assert db.current_revision(engine) is None
        with pytest.raises(errors.SchemaNotCurrent, match="outbox db upgrade"):
            db.check_schema(engine)
        assert db.upgrade(engine) == (None, db.head_revision())
        assert db.upgrade(engine) == (db.head_revision(), db.head_revision())
        db.check_schema(engine)
    finally:
        engine.dispose()


def test_a_schema_newer_than_the_code_is_refused(db_url):
    engine = db.create_engine(settings.load(), url=db_url)
    try:
        with db.write(engine) as conn:
            conn.exec_driver_sql("UPDATE alembic_version SET version_num = '9999_future'")
        with pytest.raises(errors.SchemaTooNew, match="newer release"):
            Outbox(db_url)
    finally:
        engine.dispose()


def test_unmigrated_database_is_refused_with_what_to_run(tmp_path):
    with pytest.raises(errors.SchemaNotCurrent, match="run `outbox db upgrade`"):
        Outbox(f"sqlite:///{tmp_path / 'empty.db'}")


def test_sqlite_pragmas(tmp_path):
    url = f"sqlite:///{tmp_path / 'p.db'}"
    engine = db.create_engine(settings.load(sqlite_synchronous="NORMAL"), url=url)
    try:
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
            assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 1  # NORMAL
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 5000
    finally:
        engine.dispose()


def test_in_memory_sqlite_is_refused_with_a_reason():
    with pytest.raises(errors.ConfigError, match="in-memory"):
        db.create_engine(settings.load(), url="sqlite://")


def test_settings_bounds_name_the_field():
    with pytest.raises(errors.ConfigError, match="OUTBOX_LEASE_RENEW_INTERVAL"):
        settings.load(lease_duration="30s", lease_renew_interval="15s")
    with pytest.raises(errors.ConfigError, match="OUTBOX_TOMBSTONE_RETENTION"):
        settings.load(retention="30d", tombstone_retention="1d")
    assert settings.load(retention="2h").retention == timedelta(hours=2)
    assert settings.load(retention="P3D").retention == timedelta(days=3)


def test_busy_when_the_lock_outlives_the_busy_timeout(tmp_path):
    url = f"sqlite:///{tmp_path / 'busy.db'}"
    engine = db.create_engine(settings.load(), url=url)
    db.upgrade(engine)
    engine.dispose()
    quick = settings.load(busy_timeout="0.2s")
    with Outbox(url, config=quick) as box:
        box.create_tenant("acme")
        holder = db.create_engine(quick, url=url)
        try:
            with db.write(holder):
                with pytest.raises(errors.Busy) as caught:
                    box.execute("acme", "op-1", "create_support_task", {"subject": "s"})
                assert caught.value.retry == "same_key"
        finally:
            holder.dispose()
        # The same key goes through once the lock is free.
        assert box.execute("acme", "op-1", "create_support_task", {"subject": "s"}).created


@pytest.mark.postgres
def test_finishing_an_attempt_is_a_hot_update_on_postgres(postgres_url: str):
    """The attempts table leaves room on its pages (migration 0006), so the result's
    update of an attempt row writes no index entry; at the default fillfactor of 100
    almost none were HOT (61 of 20,000 in a drain)."""
    from datetime import UTC, datetime

    from outbox.delivery import policy, store
    from outbox.states import AttemptOutcome

    count = 60
    with Outbox(postgres_url) as box:  # the database's clock: the claim reads now()
        box.create_tenant("acme")
        for i in range(count):
            box.execute("acme", f"op-{i}", "create_support_task", {"subject": f"s{i}"})
        raw = box.engine.raw_connection()
        try:
            options = dict(
                raw.cursor()
                .execute(
                    "SELECT relname, array_to_string(reloptions, ',') FROM pg_class"
                    " WHERE relname IN ('outbox', 'attempts')"
                )
                .fetchall()
            )
            assert options == {
                "outbox": f"fillfactor={schema.OUTBOX_FILLFACTOR}",
                "attempts": f"fillfactor={schema.ATTEMPTS_FILLFACTOR}",
            }
            cur = raw.cursor()
            # The store's own statements, in one transaction, whose counters
            # pg_stat_xact_user_tables shows before it ends.
            claim = {"owner": "w", "lease": timedelta(seconds=60), "limit": 100, "unsettled": []}
            claimed = [r[1:-1] for r in cur.execute(store._PG_CLAIM_FIRST, claim) if r[0]]
            assert len(claimed) == count
            # The batch as the store encodes it (``_pg_batch``), for these claimed rows.
            at = datetime.now(UTC)
            delivered = AttemptOutcome.DELIVERED
            finishes = [
                store.Finish(c[0], c[8], c[7], at, delivered, policy.DELIVERED, 201, None,
                             f"T-{c[0]}", f"T-{c[0]}")
                for c in claimed
            ]  # fmt: skip
            held = cur.execute(store._PG_FINISH, {"batch": store._pg_batch(finishes)}).fetchall()
            assert len(held) == count
            updated, hot = cur.execute(
                "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables"
                " WHERE relname = 'attempts'"
            ).fetchone()
            assert updated == count
            assert hot >= count * 2 // 3, f"{hot} of {count} attempt finishes were HOT"
        finally:
            raw.rollback()
            raw.close()


@pytest.mark.postgres
def test_migrations_0006_and_0007_go_down_and_up_again(postgres_url: str):
    """Down to 0005: default fillfactors and the trigger that notified on every
    insert statement; up again: both as the schema module and 0007 say."""
    from alembic import command

    engine = db.create_engine(settings.load(), url=postgres_url)

    def storage() -> tuple[dict[str, str | None], bool]:
        with db.read(engine) as conn:
            options = dict(
                conn.exec_driver_sql(
                    "SELECT relname, array_to_string(reloptions, ',') FROM pg_class"
                    " WHERE relname IN ('outbox', 'attempts')"
                ).all()
            )
            source = conn.exec_driver_sql(
                "SELECT prosrc FROM pg_proc WHERE proname = 'outbox_notify_pending'"
            ).scalar_one()
        return options, "inserted" in source

    try:
        with engine.connect() as conn:
            command.downgrade(db._alembic_config(conn), "0005")
            conn.commit()
        assert storage() == ({"outbox": None, "attempts": None}, False)
        db.upgrade(engine)
        assert storage() == (
            {
                "outbox": f"fillfactor={schema.OUTBOX_FILLFACTOR}",
                "attempts": f"fillfactor={schema.ATTEMPTS_FILLFACTOR}",
            },
            True,
        )
    finally:
        engine.dispose()


def test_migration_0010_goes_down_to_the_lists_and_up_again(postgres_url: str):
    from alembic import command

    engine = db.create_engine(settings.load(), url=postgres_url)

    def enum_checks() -> list[str]:
        with engine.connect() as conn:
            found = _checks_in_database(conn)
        return [found[name] for _, name, _, _ in _enum_checks()]

    try:
        with engine.connect() as conn:
            command.downgrade(db._alembic_config(conn), "0009")
            conn.commit()
        assert all("ARRAY[" in text for text in enum_checks())
        db.upgrade(engine)
        assert not any("ARRAY[" in text for text in enum_checks())
    finally:
        engine.dispose()


def _down_to_0009(engine: sa.Engine) -> None:
    from alembic import command

    with engine.connect() as conn:
        command.downgrade(db._alembic_config(conn), "0009")
        conn.commit()


def _enum_check_forms(engine: sa.Engine) -> set[bool]:
    """For each enum CHECK: is it still the 0009 list (an ARRAY)?"""
    with engine.connect() as conn:
        found = _checks_in_database(conn)
    return {"ARRAY[" in found[name] for _, name, _, _ in _enum_checks()}


def test_migration_0010_that_cannot_finish_leaves_nothing_half_done(postgres_url: str):
    """0010 alters four tables before outbox; when it cannot lock outbox it fails, and
    the tables it did alter are as they were: one transaction, as a killed migrator's."""
    engine = db.create_engine(settings.load(busy_timeout="0.2s"), url=postgres_url)
    holder = db.create_engine(settings.load(), url=postgres_url)
    try:
        _down_to_0009(engine)
        with holder.connect() as blocking:
            blocking.exec_driver_sql("LOCK TABLE outbox IN ACCESS SHARE MODE")
            with pytest.raises(sa.exc.OperationalError, match="lock timeout"):
                db.upgrade(engine)
            blocking.rollback()
        assert db.current_revision(engine) == "0009"
        assert _enum_check_forms(engine) == {True}
        db.upgrade(engine)
        assert db.current_revision(engine) == db.head_revision()
        assert _enum_check_forms(engine) == {False}
    finally:
        holder.dispose()
        engine.dispose()


def test_two_migrators_at_once_apply_0010_once(postgres_url: str):
    engine = db.create_engine(settings.load(), url=postgres_url)
    try:
        _down_to_0009(engine)
        start = threading.Barrier(2, timeout=30)
        results: list[object] = []

        def migrate() -> None:
            start.wait()
            try:
                results.append(db.upgrade(engine))
            except Exception as error:  # noqa: BLE001 - reported by the assertion below
                results.append(error)

        threads = [threading.Thread(target=migrate) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        head = db.head_revision()
        # One applied 0010; the other waited for it, then found nothing to do.
        assert sorted(results, key=str) == sorted([("0009", head), (head, head)], key=str)
        assert _enum_check_forms(engine) == {False}
    finally:
        engine.dispose()
