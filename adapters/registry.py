"""``Registry``: the adapters a process can deliver through, by name."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Self

from adapters.errors import ConfigError, UnknownAdapter
from adapters.protocol import Adapter
from adapters.webhooks import WebhookConfig


class Registry:
    """Adapters by name. Filled at start-up, then read from many threads.

    Closing the registry closes every adapter in it; it is also a context manager.
    """

    def __init__(self, adapters: tuple[Adapter, ...] | list[Adapter] = ()) -> None:
        self._adapters: dict[str, Adapter] = {}
        # Adapters whose provider sends signed webhooks (adapters.webhooks), by name.
        self.webhooks: dict[str, WebhookConfig] = {}
        self._lock = threading.Lock()
        for adapter in adapters:
            self.register(adapter)

    def register(self, adapter: Adapter) -> None:
        """Add ``adapter`` under its name; a second adapter with that name is an error."""
        if not isinstance(adapter, Adapter):
            raise TypeError(f"{adapter!r} does not implement the Adapter protocol")
        with self._lock:
            if adapter.name in self._adapters:
                raise ConfigError(
                    "is configured twice; adapter names must be unique", adapter=adapter.name
                )
            self._adapters[adapter.name] = adapter

    def get(self, name: str) -> Adapter:
        """The adapter called ``name``; ``UnknownAdapter`` lists the known ones."""
        try:
            return self._adapters[name]
        except KeyError:
            raise UnknownAdapter(name, self._adapters) from None

    def names(self) -> tuple[str, ...]:
        """Registered names, sorted."""
        return tuple(sorted(self._adapters))

    def __contains__(self, name: object) -> bool:
        return name in self._adapters

    def __iter__(self) -> Iterator[Adapter]:
        return iter(list(self._adapters.values()))

    def __len__(self) -> int:
        return len(self._adapters)

    def __repr__(self) -> str:
        return f"Registry({', '.join(self.names())})"

    def close(self) -> None:
        """Close every adapter, even when one of them fails; then raise the first failure."""
        first: BaseException | None = None
        for adapter in list(self._adapters.values()):
            try:
                adapter.close()
            except Exception as exc:  # noqa: BLE001 - keep closing the others first
                first = first or exc
        if first is not None:
            raise first

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
