"""Named crash windows, for tests that prove what survives a failure at each one.

Production code calls ``faults.point("create.after_task_insert")`` at each
window; it costs one dict lookup when nothing is armed. A test arms a point
with an exception to raise, or with a callable (``os._exit`` to die for real).

Points:

- ``create.after_task_insert``, ``create.after_operation_insert``,
  ``create.after_outbox_insert``: inside the creating transaction. On
  PostgreSQL's one-statement create, whose writes commit alone as one
  statement, they fire in that order just before it is sent: the last moment
  at which nothing is committed.
- ``dispatch.after_attempt_commit``: the attempt row is committed, nothing sent.
- ``dispatch.after_send_before_finish``: the provider answered; nothing recorded.
- ``mcp.after_execute``: an MCP tool call's create has committed; its reply is
  not yet sent (the lost-reply window, as an agent host sees it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Action = BaseException | type[BaseException] | Callable[[], object]

_armed: dict[str, Action] = {}
_lock = threading.Lock()


def point(name: str) -> None:
    if not _armed:
        return
    action = _armed.get(name)
    if action is None:
        return
    if isinstance(action, BaseException) or (
        isinstance(action, type) and issubclass(action, BaseException)
    ):
        raise action
    action()


def arm(name: str, action: Action) -> None:
    with _lock:
        _armed[name] = action


def disarm(name: str | None = None) -> None:
    with _lock:
        if name is None:
            _armed.clear()
        else:
            _armed.pop(name, None)


@contextmanager
def armed(name: str, action: Action) -> Iterator[None]:
    arm(name, action)
    try:
        yield
    finally:
        disarm(name)


class InjectedFault(RuntimeError):
    """Raised by an armed crash window in tests."""
