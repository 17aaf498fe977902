"""The ``helpdesk`` adapter: ``HttpAdapter`` preset for the bundled fake provider.

``POST {base}/v1/tickets`` with ``{subject, body, priority, client_reference}``
and the ``Idempotency-Key`` header; the reply's ``id`` is the reference. Lookup
is ``GET {base}/v1/tickets?client_reference={effect_key}``, which answers
``{"tickets": [...]}``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import httpx

from adapters.http import HttpAdapter, HttpAdapterConfig
from adapters.protocol import Capabilities

NAME_DEFAULT = "helpdesk"
BASE_URL_DEFAULT = "http://127.0.0.1:9000"
LOOKUP_SETTLE_SECONDS_DEFAULT = 1.0
CAPABILITIES_DEFAULT = Capabilities(
    honours_idempotency_keys=True,
    supports_lookup=True,
    lookup_settle_seconds=LOOKUP_SETTLE_SECONDS_DEFAULT,
)


def helpdesk_config(base_url: str = BASE_URL_DEFAULT, **overrides: Any) -> HttpAdapterConfig:
    """The helpdesk preset at ``base_url``; any ``HttpAdapterConfig`` field may be overridden."""
    base = base_url.rstrip("/")
    config = HttpAdapterConfig(
        url=f"{base}/v1/tickets",
        lookup_url=f"{base}/v1/tickets?client_reference={{effect_key}}",
        idempotency_header="Idempotency-Key",
        client_reference_field="client_reference",
        reference_field="id",
        lookup_list_field="tickets",
        capabilities=CAPABILITIES_DEFAULT,
    )
    return dataclasses.replace(config, **overrides)


def helpdesk_adapter(
    base_url: str = BASE_URL_DEFAULT,
    *,
    name: str = NAME_DEFAULT,
    transport: httpx.BaseTransport | None = None,
    env: Mapping[str, str] | None = None,
    **overrides: Any,
) -> HttpAdapter:
    """An ``HttpAdapter`` for the fake provider at ``base_url``."""
    return HttpAdapter(name, helpdesk_config(base_url, **overrides), transport=transport, env=env)
