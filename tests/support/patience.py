"""How long a test waits for what another thread or process will do.

A limit here is a safety net for a broken build, never a measurement: a test
waits for the event itself (a row, a log line, a reply) and gives up only after
``PATIENCE_S``, which is long enough for a 2-core machine shared with much
other work (a process start can take a minute there). A test that
must show something happened *before* something else (a NOTIFY before the
poll, a grace before a provider's hold) compares with that other thing, made
longer than the patience, not with a guess at the machine's speed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

PATIENCE_S = 120.0
# ``pg_terminate_backend(pid, timeout)`` returns as soon as the backend is gone; a
# busy server may take more than a few seconds to end one.
TERMINATE_WAIT_MS = int(PATIENCE_S * 1000)


def until(condition: Callable[[], bool], what: str) -> None:
    """Wait for a condition another thread brings about, bounded by count."""
    for _ in range(int(PATIENCE_S / 0.01)):
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError(f"never happened: {what}")
