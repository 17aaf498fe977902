"""``/metrics``, ``/healthz`` and ``/readyz``: the counters move where the events happen.

The API is served by uvicorn on an ephemeral loopback port; the dispatcher runs
in this process with a scripted adapter (one 503, then delivered), so the
deliveries, retries and latency series it moves are the ones the API scrapes.
Counters are per process and other tests move them too: every check on a
counter is a difference between two scrapes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import adapters
from adapters.testing import FakeAdapter
from outbox import db, metrics, schema, settings
from outbox.api import create_app
from outbox.delivery.dispatcher import Dispatcher
from outbox.service import Outbox
from tests.support.patience import PATIENCE_S
from tests.support.servers import serve_in_thread

TOOL = "create_support_task"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def scrape(http: httpx.Client) -> Samples:
    response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return parse(response.text)


def wait_for_gauge(http: httpx.Client, name: str, expected: float, **labels: str) -> Samples:
    """Backlog gauges are cached for a second per scrape: poll, bounded."""
    deadline = time.monotonic() + PATIENCE_S
    while True:
        samples = scrape(http)
        if (name, frozenset(labels.items())) in samples and value(
            samples, name, **labels
        ) == expected:
            return samples
        assert time.monotonic() < deadline, f"{name}{labels} never became {expected}"
        time.sleep(0.1)


@pytest.fixture
def served(db_url: str) -> Iterator[tuple[Outbox, httpx.Client, str]]:
    box = Outbox(db_url)
    box.create_tenant("acme")
    token = box.create_token("acme", "agent", "metrics test")
    try:
        with (
            serve_in_thread(create_app(box, load_entry_points=False)) as base_url,
            httpx.Client(base_url=base_url, timeout=10) as http,
        ):
            yield box, http, token
    finally:
        box.close()


def test_scrape_after_a_retry_and_a_delivery_shows_every_counter_moved(served):
    box, http, token = served
    before = scrape(http)

    def create(key: str, subject: str) -> httpx.Response:
        return http.post(
            "/v1/tasks",
            json={"subject": subject},
            headers={"Authorization": f"Bearer {token}", "Idempotency-Key": key},
        )

    assert create("op-metrics", "Late parcel").status_code == 201
    assert create("op-metrics", "Late parcel").headers["Idempotent-Replayed"] == "true"
    assert create("op-metrics", "Another subject").status_code == 422
    assert create("bad key with spaces", "Late parcel").status_code == 400
    samples = wait_for_gauge(http, "outbox_effects", 1, status="pending")
    for result in ("created", "replayed", "conflict", "invalid"):
        delta = value(samples, "outbox_operations_total", tool=TOOL, result=result) - value(
            before, "outbox_operations_total", tool=TOOL, result=result
        )
        assert delta == 1, result
    assert value(samples, "outbox_oldest_pending_age_seconds") >= 0
    assert value(samples, "outbox_review_queue") == 0

    adapter = FakeAdapter(
        "helpdesk", script=[adapters.DeliveryResult.retryable(None, status_code=503)]
    )
    dispatcher = Dispatcher(
        box.engine, adapters.Registry([adapter]), settings.load(), worker_id="metrics-test"
    )
    try:
        assert dispatcher.run_once() == 1  # 503: rescheduled, same key
        assert dispatcher.run_once(now=schema.utcnow() + timedelta(minutes=5)) == 1
    finally:
        dispatcher.close()
    assert len({call.effect_key for call in adapter.calls}) == 1

    after = wait_for_gauge(http, "outbox_effects", 0, status="pending")

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("outbox_deliveries_total", adapter="helpdesk", outcome="retryable") == 1
    assert moved("outbox_deliveries_total", adapter="helpdesk", outcome="delivered") == 1
    assert moved("outbox_retries_total", adapter="helpdesk") == 1
    assert moved("outbox_attempt_duration_seconds_count", adapter="helpdesk") == 2
    assert value(after, "outbox_effects", status="in_flight") == 0
    assert value(after, "outbox_effects", status="outcome_unknown") == 0
    assert value(after, "outbox_review_queue") == 0
    assert value(after, "outbox_oldest_pending_age_seconds") == 0


def test_api_health_and_readiness(served):
    _, http, _ = served
    assert http.get("/healthz").json() == {"status": "ok"}
    ready = http.get("/readyz")
    assert ready.status_code == 200
    assert ready.json() == {"status": "ready", "schema": db.head_revision()}
    # Not part of the API's contract: no schemathesis run should find it.
    assert "/metrics" not in http.get("/openapi.json").json()["paths"]


@pytest.fixture
def unmigrated_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'empty.db'}"


def test_readyz_is_503_on_an_unmigrated_database_on_the_api(unmigrated_url):
    box = Outbox(unmigrated_url, check_schema=False)
    try:
        with (
            serve_in_thread(create_app(box, load_entry_points=False)) as base_url,
            httpx.Client(base_url=base_url, timeout=10) as http,
        ):
            assert http.get("/healthz").status_code == 200
            ready = http.get("/readyz")
            assert ready.status_code == 503
            assert ready.headers["content-type"].startswith("application/problem+json")
            # No backlog to read, but the scrape itself still answers.
            assert http.get("/metrics").status_code == 200
    finally:
        box.close()


def test_readyz_is_503_on_an_unmigrated_database_on_the_metrics_port(unmigrated_url):
    engine = db.create_engine(settings.load(), url=unmigrated_url)
    server = metrics.serve(engine, "127.0.0.1", 0)
    try:
        base_url = f"http://127.0.0.1:{server.server_address[1]}"
        with httpx.Client(base_url=base_url, timeout=10) as http:
            assert http.get("/healthz").json() == {"status": "ok"}
            ready = http.get("/readyz")
            assert ready.status_code == 503
            assert ready.json()["status"] == "not_ready"
            assert "outbox db upgrade" in ready.json()["detail"]
            scraped = http.get("/metrics")
            assert scraped.status_code == 200
            assert "outbox_deliveries_total" in scraped.text
            assert http.get("/nothing").status_code == 404
    finally:
        server.shutdown()
        server.server_close()
        engine.dispose()
