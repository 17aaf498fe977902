"""Signed webhooks from the fake provider, with faults: delay, duplicate, reorder, drop,
bad signature.

When a ticket commits, a ``ticket.created`` event is queued::

    {"id": "evt_...", "type": "ticket.created", "created_at": "...",
     "data": {<the ticket, as GET /v1/tickets/{id} shows it>, "idempotency_key": "..."}}

One sender thread posts the queue in order to ``url``, signed as

- ``standard``: Standard Webhooks (``webhook-id``, ``webhook-timestamp``,
  ``webhook-signature``), by the ``standardwebhooks`` library; the secret is
  ``whsec_<base64>``;
- ``stripe``: ``Stripe-Signature: t=<unix>,v1=<hex HMAC-SHA256 of "t.body">``.

A delivery that is not answered 2xx is retried (``max_attempts``), each try
signed afresh, as real providers do. Faults, drawn from a seeded generator
(so a run can be replayed), per event:

- ``drop``: never sent (the event is still recorded and can be redelivered);
- ``duplicate``: sent twice;
- ``reorder``: held back and sent after the next event;
- ``bad_signature``: the first try is signed with a wrong secret (the
  receiver must refuse it); the retry is signed properly;
- ``delay_ms``: each send waits this long first.

``redeliver()`` sends every event again, late: a receiver must not change
anything for an event it has seen. ``flush()`` waits until the queue is empty,
so tests await the sends instead of sleeping.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import queue
import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

import httpx
import standardwebhooks

MAX_ATTEMPTS_DEFAULT = 3
TIMEOUT_SECONDS = 5.0
BAD_SECRET = b"not-the-shared-secret"
REORDER_WAIT_SECONDS = 0.2  # how long a held event waits for one to overtake it


class WebhookFormat(StrEnum):
    STANDARD = "standard"
    STRIPE = "stripe"


@dataclass(frozen=True)
class WebhookConfig:
    """Where and how the provider sends its events; ``url=None``: it sends none."""

    url: str | None = None
    secret: str | None = None
    format: WebhookFormat = WebhookFormat.STANDARD
    delay_ms: int = 0
    duplicate_rate: float = 0.0
    reorder_rate: float = 0.0
    drop_rate: float = 0.0
    bad_signature_rate: float = 0.0
    max_attempts: int = MAX_ATTEMPTS_DEFAULT

    def validate(self) -> None:
        if self.url is None:
            return
        if not self.secret:
            raise ValueError("webhook secret: required with a webhook url")
        if self.format is WebhookFormat.STANDARD:
            try:
                standardwebhooks.Webhook(self.secret)
            except Exception as exc:
                raise ValueError(
                    "webhook secret: the standard format needs whsec_<base64>"
                ) from exc
        for name in ("duplicate_rate", "reorder_rate", "drop_rate", "bad_signature_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"webhook {name}: {value} is outside [0, 1]")
        if self.delay_ms < 0:
            raise ValueError(f"webhook delay_ms: {self.delay_ms} is negative")
        if self.max_attempts < 1:
            raise ValueError(f"webhook max_attempts: {self.max_attempts} is below 1")


def new_secret() -> str:
    """A fresh Standard Webhooks secret (``whsec_<base64 of 24 random bytes>``)."""
    return "whsec_" + base64.b64encode(uuid.uuid4().bytes + uuid.uuid4().bytes[:8]).decode()


@dataclass
class _Stats:
    queued: int = 0
    sent: int = 0  # POSTs made, retries and duplicates included
    delivered: int = 0  # events answered 2xx at least once
    dropped: int = 0
    duplicated: int = 0
    reordered: int = 0
    bad_signatures: int = 0
    failed: int = 0  # events never answered 2xx
    statuses: dict[str, int] = field(default_factory=dict)


class Sender:
    """The provider's outgoing events: a queue and one thread that sends it in order."""

    def __init__(
        self,
        config: WebhookConfig,
        *,
        clock: Callable[[], datetime],
        seed: int = 0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        config.validate()
        self.config = config
        self._clock = clock
        self._rng = random.Random(seed)
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._events: list[dict[str, Any]] = []
        self._stats = _Stats()
        self._lock = threading.Lock()
        self._client = (
            httpx.Client(transport=transport, timeout=TIMEOUT_SECONDS) if config.url else None
        )
        self._thread: threading.Thread | None = None
        self._closed = False
        self._running = threading.Event()  # cleared: events queue up, nothing is sent
        self._running.set()

    @property
    def enabled(self) -> bool:
        return self.config.url is not None

    # -- producing ------------------------------------------------------------------

    def ticket_created(self, ticket: dict[str, Any], idempotency_key: str | None) -> None:
        """Queue the ``ticket.created`` event of a ticket that has just committed."""
        if not self.enabled:
            return
        event = {
            "id": f"evt_{uuid.uuid4().hex}",
            "type": "ticket.created",
            "created_at": ticket.get("created_at"),
            "data": {**ticket, "idempotency_key": idempotency_key},
        }
        with self._lock:
            self._events.append(event)
            self._stats.queued += 1
        self._start()
        self._queue.put(event)

    def redeliver(self) -> int:
        """Send every event recorded so far once more (late duplicates); how many."""
        with self._lock:
            events = list(self._events)
        self._start()
        for event in events:
            self._queue.put({**event, "_redelivery": True})
        return len(events)

    def pause(self) -> None:
        """Stop sending (a webhook outage at the provider); events keep queueing."""
        self._running.clear()

    def resume(self) -> None:
        """Send again, the queued events first, in order."""
        self._running.set()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued event was sent (or given up); False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._queue.unfinished_tasks == 0:
                return True
            time.sleep(0.01)
        return False

    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._events)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            s = self._stats
            return {
                "enabled": self.enabled,
                "paused": not self._running.is_set(),
                "format": self.config.format.value,
                "queued": s.queued,
                "sent": s.sent,
                "delivered": s.delivered,
                "dropped": s.dropped,
                "duplicated": s.duplicated,
                "reordered": s.reordered,
                "bad_signatures": s.bad_signatures,
                "failed": s.failed,
                "statuses": dict(s.statuses),
            }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._running.set()
            self._queue.put(None)
            self._thread.join(10)
        if self._client is not None:
            self._client.close()

    # -- sending ----------------------------------------------------------------------

    def _start(self) -> None:
        with self._lock:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(
                    target=self._run, name="fake-provider-webhooks", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        # An event reordered behind the next one. Its task is done only once it is
        # sent, so flush() waits for it; with nothing behind it, it goes after a pause.
        held: dict[str, Any] | None = None
        while True:
            try:
                event = self._queue.get(timeout=REORDER_WAIT_SECONDS if held else None)
            except queue.Empty:
                assert held is not None
                self._deliver(held)
                held = None
                self._queue.task_done()
                continue
            if event is None:
                if held is not None:
                    self._deliver(held)
                    self._queue.task_done()
                self._queue.task_done()
                return
            try:
                if event.pop("_redelivery", False):
                    self._deliver(event)
                    continue
                cfg = self.config
                with self._lock:
                    # Always four draws per event: the same seed, the same faults.
                    drop, dup, reorder, bad = (self._rng.random() for _ in range(4))
                if drop < cfg.drop_rate:
                    with self._lock:
                        self._stats.dropped += 1
                    continue
                if held is None and reorder < cfg.reorder_rate:
                    with self._lock:
                        self._stats.reordered += 1
                    held = event
                    event = None  # its task stays open until it is sent
                    continue
                self._deliver(event, bad=bad < cfg.bad_signature_rate)
                if dup < cfg.duplicate_rate:
                    with self._lock:
                        self._stats.duplicated += 1
                    self._deliver(event)
                if held is not None:
                    self._deliver(held)
                    held = None
                    self._queue.task_done()
            finally:
                if event is not None:
                    self._queue.task_done()

    def _deliver(self, event: dict[str, Any], *, bad: bool = False) -> None:
        self._running.wait()
        body = json.dumps(event, sort_keys=True, separators=(",", ":")).encode()
        assert self.config.url is not None and self._client is not None
        for attempt in range(self.config.max_attempts):
            if self.config.delay_ms:
                time.sleep(self.config.delay_ms / 1000)
            wrong = bad and attempt == 0
            if wrong:
                with self._lock:
                    self._stats.bad_signatures += 1
            headers = self._sign(event["id"], body, wrong=wrong)
            try:
                response = self._client.post(self.config.url, content=body, headers=headers)
                status = str(response.status_code)
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            with self._lock:
                self._stats.sent += 1
                self._stats.statuses[status] = self._stats.statuses.get(status, 0) + 1
            if status.isdigit() and 200 <= int(status) < 300:
                with self._lock:
                    self._stats.delivered += 1
                return
        with self._lock:
            self._stats.failed += 1

    def _sign(self, event_id: str, body: bytes, *, wrong: bool) -> dict[str, str]:
        now = self._clock()
        assert self.config.secret is not None
        headers = {"content-type": "application/json"}
        if self.config.format is WebhookFormat.STANDARD:
            secret: str | bytes = BAD_SECRET if wrong else self.config.secret
            signature = standardwebhooks.Webhook(secret).sign(event_id, now, body)
            headers.update(
                {
                    "webhook-id": event_id,
                    "webhook-timestamp": str(int(now.timestamp())),
                    "webhook-signature": signature,
                }
            )
            return headers
        key = BAD_SECRET if wrong else self.config.secret.encode()
        stamp = str(int(now.timestamp()))
        digest = hmac.new(key, stamp.encode() + b"." + body, hashlib.sha256).hexdigest()
        headers["stripe-signature"] = f"t={stamp},v1={digest}"
        return headers
