"""Adapters for tests and benchmarks, shipped so every user tests the same way.

``FakeAdapter`` plays a provider that honours idempotency keys: it answers from
a script, then with "delivered" (reference ``fake-{effect_key}``), and records
every call. Its lookups find what it delivered. ``NoopAdapter`` delivers
everything at once, for measuring the dispatcher rather than a provider.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable
from typing import TypeAlias

from adapters.errors import AdapterClosed, PayloadError
from adapters.protocol import (
    Capabilities,
    DeliveryRequest,
    DeliveryResult,
    LookupResult,
    LookupStatus,
    Outcome,
)

DeliveryStep: TypeAlias = (
    DeliveryResult | BaseException | Callable[[DeliveryRequest], DeliveryResult]
)
"""A script entry: return this result, raise this exception, or call this."""

LookupStep: TypeAlias = LookupResult | BaseException | Callable[[str, str | None], LookupResult]

FAKE_CAPABILITIES_DEFAULT = Capabilities(honours_idempotency_keys=True, supports_lookup=True)


class FakeAdapter:
    """A scripted, recording, thread-safe ``Adapter``.

    ``script`` entries are used in order, one per ``deliver`` call; when they
    run out, each call is delivered with reference ``fake-{effect_key}``. A
    DELIVERED result (scripted or not) is remembered per key, so a later
    unscripted ``lookup`` finds it and an unscripted resend replays its
    reference, as a provider that honours keys would. ``lookup_script`` works
    the same way for ``lookup``; unscripted lookups answer from memory
    (``found`` or an authoritative ``not_found``).
    """

    def __init__(
        self,
        name: str = "fake",
        capabilities: Capabilities = FAKE_CAPABILITIES_DEFAULT,
        script: Iterable[DeliveryStep] = (),
        lookup_script: Iterable[LookupStep] = (),
    ) -> None:
        self.name = name
        self.capabilities = capabilities
        self.calls: list[DeliveryRequest] = []
        self.lookups: list[tuple[str, str | None]] = []
        self.delivered: dict[str, str | None] = {}  # effect_key -> provider_ref
        self.closed = False
        self._script = list(script)
        self._lookup_script = list(lookup_script)
        self._lock = threading.Lock()

    def push(self, *steps: DeliveryStep) -> None:
        """Append delivery steps to the script."""
        with self._lock:
            self._script.extend(steps)

    def push_lookup(self, *steps: LookupStep) -> None:
        """Append lookup steps to the lookup script."""
        with self._lock:
            self._lookup_script.extend(steps)

    def deliver(self, request: DeliveryRequest) -> DeliveryResult:
        # Refuse what HttpAdapter refuses, before "sending", so tests written
        # against the fake do not pass with payloads the real adapter rejects.
        try:
            json.dumps(dict(request.payload), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise PayloadError(
                f"payload is not JSON-serialisable: {exc}",
                adapter=self.name,
                effect_key=request.effect_key,
            ) from exc
        with self._lock:
            if self.closed:
                raise AdapterClosed(self.name)
            self.calls.append(request)
            step: DeliveryStep | None = self._script.pop(0) if self._script else None
        if step is None:
            with self._lock:
                ref = self.delivered.get(request.effect_key) or f"fake-{request.effect_key}"
            result = DeliveryResult.delivered(ref, status_code=201)
        elif isinstance(step, BaseException):
            raise step
        elif isinstance(step, DeliveryResult):
            result = step
        else:
            result = step(request)
        if result.outcome is Outcome.DELIVERED:
            with self._lock:
                self.delivered.setdefault(request.effect_key, result.provider_ref)
        return result

    def lookup(self, effect_key: str, reference: str | None) -> LookupResult:
        with self._lock:
            if self.closed:
                raise AdapterClosed(self.name)
            self.lookups.append((effect_key, reference))
            step: LookupStep | None = self._lookup_script.pop(0) if self._lookup_script else None
            known = effect_key in self.delivered
            ref = self.delivered.get(effect_key)
        if step is None:
            if not known:
                return LookupResult.not_found()
            return LookupResult.found(ref or f"fake-{effect_key}")
        if isinstance(step, BaseException):
            raise step
        if isinstance(step, LookupResult):
            return step
        return step(effect_key, reference)

    def close(self) -> None:
        with self._lock:
            self.closed = True


class NoopAdapter:
    """Delivers everything at once (reference ``noop-{effect_key}``); remembers nothing."""

    def __init__(
        self,
        name: str = "noop",
        capabilities: Capabilities = FAKE_CAPABILITIES_DEFAULT,
    ) -> None:
        self.name = name
        self.capabilities = capabilities

    def deliver(self, request: DeliveryRequest) -> DeliveryResult:
        return DeliveryResult(Outcome.DELIVERED, f"noop-{request.effect_key}", 200)

    def lookup(self, effect_key: str, reference: str | None) -> LookupResult:
        return LookupResult(LookupStatus.FOUND, reference or f"noop-{effect_key}")

    def close(self) -> None:
        pass
