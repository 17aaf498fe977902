"""Exceptions raised by adapters.

Delivery outcomes are values (``DeliveryResult``), never exceptions. An
exception from this package means a broken contract or a bad configuration, and
``deliver()`` raises one only *before* anything was sent, so a caller may treat
it as "not sent".

::

    AdapterError            unexpected adapter error
    ├── PayloadError        the request could not be built (payload not JSON, key missing, ...)
    ├── ConfigError         the adapter configuration is invalid (names the adapter and the field)
    ├── UnknownAdapter      no adapter registered under that name (also a KeyError)
    └── AdapterClosed       the adapter was used after close()
"""

from __future__ import annotations

from collections.abc import Iterable


class AdapterError(Exception):
    """Unexpected adapter error."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or self.__doc__)


class PayloadError(AdapterError):
    """The request could not be built from the payload; nothing was sent."""

    def __init__(
        self,
        message: str | None = None,
        *,
        adapter: str | None = None,
        effect_key: str | None = None,
    ) -> None:
        super().__init__(message)
        self.adapter = adapter
        self.effect_key = effect_key


class ConfigError(AdapterError):
    """The adapter configuration is invalid."""

    def __init__(
        self, message: str | None = None, *, adapter: str | None = None, field: str | None = None
    ) -> None:
        if message is not None and (adapter is not None or field is not None):
            where = ".".join(part for part in (adapter, field) if part)
            message = f"adapter config {where}: {message}"
        super().__init__(message)
        self.adapter = adapter
        self.field = field


class UnknownAdapter(AdapterError, KeyError):
    """No adapter is registered under that name."""

    def __init__(self, name: str, known: Iterable[str] = ()) -> None:
        self.name = name
        self.known = tuple(sorted(known))
        listed = ", ".join(repr(k) for k in self.known) or "none"
        super().__init__(f"no adapter named {name!r}; known adapters: {listed}")

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class AdapterClosed(AdapterError):
    """The adapter was used after close(); nothing was sent."""

    def __init__(self, adapter: str) -> None:
        super().__init__(f"adapter {adapter!r} is closed")
        self.adapter = adapter
