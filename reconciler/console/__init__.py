"""The operator console: server-rendered pages under ``/console`` in the API process.

Mounted through the ``outbox.routers`` entry point (``routers()``), like the
review API, so ``outbox`` never imports it. Pages: sign-in with an operator
token, the review queue, one item with all its evidence and the resolve form
(with a confirmation step), and an overview of the backlog. docs/operator-console.md
describes them.
"""

from __future__ import annotations

from fastapi import APIRouter

from reconciler.console.routes import Console

__all__ = ["Console", "routers"]


def routers() -> list[APIRouter]:
    """One router per app: each gets its own signing secret (sessions die with the process)."""
    return [Console().router()]
