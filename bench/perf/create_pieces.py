"""A create's Python, piece by piece, each timed alone, beside the floor's.

``python -m bench.perf.create_pieces [--calls N] [--pg URL]``

A create on PostgreSQL spends its time in three places: our Python before the
statement, the server's work on it, and the commit's flush. ``make bench``'s CPU
table gives the first two per create; this splits the first. Each piece runs on
the library's own objects, in the order ``Outbox.execute`` runs them for
``create_support_task``, over ``N`` calls, medians of 5 rounds, the garbage collector off while a piece
runs (as ``timeit`` does), with nothing sent to the database (the task ids are
drawn ahead, as a block would give them):

- the call's frame: the operation id checked, the tool looked up, the clock, the
  counter and the log call, the replay share, the result (``Outbox.execute``);
- the arguments validated by the tool's model, and dumped for the digest;
- the digest (canonical JSON, SHA-256);
- the handler: its context, the task row collected with its id;
- the receipt, the record's and the outbox row's values (``_record_and_effects``);
- the statement's parameters (``_pg_statement``);
- a pooled connection taken and given back, switched to autocommit and back
  (the only piece that needs the database: a connection, no statement).

Beside them, the floor's own Python for the same create (its rows, its receipt,
the same statement's parameters): the floor (``bench.perf.floor``) sends our
statement from a bare driver loop, so what our pieces add over its Python is
what our library costs a create before the driver's work, which both pay.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from bench.perf import create_path, floor, harness

ROUNDS = 5
FLOOR = "the floor's own Python (rows, receipt, parameters)"


def measure(calls: int, url: str) -> dict[str, float]:
    """Median microseconds per create of each piece, and of the floor's Python.

    ``url``: a migrated PostgreSQL database; nothing is written to it."""
    import logging

    from outbox import Outbox, db, metrics, schema, settings
    from outbox.creating import create, digest

    took: dict[str, list[float]] = {}

    def timed(name: str, piece: Callable[[Any], object], items: Sequence[Any]) -> None:
        # As timeit does: the collector off, so that a piece which keeps what it made
        # (for the next piece) is not charged for collecting everyone's garbage.
        gc.disable()
        try:
            began = time.perf_counter()
            for item in items:
                piece(item)
            took.setdefault(name, []).append((time.perf_counter() - began) / len(items) * 1e6)
        finally:
            gc.enable()

    box = Outbox(url, config=settings.load())
    try:
        engine, registry = box.engine, box.tools
        tool = registry.get(create_path.TOOL)
        logger = logging.getLogger("outbox.service")
        arguments = [create_path.arguments(0, i) for i in range(calls)]
        keys = [f"pieces-{i}" for i in range(calls)]
        now = datetime.now(UTC)
        retention, deadline = box.settings.retention, box.settings.effect_deadline
        free = create._IDS._free.setdefault(engine, {}).setdefault(schema.tasks.fullname, deque())

        def frame(i: int) -> None:
            create.validate_operation_id(keys[i])
            registry.get(create_path.TOOL)
            box.clock()
            label = create_path.TOOL if create_path.TOOL in registry else "unknown"
            context = {"tenant": harness.TENANT, "operation_id": keys[i]}
            create._REPLAYS.look_first()
            create._REPLAYS.note(False)
            result = create.ExecuteResult(harness.TENANT, keys[i], True, 201, "{}")
            outcome = "created" if result.created else "replayed"
            metrics.OPERATIONS.labels(label, outcome).inc()
            logger.info("operation %s", outcome, extra={**context, "outcome": outcome})

        def connection(_: int) -> None:
            with db._direct(engine) as conn:
                driver: Any = conn.connection.dbapi_connection
                driver.autocommit = True
                driver.autocommit = False

        def floors_python(i: int) -> None:
            task, record, effect = floor._create_rows(0, i)
            columns = tuple(k for k in effect if k not in ("tenant", "operation_id"))
            task["id"] = i
            floor._receipt(record, i)
            create._pg_statement(record, [(schema.tasks, task)], [{k: effect[k] for k in columns}])

        for _ in range(ROUNDS):
            free.extend(range(1, calls + 1))  # the ids a block draw would give
            timed("call frame (id, tool, clock, counter, log, result)", frame, range(calls))
            validated = [tool.validate(a) for a in arguments]
            timed("arguments validated (the tool's model)", tool.validate, arguments)
            timed(
                "arguments dumped for the digest",
                lambda v: v.model_dump(mode="json"),
                validated,
            )
            dumped = [v.model_dump(mode="json") for v in validated]
            timed(
                "digest (canonical JSON, SHA-256)",
                lambda d: digest.args_digest(tool.name, tool.payload_version, d),
                dumped,
            )
            requests = [
                create._Request(tool, v, harness.TENANT, k, "0" * 64, now, retention, deadline)
                for v, k in zip(validated, keys, strict=True)
            ]
            ran: list[tuple[Any, Any]] = []

            def handler(request: Any, out: list[tuple[Any, Any]] = ran) -> None:
                writer = create._Collected(engine, None)
                out.append((writer, create._run_handler(writer, request)))

            timed("handler (its context, the task row and its id)", handler, requests)
            built: list[Any] = []
            timed(
                "receipt, record and outbox row values",
                lambda p, out=built: out.append(
                    create._record_and_effects(p[0], p[1][1], "postgresql")
                ),
                list(zip(requests, ran, strict=True)),
            )
            timed(
                "statement parameters",
                lambda p: create._pg_statement(p[1][1], p[0][0].rows, p[1][2]),
                list(zip(ran, built, strict=True)),
            )
            timed("pooled connection out and back, autocommit on and off", connection, range(calls))
            timed(FLOOR, floors_python, range(calls))
    finally:
        create._IDS.clear()
        box.close()
    return {name: statistics.median(values) for name, values in took.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5_000)
    harness.add_pg_argument(parser)
    options = parser.parse_args(argv)
    pieces = harness.on_scratch_postgres(options.pg, lambda url: measure(options.calls, url))
    print("\n".join(table(pieces)))
    return 0


def table(pieces: dict[str, float]) -> list[str]:
    """The pieces, their sum, the floor's Python and the difference, one line each."""
    pieces = dict(pieces)
    floors = pieces.pop(FLOOR)
    ours = sum(pieces.values())
    rows = [
        *pieces.items(),
        ("sum: our Python before the driver", ours),
        (FLOOR, floors),
        ("what ours adds over the floor", ours - floors),
    ]
    width = max(len(name) for name, _ in rows)
    return [f"{name:<{width}}  {micros:6.2f} µs" for name, micros in rows]


if __name__ == "__main__":
    raise SystemExit(main())
