"""Adapters: deliver one external effect with its own idempotency key, and say
what happened as a value.

Everything the dispatcher and the reconciler may use is importable from here.
The classification table lives in ``adapters.classify`` and is documented in
docs/adapter-protocol.md. ``adapters.testing`` ships ``FakeAdapter`` and ``NoopAdapter``.
"""

from __future__ import annotations

from adapters.classify import classify_exception, classify_response, parse_retry_after
from adapters.config import ADAPTERS_ENV, load_registry
from adapters.errors import AdapterClosed, AdapterError, ConfigError, PayloadError, UnknownAdapter
from adapters.http import HttpAdapter, HttpAdapterConfig
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

__all__ = [
    "ADAPTERS_ENV",
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
    "Registry",
    "UnknownAdapter",
    "classify_exception",
    "classify_response",
    "load_registry",
    "parse_retry_after",
]
