"""``POST /v1/webhooks/{adapter}``: provider events, authenticated by their signature.

No bearer token: the provider signs each event with a secret we share
(``adapters.webhooks``), and the tenant comes from the effect the event
matches. Order of checks, each before the next:

1. the adapter has webhooks configured (else 404, nothing stored);
2. the signature, by one of the adapter's secrets, within its tolerance
   (else 401 problem ``invalid-signature``, nothing stored);
3. the body is a JSON object with an event id and type (else 400, nothing stored);
4. ``outbox.settling.webhooks.receive``: stored once, matched, settled or kept.

Answers: 200 when the event found its effect (settled, confirmed, conflict,
ignored) or was already received; 202 when it was kept for an effect we do
not know yet. A provider retries on anything else, which is what we want.
"""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

import adapters
from outbox import errors, states
from outbox.api import auth, problems
from outbox.service import Outbox
from outbox.settling import webhooks

Box = Annotated[Outbox, Depends(auth.get_box)]
AdapterName = Annotated[str, Path(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.-]+$")]

router = APIRouter(tags=["webhooks"])


class InvalidSignature(errors.OutboxError):
    """The event is not signed by this adapter's webhook secret; nothing was stored."""

    problem_type = "invalid-signature"
    title = "Invalid webhook signature"
    status = 401
    retry = "after_fix"


class NoWebhooks(errors.NotFound):
    """This adapter has no webhooks configured; nothing was stored."""


class InvalidEvent(errors.RequestError):
    """The event cannot be read; nothing was stored."""

    problem_type = "invalid-event"
    title = "Invalid webhook event"
    status = 400


def configs(request: Request, box: Outbox) -> dict[str, adapters.WebhookConfig]:
    """The adapters' webhook settings: given to ``create_app``, or read once from the
    adapters file (``OUTBOX_ADAPTERS``) on the first event."""
    state = request.app.state
    cached: dict[str, adapters.WebhookConfig] | None = getattr(state, "webhook_configs", None)
    if cached is None:
        try:
            registry = adapters.load_registry(box.settings.adapters)
        except adapters.ConfigError as exc:
            raise errors.ConfigError(f"adapters: {exc}") from exc
        try:
            cached = dict(registry.webhooks)
        finally:
            registry.close()
        state.webhook_configs = cached
    return cached


@router.post(
    "/v1/webhooks/{adapter}",
    summary="Receive a signed provider event; it may settle an effect",
    responses={
        200: {"description": "Stored (or already stored); it found its effect."},
        202: {"description": "Stored; no effect of ours matches it yet. It is matched later."},
        **problems.responses(400, 401, 404, 413),
    },
)
async def receive_webhook(adapter: AdapterName, request: Request, box: Box) -> JSONResponse:
    config = configs(request, box).get(adapter)
    if config is None:
        raise NoWebhooks(f"adapter {adapter!r} has no webhooks configured; nothing was stored")
    body = await request.body()
    now = box.clock()
    try:
        signed_at = config.verify(request.headers, body, now)
    except adapters.SignatureError as exc:
        raise InvalidSignature(f"{exc}; nothing was stored") from None
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise InvalidEvent("the body is not JSON; nothing was stored") from None
    if not isinstance(data, dict):
        raise InvalidEvent("the event must be a JSON object; nothing was stored")
    try:
        event = config.read(request.headers, body, data, signed_at)
    except ValueError as exc:
        raise InvalidEvent(f"{exc}; nothing was stored") from None
    if (
        "\x00" in event.body
        or any("\x00" in (v or "") for v in (event.event_id, event.event_type, event.effect_key))
        or "\x00" in (event.provider_ref or "")
    ):
        # PostgreSQL text cannot hold NUL: refuse it here, not with a 500 from the driver.
        raise InvalidEvent("the event contains NUL characters; nothing was stored")
    received = await run_in_threadpool(
        lambda: webhooks.receive(box.engine, adapter, event, now=now)
    )
    status = 202 if received.disposition is states.WebhookDisposition.UNMATCHED else 200
    return JSONResponse(received.to_dict(), status_code=status)
