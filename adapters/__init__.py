"""Adapters: deliver one external effect with its own idempotency key, and say
what happened as a value.

Everything the dispatcher and the reconciler may use is importable from here.
The classification table lives in ``adapters.classify`` and is documented in
docs/adapter-protocol.md. ``adapters.testing`` ships ``FakeAdapter`` and ``NoopAdapter``.
"""

from __future__ import annotations

from adapters.classify import classify_exception, classify_response, parse_retry_after
from adapters.config import ADAPTERS_ENV, build_adapter, load_registry, read_document
from adapters.errors import AdapterClosed, AdapterError, ConfigError, PayloadError, UnknownAdapter
from adapters.http import HttpAdapter, HttpAdapterConfig, PreparedRequest
from adapters.presets import PRESETS, Preset
from adapters.protocol import (
    Adapter,
    Capabilities,
    DeliveryRequest,
    DeliveryResult,
    LookupResult,
    LookupStatus,
    Outcome,
)
from adapters.registry import Registry
from adapters.webhooks import Event as WebhookEvent
from adapters.webhooks import SignatureError, WebhookConfig

__all__ = [
    "ADAPTERS_ENV",
    "PRESETS",
    "Adapter",
    "AdapterClosed",
    "AdapterError",
    "Capabilities",
    "ConfigError",
    "DeliveryRequest",
    "DeliveryResult",
    "HttpAdapter",
    "HttpAdapterConfig",
    "LookupResult",
    "LookupStatus",
    "Outcome",
    "PayloadError",
    "PreparedRequest",
    "Preset",
    "Registry",
    "SignatureError",
    "UnknownAdapter",
    "WebhookConfig",
    "WebhookEvent",
    "build_adapter",
    "classify_exception",
    "classify_response",
    "load_registry",
    "parse_retry_after",
    "read_document",
]
