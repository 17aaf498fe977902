"""Helpers for the dispatcher tests: seeding rows, reading them back, provider plumbing."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import httpx
import sqlalchemy as sa
from anyio.from_thread import BlockingPortal, start_blocking_portal
from sqlalchemy.engine import Engine
from starlette.applications import Starlette

import adapters
from adapters import helpdesk
from fake_provider import FaultSpec
from fake_provider.testing import ProviderTransport
from outbox import db, schema, states
from outbox.creating import create, digest
from tests.conftest import _admin_engine
from tests.support.patience import TERMINATE_WAIT_MS
from tests.support.servers import serve_in_thread

TENANT = "acme"


def seed(
    engine: Engine,
    count: int,
    *,
    now: datetime,
    adapter: str = "helpdesk",
    deadline: timedelta = timedelta(minutes=15),
    payloads: Sequence[dict[str, Any]] | None = None,
    prefix: str = "op",
) -> list[int]:
    """Insert ``count`` pending effects (with their operations) in one transaction; ids in order."""
    payloads = payloads or [
        {"subject": f"ticket {i}", "body": "", "priority": "normal"} for i in range(count)
    ]
    with db.write(engine) as conn:
        exists = conn.execute(
            sa.select(schema.tenants.c.id).where(schema.tenants.c.id == TENANT)
        ).first()
        if exists is None:
            conn.execute(sa.insert(schema.tenants), {"id": TENANT, "created_at": now})
        conn.execute(
            sa.insert(schema.operations),
            [
                {
                    "tenant": TENANT,
                    "operation_id": f"{prefix}-{i}",
                    "tool": "create_support_task",
                    "payload_version": 1,
                    "args_digest": "0" * 64,
                    "receipt": "{}",
                    "status_code": 201,
                    "created_at": now,
                    "expires_at": now + timedelta(days=30),
                }
                for i in range(count)
            ],
        )
        conn.execute(
            sa.insert(schema.outbox),
            [
                {
                    "tenant": TENANT,
                    "operation_id": f"{prefix}-{i}",
                    "effect": "open_ticket",
                    "adapter": adapter,
                    "payload": digest.canonical_json(payloads[i]).decode("utf-8"),
                    "effect_key": create.new_effect_key(),
                    "status": states.EffectStatus.PENDING,
                    "reason": states.Reason.CREATED,
                    "attempts": 0,
                    "maybe_sent": False,
                    "next_attempt_at": now,
                    "deadline_at": now + deadline,
                    "fence": 0,
                    "needs_review": False,
                    "lookup_attempts": 0,
                    "created_at": now,
                    "updated_at": now,
                }
                for i in range(count)
            ],
        )
        ids = conn.execute(
            sa.select(schema.outbox.c.id)
            .where(schema.outbox.c.operation_id.like(f"{prefix}-%"))
            .order_by(schema.outbox.c.id)
        ).scalars()
        return list(ids)


# PostgreSQL only: ``n`` effects in three statements (``seed`` takes seconds for
# thousands), for the tests of the statements' plans on tables of some size.
_BULK_OPERATIONS = """
INSERT INTO operations (tenant, operation_id, tool, payload_version, args_digest, receipt,
    status_code, created_at, expires_at)
SELECT %(tenant)s, %(prefix)s || '-' || g, 'create_support_task', 1, repeat('0', 64), '{}',
    201, now(), now() + interval '30 days'
FROM generate_series(1, %(n)s) AS g
"""
_BULK_EFFECTS = """
INSERT INTO outbox (tenant, operation_id, effect, adapter, payload, effect_key, status,
    reason, attempts, maybe_sent, next_attempt_at, deadline_at, fence, lease_owner,
    lease_expires_at, provider_ref, created_at, updated_at, finished_at)
SELECT %(tenant)s, %(prefix)s || '-' || g, 'open_ticket', 'helpdesk', '{}',
    %(prefix)s || '-key-' || g, %(status)s, %(reason)s, %(tried)s::int, %(tried)s,
    now() - interval '1 second', now() + interval '1 day', %(tried)s::int, %(owner)s,
    CASE WHEN %(owner)s::varchar IS NOT NULL THEN now() + interval '1 hour' END,
    %(ref)s, now(), now(), CASE WHEN %(ref)s::varchar IS NOT NULL THEN now() END
FROM generate_series(1, %(n)s) AS g
"""
# Each tried effect's attempt row: finished where the effect succeeded, else open.
_BULK_ATTEMPTS = """
INSERT INTO attempts (effect_id, attempt_no, worker, fence, effect_key, started_at,
    finished_at, outcome, provider_ref, late)
SELECT id, 1, COALESCE(%(owner)s, 'gone'), 1, effect_key, now(),
    CASE WHEN %(ref)s::varchar IS NOT NULL THEN now() END,
    CASE WHEN %(ref)s::varchar IS NOT NULL THEN 'delivered' END, %(ref)s, false
FROM outbox WHERE tenant = %(tenant)s AND operation_id LIKE %(prefix)s || '-%%'
"""


def bulk(
    engine: Engine,
    n: int,
    *,
    prefix: str,
    leased_to: str | None = None,
    delivered: bool = False,
    analyse: bool = False,
) -> None:
    """``n`` effects due now (pending, never tried), or leased to a worker (in flight,
    attempt open), or delivered (succeeded, attempt finished); PostgreSQL only."""
    status, reason = (
        ("in_flight", "claimed")
        if leased_to
        else ("succeeded", "delivered")
        if delivered
        else ("pending", "created")
    )
    tried = status != "pending"
    params = {
        "tenant": TENANT,
        "prefix": prefix,
        "n": n,
        "status": status,
        "reason": reason,
        "tried": tried,
        "owner": leased_to,
        "ref": "r" if delivered else None,
    }
    with db.write(engine) as conn:
        conn.exec_driver_sql(
            "INSERT INTO tenants (id, created_at) VALUES (%(tenant)s, now())"
            " ON CONFLICT (id) DO NOTHING",
            params,
        )
        conn.exec_driver_sql(_BULK_OPERATIONS, params)
        conn.exec_driver_sql(_BULK_EFFECTS, params)
        if tried:
            conn.exec_driver_sql(_BULK_ATTEMPTS, params)
    if analyse:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("ANALYZE outbox")
            conn.exec_driver_sql("ANALYZE attempts")


def rows(engine: Engine) -> dict[int, Any]:
    with db.read(engine) as conn:
        return {r.id: r for r in conn.execute(sa.select(schema.outbox).order_by("id"))}


def row(engine: Engine, effect_id: int) -> Any:
    return rows(engine)[effect_id]


def attempts(engine: Engine, effect_id: int | None = None) -> list[Any]:
    a = schema.attempts
    query = sa.select(a).order_by(a.c.effect_id, a.c.attempt_no)
    if effect_id is not None:
        query = query.where(a.c.effect_id == effect_id)
    with db.read(engine) as conn:
        return list(conn.execute(query))


def statuses(engine: Engine) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in rows(engine).values():
        counts[r.status] = counts.get(r.status, 0) + 1
    return counts


# --- the fake provider, in-process (ASGI) or on a real socket --------------------------


class RecordingHTTPTransport(httpx.HTTPTransport):
    """A real socket transport that remembers every request it sent."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.requests: list[httpx.Request] = []
        self._lock = threading.Lock()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        with self._lock:
            self.requests.append(request)
        return super().handle_request(request)


class PortalTransport(httpx.BaseTransport):
    """A sync transport into the ASGI app, with socket-like drops and read timeouts.

    ``fake_provider.testing.ProviderTransport`` is async; the adapters are sync
    (a thread pool sends). One blocking portal runs the app's event loop.
    """

    def __init__(self, app: Starlette, portal: BlockingPortal) -> None:
        self._inner = ProviderTransport(app)
        self._portal = portal
        self.requests: list[httpx.Request] = []
        self._lock = threading.Lock()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        with self._lock:
            self.requests.append(request)

        async def exchange() -> httpx.Response:
            response = await self._inner.handle_async_request(request)
            body = await response.aread()
            return httpx.Response(
                response.status_code, headers=response.headers, content=body, request=request
            )

        return self._portal.call(exchange)


@dataclass
class Provider:
    app: Starlette
    base_url: str
    transport: RecordingHTTPTransport | PortalTransport
    made: list[adapters.Adapter] = field(default_factory=list)

    def adapter(
        self, *, honours: bool = True, lookup: bool = True, settle: float = 1.0, **overrides: Any
    ) -> adapters.Adapter:
        adapter = helpdesk.helpdesk_adapter(
            self.base_url,
            transport=self.transport,
            capabilities=adapters.Capabilities(honours, lookup, settle),
            **overrides,
        )
        self.made.append(adapter)
        return adapter

    def faults(self, script: Sequence[str] = (), **rates: float) -> None:
        spec = FaultSpec.from_json({"script": list(script), "rates": rates})
        self.app.state.faults.replace(spec)

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = self.app.state.ledger.stats()
        return stats

    def tickets(self) -> list[dict[str, Any]]:
        return [t.to_effect() for t in self.app.state.ledger.tickets()]

    def keys_sent(self) -> list[str]:
        return [r.headers["Idempotency-Key"] for r in self.transport.requests]

    def bodies_sent(self) -> list[dict[str, Any]]:
        return [json.loads(r.content) for r in self.transport.requests]


@contextmanager
def provider_on(app: Starlette, kind: str) -> Iterator[Provider]:
    made: list[adapters.Adapter] = []
    try:
        if kind == "asgi":
            with start_blocking_portal() as portal:
                provider = Provider(app, "http://provider.test", PortalTransport(app, portal), made)
                yield provider
                for adapter in made:
                    adapter.close()
                made.clear()
        else:
            with serve_in_thread(app) as base_url:
                yield Provider(app, base_url, RecordingHTTPTransport(), made)
                for adapter in made:
                    adapter.close()
                made.clear()
    finally:
        for adapter in made:
            adapter.close()
        app.state.ledger.close()


def claim_concurrently(
    claim_batch: Callable[[str], Sequence[int]], workers: int = 4, passes: int = 100
) -> list[int]:
    """``workers`` threads released together, each claiming batches (``claim_batch(owner)``
    returns the ids it claimed) until one comes back empty; every id claimed, in order."""
    got: dict[str, list[int]] = {f"w{i}": [] for i in range(workers)}
    barrier = threading.Barrier(workers)

    def worker(owner: str) -> None:
        barrier.wait(5)
        for _ in range(passes):
            batch = claim_batch(owner)
            if not batch:
                return
            got[owner].extend(batch)

    threads = [threading.Thread(target=worker, args=(o,)) for o in got]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return [i for batch in got.values() for i in batch]


def terminate_backends(engine: Engine) -> int:
    """Kill every server process of the engine's database; wait until they are gone."""
    admin = _admin_engine()
    try:
        with admin.connect() as conn:
            pids = conn.execute(
                sa.text("SELECT pid FROM pg_stat_activity WHERE datname = :db"),
                {"db": engine.url.database},
            ).scalars()
            killed = 0
            for pid in list(pids):
                conn.execute(
                    sa.text("SELECT pg_terminate_backend(:pid, :wait)"),
                    {"pid": pid, "wait": TERMINATE_WAIT_MS},
                )
                killed += 1
            return killed
    finally:
        admin.dispose()
