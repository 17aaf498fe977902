"""Outbox: writes to the outside world that are safe to retry.

The names reconciler code and tests may import from the package itself. They
are loaded on first use (PEP 562), so importing a light submodule such as
``outbox.client`` does not pull in SQLAlchemy, FastAPI or the create path.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from outbox.creating.create import ExecuteResult
    from outbox.errors import OutboxError
    from outbox.service import Outbox, Principal
    from outbox.settings import Settings

__all__ = ["ExecuteResult", "Outbox", "OutboxError", "Principal", "Settings"]

# Each top-level name -> the module that defines it.
_LAZY = {
    "ExecuteResult": "outbox.creating.create",
    "Outbox": "outbox.service",
    "OutboxError": "outbox.errors",
    "Principal": "outbox.service",
    "Settings": "outbox.settings",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
