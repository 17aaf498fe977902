"""Helpers shared by the adapter tests."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import httpx

from adapters import DeliveryRequest

TICKET = {"subject": "Printer on fire", "body": "Third floor.", "priority": "high"}
FIXED_NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def request_for(key: str = "eff-1", attempt: int = 1, **payload: Any) -> DeliveryRequest:
    return DeliveryRequest(
        effect_id=1,
        effect_key=key,
        tenant="acme",
        operation_id="op-1",
        effect="open_ticket",
        payload=payload or dict(TICKET),
        attempt=attempt,
    )


def httpx_exception_classes() -> list[type[BaseException]]:
    """Every exception class in httpx's tree(s), found by walking subclasses."""
    roots = [
        value
        for value in vars(httpx).values()
        if isinstance(value, type) and issubclass(value, BaseException)
    ]
    seen: dict[type[BaseException], None] = {}
    stack = list(roots)
    while stack:
        klass = stack.pop()
        if klass in seen or not klass.__module__.startswith("httpx"):
            continue
        seen[klass] = None
        stack.extend(klass.__subclasses__())
    return sorted(seen, key=lambda k: k.__name__)


def make_exception(klass: type[BaseException], *, status: int = 503) -> BaseException:
    """An instance of any httpx exception class (their constructors differ)."""
    request = httpx.Request("POST", "http://provider.test/v1/tickets")
    if issubclass(klass, httpx.HTTPStatusError):
        response = httpx.Response(status, request=request, headers={"Retry-After": "7"})
        return klass("boom", request=request, response=response)
    if issubclass(klass, httpx.RequestError):
        return klass("boom", request=request)
    try:
        return klass("boom")
    except TypeError:
        return klass()
