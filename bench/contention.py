"""Where a four-client create's extra CPU goes: more work, or the same work costing more.

``python -m bench.contention [--seconds S] [--reps N]`` (``make bench-contention``,
about two minutes): Outbox's create and the raw baseline's (case 1 of ``make
bench``), each with 1 and then 4 client processes, on fresh PostgreSQL clones.

Two passes:

- **calls**: every client counts the Python and C function calls of its timed
  creates (``sys.setprofile``). Equal counts at 1 and 4 clients mean the same
  code path: no retries, no polling loops, no extra round trips under load.
- **time** (``--reps`` interleaved repetitions): every client runs a fixed,
  pure-Python canary after every ``EVERY``-th create and times it with its own
  thread's CPU clock. The canary is the same work at 1 and at 4 clients, so its
  growth is what sharing the host costs a fixed piece of Python; a create's CPU
  (the canary's taken out) growing far more than the canary's says the create's
  own work costs more under load, not that there is more of it.

Prints one JSON line per measurement, then, per system, the medians and the
4-client / 1-client ratios.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from bench.perf import create_path, harness

EVERY = 8
CLIENTS = (1, 4)
MAX_OPS = 200_000


def canary() -> int:
    """A fixed piece of pure Python: the same instructions on every call."""
    total = 0
    for j in range(40):
        row = {"subject": f"s{j}", "body": "x" * 50, "n": j, "items": [j, j + 1, j + 2]}
        total += len(hashlib.sha256(json.dumps(row, sort_keys=True).encode()).hexdigest())
    return total


class _Calls:
    """A ``sys.setprofile`` hook counting function calls (Python and C)."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        # Turning the hook off is itself a C call; it is the probe's, not the operation's.
        if event == "call" or (event == "c_call" and arg is not sys.setprofile):
            self.count += 1


def _loop(
    one: Callable[[int], object], start_at: float, end_at: float, count_calls: bool
) -> dict[str, Any]:
    for i in range(create_path.WARMUP_OPS):
        one(-1 - i)
        canary()
    harness.wait_until(start_at)
    calls = _Calls()
    hook = calls if count_calls else None
    canary_ns = canaries = ops = 0
    begun = harness.begin()
    while ops < MAX_OPS and time.monotonic() < end_at:
        # The hook sees the operation alone: not the loop, not the canary.
        sys.setprofile(hook)
        one(ops)
        sys.setprofile(None)
        ops += 1
        if ops % EVERY == 0:
            started = time.thread_time_ns()
            canary()
            canary_ns += time.thread_time_ns() - started
            canaries += 1
    report = harness.span(ops, begun)
    report.update(canary_ns=canary_ns, canaries=canaries, calls=calls.count)
    return report


def outbox_client(
    *, client: int, start_at: float, end_at: float, url: str, count_calls: bool
) -> dict[str, Any]:
    from outbox import Outbox, settings

    box = Outbox(url, config=settings.load())
    run = f"{start_at:.6f}"

    def one(i: int) -> None:
        key = f"contention-{run}-{client}-{i}"
        box.execute(harness.TENANT, key, create_path.TOOL, create_path.arguments(client, i))

    try:
        return _loop(one, start_at, end_at, count_calls)
    finally:
        box.close()


def raw_client(
    *, client: int, start_at: float, end_at: float, url: str, count_calls: bool
) -> dict[str, Any]:
    return create_path.raw_postgres_loop(
        lambda one: _loop(one, start_at, end_at, count_calls), client=client, url=url
    )


SYSTEMS: dict[str, Callable[..., dict[str, Any]]] = {"outbox": outbox_client, "raw": raw_client}


def measure(reports: list[dict[str, Any]]) -> dict[str, float]:
    """One measurement's figures, summed over its clients."""
    ops = sum(r["ops"] for r in reports)
    canary_us = sum(r["canary_ns"] for r in reports) / 1e3
    canaries = sum(r["canaries"] for r in reports)
    cpu_us = sum(r["cpu_s"] for r in reports) * 1e6 - canary_us
    span = max(r["ended"] for r in reports) - min(r["started"] for r in reports)
    return {
        "ops_per_s": ops / span,
        "cpu_us_per_op": cpu_us / ops,
        "canary_us": canary_us / canaries,
        "preempted_per_op": sum(r["preempted"] for r in reports) / ops,
        "calls_per_op": sum(r["calls"] for r in reports) / ops,
    }


def _of(rows: list[dict[str, Any]], kind: str, system: str, clients: int) -> list[dict[str, Any]]:
    return [r for r in rows if (r["pass"], r["system"], r["clients"]) == (kind, system, clients)]


def summarise(rows: list[dict[str, Any]]) -> list[str]:
    """Per system: medians of the time pass at 1 and 4 clients, their ratio, the calls."""
    lines = ["system   clients  creates/s  CPU us/create  canary us  preempted/op  calls/create"]
    for system in SYSTEMS:
        medians: dict[int, dict[str, float]] = {}
        for clients in CLIENTS:
            timed = _of(rows, "time", system, clients)
            counted = _of(rows, "calls", system, clients)
            if not timed or not counted:
                continue
            m = {
                k: statistics.median(r[k] for r in timed)
                for k in ("ops_per_s", "cpu_us_per_op", "canary_us", "preempted_per_op")
            }
            m["calls_per_op"] = statistics.median(r["calls_per_op"] for r in counted)
            medians[clients] = m
            lines.append(
                f"{system:8} {clients:7}  {m['ops_per_s']:9,.0f}  {m['cpu_us_per_op']:13.1f}"
                f"  {m['canary_us']:9.1f}  {m['preempted_per_op']:12.2f}"
                f"  {m['calls_per_op']:12.1f}"
            )
        if len(medians) == len(CLIENTS):
            one, four = medians[CLIENTS[0]], medians[CLIENTS[-1]]
            lines.append(
                f"{system:8} 4 vs 1:  create CPU {four['cpu_us_per_op'] / one['cpu_us_per_op']:.2f}x,"
                f" canary {four['canary_us'] / one['canary_us']:.2f}x,"
                f" calls {four['calls_per_op'] / one['calls_per_op']:.2f}x"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--reps", type=int, default=3)
    options = parser.parse_args(argv)
    scratch = harness.Scratch(
        os.environ.get("OUTBOX_TEST_POSTGRES_URL") or harness.PG_ADMIN_URL_DEFAULT
    )
    pool = harness.Clients(max(CLIENTS))
    rows: list[dict[str, Any]] = []
    try:
        plan = [("calls", 0)] + [("time", rep) for rep in range(options.reps)]
        for kind, rep in plan:
            for system in harness.rotated(list(SYSTEMS), rep):
                for clients in harness.rotated(list(CLIENTS), rep):
                    url = scratch.fresh("postgres")
                    try:
                        reports = pool.run(
                            SYSTEMS[system],
                            clients,
                            options.seconds,
                            url=url,
                            count_calls=kind == "calls",
                        )
                    finally:
                        scratch.drop(url)
                    row = {"pass": kind, "rep": rep, "system": system, "clients": clients}
                    row.update(measure(reports))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        pool.close()
        scratch.close()
    print("\n".join(summarise(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
