"""The receiver and the fake provider's webhooks together: an Outbox API on a real
socket, the fake provider on another, sending signed events to it."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import pytest

import adapters
from adapters import helpdesk
from fake_provider import Mode, ProviderConfig, create_app
from fake_provider import webhooks as provider_webhooks
from outbox import Outbox, settings
from outbox.api import create_app as create_api
from outbox.delivery.dispatcher import Dispatcher
from tests.conftest import Clock
from tests.dispatcher.conftest import TEST_SETTINGS
from tests.support.servers import serve_in_thread

TENANT = "acme"
ADAPTER = "helpdesk"
SUCCEEDED_TYPES = ("ticket.created",)
FAILED_TYPES = ("ticket.failed",)


@dataclass
class Stack:
    box: Outbox
    api_url: str
    provider: Any  # the fake provider's Starlette app
    provider_url: str
    secret: str
    config: adapters.WebhookConfig
    adapter: adapters.Adapter
    dispatcher: Dispatcher
    registry: adapters.Registry

    @property
    def sender(self) -> provider_webhooks.Sender:
        sender: provider_webhooks.Sender = self.provider.state.webhooks
        return sender

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = self.provider.state.ledger.stats()
        return stats

    def tickets(self) -> list[Any]:
        return list(self.provider.state.ledger.tickets())


MakeStack = Callable[..., Stack]


def receiver_config(secret: str, fmt: str = "standard", **overrides: Any) -> adapters.WebhookConfig:
    fields: dict[str, Any] = {
        "format": fmt,
        "secrets": (secret,),
        "succeeded_types": SUCCEEDED_TYPES,
        "failed_types": FAILED_TYPES,
        **overrides,
    }
    return adapters.WebhookConfig(**fields)


@pytest.fixture
def make_stack(db_url: str, clock: Clock) -> Iterator[MakeStack]:
    with ExitStack() as stack:

        def make(
            *,
            fmt: str = "standard",
            mode: str = "ignore",
            lookup: bool = False,
            honours: bool = False,
            **webhook_faults: Any,
        ) -> Stack:
            secret = (
                provider_webhooks.new_secret() if fmt == "standard" else "sk_test_shared_secret"
            )
            box = Outbox(db_url, config=settings.load(database_url=db_url), clock=clock)
            stack.callback(box.close)
            box.create_tenant(TENANT)
            config = receiver_config(secret, fmt)
            api = create_api(box, load_entry_points=False, webhook_configs={ADAPTER: config})
            api_url = stack.enter_context(serve_in_thread(api))
            provider = create_app(
                ProviderConfig(
                    mode=Mode(mode),
                    lookup_enabled=lookup,
                    seed=0,
                    webhooks=provider_webhooks.WebhookConfig(
                        url=f"{api_url}/v1/webhooks/{ADAPTER}",
                        secret=secret,
                        format=provider_webhooks.WebhookFormat(fmt),
                        **webhook_faults,
                    ),
                ),
                clock=clock,
            )
            stack.callback(provider.state.ledger.close)
            stack.callback(provider.state.webhooks.close)
            provider_url = stack.enter_context(serve_in_thread(provider))
            adapter = helpdesk.helpdesk_adapter(
                provider_url,
                capabilities=adapters.Capabilities(honours, lookup, 0.0),
            )
            stack.callback(adapter.close)
            registry = adapters.Registry([adapter])
            dispatcher = Dispatcher(
                box.engine,
                registry,
                settings.load(**TEST_SETTINGS),
                worker_id="w1",
                rng=random.Random(7),
            )
            stack.callback(dispatcher.close)
            return Stack(
                box, api_url, provider, provider_url, secret, config, adapter, dispatcher, registry
            )

        yield make
