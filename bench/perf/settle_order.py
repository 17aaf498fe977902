"""Webhook settle latency, and ungrouped dispatch throughput before and after ordering groups.

    python -m bench.perf.settle_order [--quick] [--db sqlite,postgres]

1. **Webhook settle latency**: effects in ``outcome_unknown``; for each, a
   signed ``ticket.created`` event is POSTed to ``/v1/webhooks/helpdesk`` on a
   real socket. The receiver answers only after the settle has committed, so
   the round trip (event sent -> answer) bounds "event received -> effect
   settled" from above. p50 and p99 of the round trip, per backend.
2. **Ungrouped dispatch throughput**: the same backlog of ungrouped effects
   drained by ``Dispatcher.run_once`` with a no-op adapter, once with the claim
   statements as they are (with the ordering-group probe) and once with the
   probe taken out (the statements as before ordering groups), interleaved
   repetitions, medians. The target: within 10%.

Bounded by count: a quick run is a few hundred events and a few thousand
effects, and stops by itself.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa
import standardwebhooks

import adapters
from adapters.testing import NoopAdapter
from outbox import Outbox, db, schema, settings, states
from outbox.api import create_app
from outbox.creating import create, digest
from outbox.delivery import store
from outbox.delivery.dispatcher import Dispatcher
from tests.support.servers import serve_in_thread

PG_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
TENANT = "bench"


@contextmanager
def database(backend: str, pg_admin: str) -> Iterator[str]:
    if backend == "sqlite":
        with tempfile.TemporaryDirectory() as tmp:
            url = f"sqlite:///{Path(tmp) / 'bench.db'}"
            engine = db.create_engine(settings.load(), url=url)
            db.upgrade(engine)
            engine.dispose()
            yield url
        return
    name = f"bench_settle_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(pg_admin, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = sa.make_url(pg_admin).set(database=name).render_as_string(hide_password=False)
    try:
        engine = db.create_engine(settings.load(), url=url)
        db.upgrade(engine)
        engine.dispose()
        yield url
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def seed(engine: sa.Engine, count: int, *, status: str, adapter: str, prefix: str) -> list[str]:
    now = datetime.now(UTC)
    keys = [create.new_effect_key() for _ in range(count)]
    with db.write(engine) as conn:
        if (
            conn.execute(
                sa.select(schema.tenants.c.id).where(schema.tenants.c.id == TENANT)
            ).first()
            is None
        ):
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
        unknown = status == states.EffectStatus.OUTCOME_UNKNOWN
        conn.execute(
            sa.insert(schema.outbox),
            [
                {
                    "tenant": TENANT,
                    "operation_id": f"{prefix}-{i}",
                    "effect": "open_ticket",
                    "adapter": adapter,
                    "payload": digest.canonical_json({"subject": f"s{i}"}).decode(),
                    "effect_key": keys[i],
                    "status": status,
                    "reason": states.Reason.REVIEW_NO_LOOKUP if unknown else states.Reason.CREATED,
                    "attempts": 1 if unknown else 0,
                    "maybe_sent": unknown,
                    "needs_review": unknown,
                    "review_since": now if unknown else None,
                    "next_attempt_at": now - timedelta(seconds=1),
                    "deadline_at": now + timedelta(hours=1),
                    "fence": 1 if unknown else 0,
                    "lookup_attempts": 0,
                    "created_at": now,
                    "updated_at": now,
                }
                for i in range(count)
            ],
        )
    return keys


def webhook_latency(url: str, events: int) -> dict[str, Any]:
    secret = "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    config = adapters.WebhookConfig(
        format="standard", secrets=(secret,), succeeded_types=("ticket.created",)
    )
    keys_ = None
    with Outbox(url) as box:
        keys_ = seed(box.engine, events, status="outcome_unknown", adapter="helpdesk", prefix="wh")
        app = create_app(box, load_entry_points=False, webhook_configs={"helpdesk": config})
        signer = standardwebhooks.Webhook(secret)
        times: list[float] = []
        with serve_in_thread(app) as base, httpx.Client(base_url=base) as client:
            for i, key in enumerate(keys_):
                event_id = f"evt_{i}"
                body = json.dumps(
                    {
                        "id": event_id,
                        "type": "ticket.created",
                        "data": {"id": f"tkt_{i}", "client_reference": key},
                    }
                ).encode()
                now = datetime.now(UTC)
                headers = {
                    "webhook-id": event_id,
                    "webhook-timestamp": str(int(now.timestamp())),
                    "webhook-signature": signer.sign(event_id, now, body),
                }
                start = time.perf_counter()
                reply = client.post("/v1/webhooks/helpdesk", content=body, headers=headers)
                times.append(time.perf_counter() - start)
                assert reply.json()["disposition"] == "settled", reply.text
        with db.read(box.engine) as conn:
            settled = conn.execute(
                sa.select(sa.func.count())
                .select_from(schema.outbox)
                .where(schema.outbox.c.settled_by == "webhook")
            ).scalar_one()
    assert settled == events
    times.sort()
    return {
        "events": events,
        "p50_ms": round(1000 * times[len(times) // 2], 2),
        "p99_ms": round(1000 * times[min(len(times) - 1, int(len(times) * 0.99))], 2),
    }


@contextmanager
def claims_before_ordering() -> Iterator[None]:
    """The claim statements with the ordering-group probe taken out: as before the change."""
    saved = {
        n: getattr(store, n) for n in ("_PG_CLAIM_FIRST", "_PG_DUE", "_SQLITE_DUE", "_ORDERED")
    }
    probe = f" AND {store._ORDERED}"
    try:
        for name in ("_PG_CLAIM_FIRST", "_PG_DUE", "_SQLITE_DUE"):
            setattr(store, name, saved[name].replace(probe, ""))
        store._ORDERED = "1 = 1"
        yield
    finally:
        for name, value in saved.items():
            setattr(store, name, value)


def drain(url: str, effects: int, rep: int) -> float:
    engine = db.create_engine(settings.load(), url=url)
    try:
        seed(
            engine,
            effects,
            status="pending",
            adapter="bench",
            prefix=f"d{rep}-{uuid.uuid4().hex[:6]}",
        )
        config = settings.load(claim_batch_size=100, concurrency=4)
        dispatcher = Dispatcher(
            engine,
            adapters.Registry([NoopAdapter(name="bench")]),
            config,
            worker_id=f"bench-{rep}",
            rng=random.Random(rep),
        )
        try:
            start = time.perf_counter()
            done = 0
            for _ in range(effects):  # bounded: each pass delivers at least one
                n = dispatcher.run_once()
                done += n
                if n == 0:
                    break
            elapsed = time.perf_counter() - start
        finally:
            dispatcher.close()
        assert done == effects, (done, effects)
        return effects / elapsed
    finally:
        engine.dispose()


def throughput(url: str, effects: int, reps: int) -> dict[str, Any]:
    after: list[float] = []
    before: list[float] = []
    for rep in range(reps):  # interleaved, alternating which goes first
        order = ["before", "after"] if rep % 2 == 0 else ["after", "before"]
        for which in order:
            if which == "before":
                with claims_before_ordering():
                    before.append(drain(url, effects, rep))
            else:
                after.append(drain(url, effects, rep))
    b, a = statistics.median(before), statistics.median(after)
    return {
        "effects": effects,
        "reps": reps,
        "before_per_s": round(b),
        "after_per_s": round(a),
        "ratio": round(a / b, 3),
        "within_10pct": a >= 0.9 * b,
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.perf.settle_order", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes (the machine is shared)")
    parser.add_argument("--db", default="sqlite,postgres")
    parser.add_argument("--pg-url", default=PG_ADMIN_URL)
    args = parser.parse_args()
    events, effects, reps = (200, 2000, 3) if args.quick else (2000, 20000, 5)
    for backend in args.db.split(","):
        with database(backend, args.pg_url) as url:
            latency = webhook_latency(url, events)
            print(json.dumps({"case": "webhook_settle_latency", "db": backend, **latency}))
        with database(backend, args.pg_url) as url:
            figures = throughput(url, effects, reps)
            print(json.dumps({"case": "ungrouped_dispatch", "db": backend, **figures}))


if __name__ == "__main__":
    main()
