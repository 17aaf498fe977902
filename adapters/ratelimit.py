"""A per-adapter request rate limit, shared by every thread of one process.

``rate_limit = "25/second"`` (the ``limits`` library's notation: ``N/second``,
``N per minute``, ``N/hour``...) caps how fast one adapter sends, deliveries and
lookups together, across all the dispatcher's delivery threads: they share the
adapter object, and with it one in-memory moving-window limiter.

A request that finds the window full waits for a free slot, up to
``rate_limit_wait`` seconds, before anything is sent; past that it is NOT_SENT
("rate limit ... reached here") and the dispatcher retries it later. The wait
uses ``time.sleep`` in small steps, so a shutdown is never held for long.
Separate dispatcher processes each have their own limiter: divide the
provider's limit by the number of processes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from limits import RateLimitItem

RATE_LIMIT_WAIT_DEFAULT = 5.0
_STEP_SECONDS = 0.05


def parse_rate(text: str) -> RateLimitItem:
    """``"25/second"`` as a ``limits`` item; ``ValueError`` when it is not one."""
    # Imported here: only adapters with a rate limit pay for the library's import.
    from limits import parse

    return parse(text)


class RateLimiter:
    """``acquire()`` blocks until one request may go, or returns False after ``max_wait``."""

    def __init__(
        self,
        rate: str,
        *,
        max_wait: float = RATE_LIMIT_WAIT_DEFAULT,
        key: str = "adapter",
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate_text = rate
        self.item = parse_rate(rate)
        self.max_wait = max_wait
        self._key = key
        from limits import storage, strategies

        self._limiter: Any = strategies.MovingWindowRateLimiter(storage.MemoryStorage())
        self._sleep = sleep
        self._clock = clock
        self._lock = threading.Lock()

    def acquire(self) -> bool:
        deadline = self._clock() + self.max_wait
        while True:
            with self._lock:
                if self._limiter.hit(self.item, self._key):
                    return True
                reset_at = self._limiter.get_window_stats(self.item, self._key).reset_time
            left = deadline - self._clock()
            if left <= 0:
                return False
            wait = max(0.0, reset_at - time.time())
            self._sleep(min(max(wait, _STEP_SECONDS), left, 1.0))

    def __repr__(self) -> str:
        return f"RateLimiter({self.rate_text!r}, max_wait={self.max_wait})"
