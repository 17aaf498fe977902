"""The fake helpdesk as an ASGI app: tickets, lookups, the ledger and fault control.

It stands for a system someone else runs, so it imports nothing of ours and
keeps its own store (:mod:`fake_provider.ledger`). Only ``POST /v1/tickets``,
the request with an effect, is faulted; reads and ``/_admin`` never are, so a
test can always inspect the truth.

How one ``POST /v1/tickets`` is handled, in order:

1. The fault plan decides the outcome and latency (every POST draws, so the
   same seed gives the same sequence for the same sequence of requests).
2. A *before-commit* outcome (500, 504 after a hang, 429, 503, 400) answers
   after the latency; nothing is stored and no key is claimed.
3. The body is validated (400 ``invalid_request``).
4. In ``honour`` mode with an ``Idempotency-Key``, the key is claimed
   atomically: a replay, a 409 (still in progress) or a 422 (other body)
   answers here; the winner stalls for the latency while holding the claim
   (that is the window in which others see 409), then commits.
5. The ticket and the key's stored reply commit in one transaction.
6. An *after-commit* outcome replaces the reply: a 500, or no usable reply at
   all (abort the connection, or hold the reply past the client's timeout).
"""

from __future__ import annotations

import email.utils
import hashlib
import json
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import anyio.to_thread
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from fake_provider import config as config_
from fake_provider import faults, ledger, webhooks

Clock = Callable[[], datetime]

IDEMPOTENCY_KEY_HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"
PRIORITY_DEFAULT = "normal"


class ConnectionDropped(Exception):
    """Raised by the app to drop a connection after the ticket was committed.

    Over a real server the status line has been sent, so uvicorn closes the
    socket and the client sees a protocol error. In-process (httpx's
    ``ASGITransport``) there is no socket, so this exception reaches the
    client; :class:`fake_provider.testing.ProviderTransport` turns it into
    ``httpx.RemoteProtocolError``, as a socket client would see.
    """

    def __init__(self, ticket_id: str | None = None) -> None:
        super().__init__(f"connection dropped after commit (ticket {ticket_id})")
        self.ticket_id = ticket_id


def utc_now() -> datetime:
    """The default clock."""
    return datetime.now(UTC)


def canonical_digest(data: object) -> str:
    """SHA-256 of canonical JSON (sorted keys, no whitespace, UTF-8).

    "Same body" for an idempotency key means the same JSON value, so key order
    or spacing in the client's encoding does not turn a retry into a 422.
    """
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def create_app(
    config: config_.ProviderConfig | None = None,
    *,
    clock: Clock | None = None,
    webhook_transport: Any = None,
) -> Starlette:
    """Build a provider. ``app.state`` exposes ``ledger``, ``faults``, ``webhooks``,
    ``config`` and ``clock``.

    ``clock`` is injectable so that tests move time (lookup lag, key
    retention) instead of sleeping. The caller owns ``app.state.ledger`` and
    ``app.state.webhooks`` and closes them when done. ``webhook_transport``: an
    ``httpx.BaseTransport`` for the outgoing webhooks (tests).
    """
    cfg = config or config_.ProviderConfig()
    cfg.validate()
    now = clock or utc_now
    store = ledger.Ledger(cfg.db_path)
    plan = faults.FaultPlan(cfg.faults, seed=cfg.seed)
    initial_seed = plan.seed
    sender = webhooks.Sender(
        cfg.webhooks, clock=now, seed=initial_seed, transport=webhook_transport
    )
    handlers = _Handlers(cfg, store, plan, now, initial_seed, sender)
    app = Starlette(
        routes=[
            Route("/v1/tickets", handlers.create_ticket, methods=["POST"]),
            Route("/v1/tickets", handlers.lookup_tickets, methods=["GET"]),
            Route("/v1/tickets/{ticket_id}", handlers.get_ticket, methods=["GET"]),
            Route("/_admin/health", handlers.health, methods=["GET"]),
            Route("/_admin/effects", handlers.effects, methods=["GET"]),
            Route("/_admin/stats", handlers.stats, methods=["GET"]),
            Route("/_admin/reset", handlers.reset, methods=["POST"]),
            Route("/_admin/faults", handlers.get_faults, methods=["GET"]),
            Route("/_admin/faults", handlers.set_faults, methods=["POST"]),
            Route("/_admin/webhooks", handlers.webhook_stats, methods=["GET"]),
            Route("/_admin/webhooks/redeliver", handlers.redeliver, methods=["POST"]),
            Route("/_admin/webhooks/flush", handlers.flush, methods=["POST"]),
            Route("/_admin/webhooks/pause", handlers.pause, methods=["POST"]),
            Route("/_admin/webhooks/resume", handlers.resume, methods=["POST"]),
        ]
    )
    app.state.config = cfg
    app.state.ledger = store
    app.state.faults = plan
    app.state.webhooks = sender
    app.state.clock = now
    return app


def _error(status: int, error_type: str, message: str, **headers: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"type": error_type, "message": message}}, status_code=status, headers=headers
    )


def _parse_ticket(data: object) -> ledger.NewTicket | str:
    """The validated fields, or a message saying what is wrong."""
    if not isinstance(data, dict):
        return "the body must be a JSON object"
    subject = data.get("subject")
    if not isinstance(subject, str) or not subject.strip():
        return "subject: a non-empty string is required"
    body = data.get("body", "")
    if not isinstance(body, str):
        return "body: must be a string"
    priority = data.get("priority", PRIORITY_DEFAULT)
    if not isinstance(priority, str) or not priority:
        return "priority: must be a non-empty string"
    reference = data.get("client_reference")
    if reference is not None and not isinstance(reference, str):
        return "client_reference: must be a string or null"
    return ledger.NewTicket(subject, body, priority, reference)


class _AbortResponse(Response):
    """Send a status line promising a body, then drop the connection.

    Starting the response first matters: if an ASGI app fails before that,
    uvicorn answers a clean 500, which is a reply, not a lost one.
    """

    def __init__(self, ticket_id: str | None) -> None:
        super().__init__(status_code=201)
        self.ticket_id = ticket_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 201,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", b"64"),
                ],
            }
        )
        raise ConnectionDropped(self.ticket_id)


async def _stall(latency_ms: int) -> None:
    if latency_ms > 0:
        await anyio.sleep(latency_ms / 1000)


async def _hold(request: Request, seconds: float) -> bool:
    """Wait ``seconds``, or until the client hangs up; True if it hung up.

    Ending early on disconnect keeps tests fast and shutdown prompt: once the
    client's read timeout fired, holding the reply longer shows nothing new.
    """
    with anyio.move_on_after(seconds):
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return True
    return False


class _Handlers:
    """The endpoints, sharing one config, store, fault plan and clock."""

    def __init__(
        self,
        cfg: config_.ProviderConfig,
        store: ledger.Ledger,
        plan: faults.FaultPlan,
        clock: Clock,
        initial_seed: int,
        sender: webhooks.Sender,
    ) -> None:
        self.sender = sender
        self.cfg = cfg
        self.store = store
        self.plan = plan
        self.clock = clock
        self.initial_seed = initial_seed

    # -- the effect -------------------------------------------------------

    async def create_ticket(self, request: Request) -> Response:
        # The whole body first: a request whose body never arrives met no fault,
        # and a decision counted means the provider holds the request.
        raw = await request.body()
        decision = self.plan.decide()
        if decision.outcome in faults.BEFORE_COMMIT:
            await _stall(decision.latency_ms)
            return await self._before_commit(request, decision.outcome)
        try:
            data: object = json.loads(raw)
        except ValueError:
            reply: Response = _error(400, "invalid_request", "the body is not valid JSON")
            ticket_id = None
        else:
            parsed = _parse_ticket(data)
            if isinstance(parsed, str):
                reply, ticket_id = _error(400, "invalid_request", parsed), None
            else:
                reply, ticket_id = await self._commit(request, data, parsed, decision)
        return await self._after_commit(request, decision.outcome, reply, ticket_id)

    async def _commit(
        self,
        request: Request,
        data: object,
        fields: ledger.NewTicket,
        decision: faults.Decision,
    ) -> tuple[Response, str | None]:
        """Store the ticket (or find why not); the reply and the new ticket's id."""
        key = request.headers.get(IDEMPOTENCY_KEY_HEADER) or None
        digest = canonical_digest(data)
        honour = self.cfg.mode is config_.Mode.HONOUR and key is not None
        if honour:
            assert key is not None
            claim = self.store.claim_key(
                key,
                digest,
                now=self.clock(),
                retention=timedelta(seconds=self.cfg.key_retention_seconds),
            )
            if claim.status is ledger.ClaimStatus.IN_PROGRESS:
                return _error(
                    409,
                    "idempotency_key_in_use",
                    "a request with this Idempotency-Key is still being processed",
                ), None
            if claim.status is ledger.ClaimStatus.MISMATCH:
                return _error(
                    422,
                    "idempotency_key_reused",
                    "this Idempotency-Key was used with a different request body",
                ), None
            if claim.status is ledger.ClaimStatus.REPLAY:
                await _stall(decision.latency_ms)
                assert claim.status_code is not None and claim.response_body is not None
                replay = Response(
                    claim.response_body,
                    status_code=claim.status_code,
                    media_type="application/json",
                    headers={REPLAYED_HEADER: "true"},
                )
                return replay, None
        try:
            # Stall while holding the claim: concurrent requests with this
            # key see 409 during this window, as at a real provider.
            await _stall(decision.latency_ms)
            ticket, body = self.store.create_ticket(
                fields,
                idempotency_key=key,
                request_digest=digest,
                outcome=decision.outcome.value,
                now=self.clock(),
                complete_key=honour,
            )
        except BaseException:
            if honour:
                assert key is not None
                # Nothing committed (cancelled or failed): free the key, or a
                # retry would get 409 for a request that never happened.
                self.store.release_key(key)
            raise
        # The ticket has committed: announce it (whatever becomes of the reply).
        self.sender.ticket_created(ticket.to_json(), key)
        response = Response(body, status_code=201, media_type="application/json")
        response.headers["Location"] = f"/v1/tickets/{ticket.id}"
        return response, ticket.id

    async def _before_commit(self, request: Request, outcome: faults.Outcome) -> Response:
        if outcome is faults.Outcome.FAIL_BEFORE_COMMIT:
            return _error(500, "internal_error", "injected fault: failed before commit")
        if outcome is faults.Outcome.TIMEOUT_BEFORE_COMMIT:
            await _hold(request, self.cfg.hold_seconds)
            return _error(504, "gateway_timeout", "injected fault: timed out before commit")
        if outcome is faults.Outcome.RATE_LIMIT:
            return _error(429, "rate_limited", "injected fault: slow down", **self._retry_after())
        if outcome is faults.Outcome.UNAVAILABLE:
            return _error(
                503, "unavailable", "injected fault: try again later", **self._retry_after()
            )
        if outcome is faults.Outcome.REJECT:
            return _error(400, "rejected", "injected fault: request rejected")
        raise AssertionError(f"not a before-commit outcome: {outcome}")

    async def _after_commit(
        self, request: Request, outcome: faults.Outcome, reply: Response, ticket_id: str | None
    ) -> Response:
        # After-commit faults replace whatever reply the request earned (a new
        # ticket, a replay, a 409...): the provider did its work, the client
        # does not learn of it.
        if outcome is faults.Outcome.FAIL_AFTER_COMMIT:
            return _error(500, "internal_error", "injected fault: failed after commit")
        if outcome is faults.Outcome.DROP_AFTER_COMMIT:
            if self.cfg.drop_mode is config_.DropMode.ABORT:
                return _AbortResponse(ticket_id)
            await _hold(request, self.cfg.hold_seconds)
        return reply

    def _retry_after(self) -> dict[str, str]:
        seconds = self.cfg.retry_after_seconds
        if self.cfg.retry_after_format is config_.RetryAfterFormat.HTTP_DATE:
            at = self.clock().astimezone(UTC) + timedelta(seconds=seconds)
            return {"Retry-After": email.utils.format_datetime(at, usegmt=True)}
        return {"Retry-After": str(seconds)}

    # -- reads ------------------------------------------------------------

    async def get_ticket(self, request: Request) -> Response:
        ticket = self.store.get_ticket(request.path_params["ticket_id"])
        if ticket is None:
            return _error(404, "not_found", "no such ticket")
        return JSONResponse(ticket.to_json())

    async def lookup_tickets(self, request: Request) -> Response:
        if not self.cfg.lookup_enabled:
            return _error(501, "not_implemented", "this provider offers no lookup")
        reference = request.query_params.get("client_reference")
        key = request.query_params.get("idempotency_key")
        if reference is None and key is None:
            return _error(
                400, "invalid_request", "give client_reference or idempotency_key to look up"
            )
        # Eventual consistency: a ticket shows up in lookups lookup_lag_ms
        # after its creation, so "not found" right after a send is not proof.
        visible_until = self.clock() - timedelta(milliseconds=self.cfg.lookup_lag_ms)
        tickets = self.store.find_tickets(
            client_reference=reference, idempotency_key=key, created_at_or_before=visible_until
        )
        return JSONResponse({"tickets": [ticket.to_json() for ticket in tickets]})

    # -- admin ------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return JSONResponse(
            {
                "status": "ok",
                "mode": self.cfg.mode.value,
                "lookup_enabled": self.cfg.lookup_enabled,
                "lookup_lag_ms": self.cfg.lookup_lag_ms,
                "drop_mode": self.cfg.drop_mode.value,
                "durable": self.cfg.db_path is not None,
            }
        )

    async def effects(self, request: Request) -> Response:
        return JSONResponse({"effects": [ticket.to_effect() for ticket in self.store.tickets()]})

    async def stats(self, request: Request) -> Response:
        body = self.store.stats()
        body["requests"] = self.plan.counts()
        return JSONResponse(body)

    async def reset(self, request: Request) -> Response:
        # Back to the state at start: empty store, the configured plan with its
        # original seed, zero counts. Ticket ids are not reused.
        self.store.reset()
        self.plan.replace(self.cfg.faults, seed=self.initial_seed)
        self.plan.reset_counts()
        return JSONResponse({"reset": True})

    async def webhook_stats(self, request: Request) -> Response:
        body = self.sender.stats()
        body["events"] = len(self.sender.events())
        return JSONResponse(body)

    async def redeliver(self, request: Request) -> Response:
        return JSONResponse({"redelivered": self.sender.redeliver()})

    async def pause(self, request: Request) -> Response:
        self.sender.pause()
        return JSONResponse(self.sender.stats())

    async def resume(self, request: Request) -> Response:
        self.sender.resume()
        return JSONResponse(self.sender.stats())

    async def flush(self, request: Request) -> Response:
        done = await anyio.to_thread.run_sync(self.sender.flush)
        return JSONResponse({"flushed": done, **self.sender.stats()})

    async def get_faults(self, request: Request) -> Response:
        return JSONResponse(self.plan.snapshot())

    async def set_faults(self, request: Request) -> Response:
        try:
            data = json.loads(await request.body() or b"{}")
        except ValueError:
            return _error(400, "invalid_request", "the body is not valid JSON")
        if not isinstance(data, Mapping):
            return _error(400, "invalid_request", "the body must be a JSON object")
        seed = data.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            return _error(400, "invalid_request", "seed: expected an integer")
        try:
            spec = faults.FaultSpec.from_json(data)
        except faults.FaultSpecError as exc:
            return _error(400, "invalid_request", str(exc))
        self.plan.replace(spec, seed=seed)
        body: dict[str, Any] = self.plan.snapshot()
        return JSONResponse(body)
