"""Outbox: writes to the outside world that are safe to retry.

The names reconciler code and tests may import from the package itself.
"""

from __future__ import annotations

from outbox.create import ExecuteResult
from outbox.errors import OutboxError
from outbox.service import Outbox, Principal
from outbox.settings import Settings

__all__ = ["ExecuteResult", "Outbox", "OutboxError", "Principal", "Settings"]
