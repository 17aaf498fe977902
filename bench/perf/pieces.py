"""The dispatcher's Python for one effect, piece by piece, each timed alone.

``python -m bench.perf.pieces [--effects N]``

A drain spends CPU in the database's work and in ours. ``make bench``'s CPU table
gives both per effect; this gives the floor under ours: the pieces every effect
passes through, run on the dispatcher's own objects (a no-op adapter, no
database, no threads), each over ``N`` effects, medians of 5 rounds. Their sum
is what the dispatcher's Python cannot go below without dropping one of them:

- the claimed row built from the driver's tuple (``store._claimed_row``);
- admission: the breaker and the retry budget (``Dispatcher._admit``);
- the send: payload decoded, the adapter's request built, the adapter called, its
  result classified (``Dispatcher._deliver``);
- the hand-off to a runner and back (two lock sections, a queue put and get; the
  thread switch itself is not in it);
- counting the delivery (its attempt's duration in a histogram; the counter is
  counted once a batch, ``_count_deliveries``);
- the result's decision and the breaker fed (``Dispatcher._finish``);
- the batch of results encoded for PostgreSQL's one finish statement (``store._pg_batch``).
"""

from __future__ import annotations

import argparse
import queue
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROUNDS = 5
PAYLOAD = (
    '{"body":"The parcel was promised for Tuesday and has not arrived; please chase '
    'the carrier.","priority":"normal","subject":"Bench task 0-1"}'
)


def measure(effects: int) -> dict[str, float]:
    """Median microseconds per effect of each piece."""
    import adapters
    from adapters.testing import NoopAdapter
    from outbox import db, metrics, settings
    from outbox.delivery import store
    from outbox.delivery.dispatcher import Dispatcher

    config = settings.load()
    folder = tempfile.mkdtemp(prefix="outbox_pieces_")
    engine = db.create_engine(config, url=f"sqlite:///{Path(folder) / 'unused.db'}")
    dispatcher = Dispatcher(engine, adapters.Registry([NoopAdapter("noop")]), config)
    now = datetime.now(UTC)
    later = now + timedelta(minutes=15)
    rows = [
        (i, "t", f"op{i}", "open_ticket", "noop", PAYLOAD, f"obx_{i:032x}", 1, 1, False, later)
        for i in range(effects)
    ]
    claimed = [store._claimed_row(r, now, now + timedelta(seconds=30)) for r in rows]
    took: dict[str, list[float]] = {}

    def timed(name: str, piece: Callable[[Any], object], items: Sequence[Any]) -> None:
        began = time.perf_counter()
        for item in items:
            piece(item)
        took.setdefault(name, []).append((time.perf_counter() - began) / len(items) * 1e6)

    lock = threading.Lock()
    handoff: queue.SimpleQueue[object] = queue.SimpleQueue()

    def hand_off(task: object) -> None:
        with lock:
            pass
        handoff.put(task)
        with lock:
            pass
        handoff.get()

    try:
        for _ in range(ROUNDS):
            started = time.monotonic()
            tasks = [dispatcher._task(c, started, started + 30) for c in claimed]
            timed(
                "claimed row from the driver's tuple",
                lambda r: store._claimed_row(r, now, now),
                rows,
            )
            timed(
                "admission (breaker, retry budget)",
                lambda c: dispatcher._admit(
                    store.Candidate(c.id, c.adapter, 0, c.maybe_sent, c.deadline_at), now
                ),
                claimed,
            )
            results: list[Any] = []
            timed(
                "send (request, adapter, result)",
                lambda t, out=results: out.append(dispatcher._deliver(t)),
                tasks,
            )
            timed("hand-off to a runner and back", hand_off, tasks)
            timed(
                "delivery counted (metrics)",
                lambda _: metrics.labelled(metrics.ATTEMPT_SECONDS, "noop").observe(0.001),
                tasks,
            )
            pairs = list(zip(tasks, results, strict=True))
            finishes: list[Any] = []
            timed(
                "decision (policy, breaker)",
                lambda p, out=finishes: out.append(dispatcher._finish(p[0], p[1], now)),
                pairs,
            )
            batches = [finishes[i : i + 100] for i in range(0, len(finishes), 100)]
            began = time.perf_counter()
            for batch in batches:
                store._pg_batch(batch)
            took.setdefault("results encoded for the finish (PostgreSQL)", []).append(
                (time.perf_counter() - began) / len(finishes) * 1e6
            )
    finally:
        dispatcher.close()
        engine.dispose()
    return {name: statistics.median(values) for name, values in took.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--effects", type=int, default=20_000)
    options = parser.parse_args(argv)
    pieces = measure(options.effects)
    width = max(map(len, pieces))
    for name, micros in pieces.items():
        print(f"{name:<{width}}  {micros:6.2f} µs")
    print(f"{'sum: the least Python an effect takes':<{width}}  {sum(pieces.values()):6.2f} µs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
