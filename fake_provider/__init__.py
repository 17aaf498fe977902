"""A fake helpdesk provider: honours or ignores idempotency keys, injects faults on demand.

It stands for a system someone else runs: it imports nothing of ours, keeps its
own store, and keeps a ledger of every effect so that tests can count
duplicates from the provider's side. See docs/fake-provider.md.
"""

from __future__ import annotations

from fake_provider.app import ConnectionDropped, create_app
from fake_provider.config import ConfigError, DropMode, Mode, ProviderConfig, RetryAfterFormat
from fake_provider.faults import FaultPlan, FaultSpec, FaultSpecError, Outcome
from fake_provider.ledger import Ledger

__all__ = [
    "ConfigError",
    "ConnectionDropped",
    "DropMode",
    "FaultPlan",
    "FaultSpec",
    "FaultSpecError",
    "Ledger",
    "Mode",
    "Outcome",
    "ProviderConfig",
    "RetryAfterFormat",
    "create_app",
]
