"""Behind PgBouncer in transaction pooling mode (``OUTBOX_DATABASE_POOLER=transaction``).

The PgBouncer test needs Debian's ``pgbouncer`` (``make chaos-pooler`` installs
it) and the local PostgreSQL server; without them it is skipped. The chaos run
through the pooler is ``make chaos-pooler``.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import sqlalchemy as sa

from outbox import db, settings
from outbox.delivery.dispatcher import Dispatcher
from outbox.service import Outbox
from tests.conftest import POSTGRES_URL


def test_pooled_engines_prepare_nothing_and_send_no_startup_options():
    config = settings.load(database_pooler="transaction")
    engine = db.create_engine(config, url="postgresql://u@127.0.0.1:1/x")
    direct = db.create_engine(settings.load(), url="postgresql://u@127.0.0.1:1/x")
    # What reaches psycopg.connect: the dialect's parameters plus our connect_args.
    pooled_kwargs = _connect_kwargs(engine)
    direct_kwargs = _connect_kwargs(direct)
    assert pooled_kwargs["prepare_threshold"] is None and "options" not in pooled_kwargs
    assert "prepare_threshold" not in direct_kwargs and "timezone=UTC" in direct_kwargs["options"]
    engine.dispose()
    direct.dispose()


def _connect_kwargs(engine: sa.Engine) -> dict[str, object]:
    seen: dict[str, object] = {}

    def capture(*_: object, **kwargs: object) -> None:
        seen.update(kwargs)
        raise ConnectionAbortedError("captured")

    original = engine.dialect.loaded_dbapi.connect
    engine.dialect.loaded_dbapi.connect = capture
    try:
        with pytest.raises(Exception, match="captured"), engine.connect():
            pass
    finally:
        engine.dialect.loaded_dbapi.connect = original
    return seen


@pytest.mark.parametrize(
    ("pooler", "listen_url", "listens"),
    [
        ("none", None, True),
        ("transaction", None, False),  # the documented fallback: poll
        ("transaction", "postgresql://u@db/x", True),  # LISTEN on a direct connection
    ],
)
def test_listen_goes_direct_or_falls_back_to_polling(pooler, listen_url, listens):
    config = settings.load(database_pooler=pooler, listen_url=listen_url)
    holder = SimpleNamespace(settings=config)  # the decision reads the settings only
    assert Dispatcher._listen_wanted(holder) is listens  # type: ignore[arg-type]


def test_a_multi_host_url_means_the_same_for_listen_as_for_the_pool():
    url = (
        "postgresql://outbox@/outbox?host=db-a,db-b&port=5432,5433"
        "&target_session_attrs=read-write&connect_timeout=2"
    )
    engine = db.create_engine(settings.load(), url=url)
    try:
        params = db.libpq_params(engine)
    finally:
        engine.dispose()
    assert params["host"] == "db-a,db-b" and params["port"] == "5432,5433"
    assert params["target_session_attrs"] == "read-write"
    assert params["dbname"] == "outbox"


@pytest.fixture
def bouncer() -> Iterator[tuple[str, str]]:
    if not POSTGRES_URL:
        pytest.skip("OUTBOX_TEST_POSTGRES_URL is not set")
    from bench.chaos import infra

    if not infra.PgBouncer.available():
        pytest.skip("pgbouncer is not installed (make chaos-pooler installs it)")
    server = sa.make_url(POSTGRES_URL)
    pooler = infra.PgBouncer(server.host or "127.0.0.1", server.port or 5432, pool_size=2)
    pooler.start()
    try:
        yield pooler.url(""), POSTGRES_URL
    finally:
        pooler.close()


@pytest.mark.postgres
def test_creates_and_reads_through_pgbouncer_without_prepared_statement_errors(
    bouncer: tuple[str, str], postgres_url: str
):
    pooled_base, _ = bouncer
    name = sa.make_url(postgres_url).database
    admin = sa.create_engine(db.normalise_url(postgres_url), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f"ALTER DATABASE \"{name}\" SET lock_timeout = '5s'")
    admin.dispose()
    config = settings.load(database_pooler="transaction")
    # Two server connections shared by a pool of eight: consecutive transactions of
    # one client connection land on different server sessions.
    with Outbox(pooled_base + name, config=config) as box:
        box.create_tenant("acme")
        for n in range(30):  # well past psycopg's prepare threshold (5)
            result = box.execute("acme", f"op-{n}", "create_support_task", {"subject": f"#{n}"})
            assert result.created
            assert box.get_operation("acme", f"op-{n}")["receipt"] == result.receipt
        with box.engine.connect() as conn:
            assert conn.exec_driver_sql("SHOW TimeZone").scalar_one() == "UTC"
