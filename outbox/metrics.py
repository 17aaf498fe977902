"""Prometheus metrics: what an operator alerts on.

Gauges that describe the backlog are read from the database at scrape time
(so every process reports the same truth, and a dead dispatcher cannot leave a
stale gauge behind). Counters and histograms are per process.

Each process exposes them: the API at ``/metrics``; the dispatcher and the
reconciler on their own metrics port (``serve(...)``), with ``/healthz`` and
``/readyz`` beside it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import sqlalchemy as sa
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import REGISTRY, Collector
from sqlalchemy.engine import Engine

from outbox import db, errors, schema

CONTENT_TYPE = CONTENT_TYPE_LATEST
"""The media type of ``render``'s output (Prometheus text format)."""

DELIVERIES = Counter(
    "outbox_deliveries_total", "Delivery attempts by adapter and outcome", ["adapter", "outcome"]
)
ATTEMPT_SECONDS = Histogram(
    "outbox_attempt_duration_seconds",
    "Time from send to classified result, per adapter",
    ["adapter"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
RETRIES = Counter("outbox_retries_total", "Effects rescheduled with the same key", ["adapter"])
RETRY_BUDGET_REFUSALS = Counter(
    "outbox_retry_budget_refusals_total",
    "Retries postponed because the adapter's retry budget was spent",
    ["adapter"],
)
BREAKER_OPEN = Gauge(
    "outbox_circuit_breaker_open", "1 while the adapter's circuit breaker is open", ["adapter"]
)
SWEEP_ROWS = Counter("outbox_sweep_rows_total", "Rows each reconciler sweep handled", ["sweep"])
SWEEP_RUNS = Counter("outbox_sweep_runs_total", "Reconciler sweep passes", ["sweep"])
OPERATIONS = Counter(
    "outbox_operations_total", "Create calls by result", ["tool", "result"]
)  # result: created | replayed | conflict | invalid | expired | busy
_CHILDREN: dict[tuple[Any, tuple[str, ...]], Any] = {}


def labelled(metric: Any, *values: str) -> Any:
    """``metric.labels(*values)``, looked up once per metric and values: ``labels``
    takes a lock and builds its key on every call, and the hot paths count every
    create and every send. The children are the registry's own, so nothing is
    counted twice; a lost race only looks one up twice."""
    child = _CHILDREN.get((metric, values))
    if child is None:
        child = _CHILDREN[metric, values] = metric.labels(*values)
    return child


def create_result(error: errors.OutboxError) -> str:
    """The ``result`` label of ``outbox_operations_total`` for a refused create call."""
    if isinstance(error, errors.IdempotencyKeyReused):
        return "conflict"
    if isinstance(error, errors.OperationExpired):
        return "expired"
    if isinstance(error, errors.Busy):
        return "busy"
    if isinstance(error, errors.RequestError):
        return "invalid"
    return "error"


class BacklogCollector(Collector):
    """Backlog gauges from one cheap query, cached briefly so scrapes stay cheap."""

    def __init__(self, engine: Engine, cache_seconds: float = 1.0) -> None:
        self.engine = engine
        self.cache_seconds = cache_seconds
        self._cached: tuple[float, dict[str, float]] | None = None
        self._lock = threading.Lock()

    def _read(self) -> dict[str, float]:
        with self._lock:
            if self._cached and time.monotonic() - self._cached[0] < self.cache_seconds:
                return self._cached[1]
            out = schema.outbox
            now = schema.utcnow()
            with db.read(self.engine) as conn:
                rows = conn.execute(
                    sa.select(out.c.status, out.c.needs_review, sa.func.count())
                    .where(out.c.status.in_(["pending", "in_flight", "outcome_unknown"]))
                    .group_by(out.c.status, out.c.needs_review)
                ).all()
                oldest = conn.execute(
                    sa.select(sa.func.min(out.c.created_at)).where(out.c.status == "pending")
                ).scalar()
            values = {"pending": 0.0, "in_flight": 0.0, "outcome_unknown": 0.0, "review": 0.0}
            for status, needs_review, count in rows:
                values[status] += count
                if needs_review:
                    values["review"] += count
            values["oldest_pending_age"] = (now - oldest).total_seconds() if oldest else 0.0
            self._cached = (time.monotonic(), values)
            return values

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            values = self._read()
        except Exception:  # noqa: BLE001 - a scrape must not fail because the database blinked
            return
        rows = GaugeMetricFamily("outbox_effects", "Effects by status", labels=["status"])
        for status in ("pending", "in_flight", "outcome_unknown"):
            rows.add_metric([status], values[status])
        yield rows
        yield GaugeMetricFamily(
            "outbox_review_queue", "Effects awaiting an operator's decision", value=values["review"]
        )
        yield GaugeMetricFamily(
            "outbox_oldest_pending_age_seconds",
            "Age of the oldest pending effect",
            value=values["oldest_pending_age"],
        )


def backlog_registry(engine: Engine) -> CollectorRegistry:
    """A registry holding only ``engine``'s backlog gauges (one per app or server)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BacklogCollector(engine))
    return registry


def render(backlog: CollectorRegistry) -> bytes:
    """This process's counters and histograms, then the backlog of its own database.

    The backlog lives in a registry per engine rather than in the global one, so
    two apps in one process (tests, an embedding program) each report their own
    database, and a disposed engine never answers for a live one.
    """
    return generate_latest(REGISTRY) + generate_latest(backlog)


_installed: set[int] = set()


def install_backlog(engine: Engine, registry: CollectorRegistry = REGISTRY) -> None:
    """Register the backlog gauges once per registry."""
    if id(registry) in _installed:
        return
    registry.register(BacklogCollector(engine))
    _installed.add(id(registry))


def readiness(engine: Engine) -> tuple[bool, str]:
    """Database reachable and schema current."""
    try:
        db.check_schema(engine)
    except errors.OutboxError as exc:  # the schema guard's own words: what to run
        return False, str(exc)
    except Exception as exc:  # noqa: BLE001 - any failure means "not ready"
        # Driver errors carry host names and SQL: name the kind, keep the rest out.
        return False, f"database unavailable ({type(exc).__name__})"
    return True, "ready"


def serve(engine: Engine, host: str, port: int) -> ThreadingHTTPServer:
    """A small metrics/health server for processes without an HTTP API of their own."""
    backlog = backlog_registry(engine)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/metrics":
                self._send(200, render(backlog), CONTENT_TYPE_LATEST)
            elif self.path == "/healthz":
                self._send(200, b'{"status":"ok"}', "application/json")
            elif self.path == "/readyz":
                ok, detail = readiness(engine)
                body = json.dumps({"status": "ready" if ok else "not_ready", "detail": detail})
                self._send(200 if ok else 503, body.encode(), "application/json")
            else:
                self._send(404, b'{"status":"not_found"}', "application/json")

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # quiet: scrapes are frequent
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
