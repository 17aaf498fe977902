"""A slow provider beside a fast one: are the fast adapter's deliveries held up?

One dispatcher (``run()``, concurrency 8) serves two adapters. The ``slow``
provider takes ``--slow-seconds`` per request (inside any timeout) and has a
backlog of ``--slow-backlog`` effects from the start; the ``fast`` one answers
in 5 ms, and its effects are created at ``--rate`` per second for
``--seconds``. The figure is the fast effects' latency, created to delivered,
measured three times in one run:

- ``alone``: no slow backlog (the baseline);
- ``slow, on``: with the slow backlog, as shipped (``OUTBOX_SLOW_SEND_AFTER=2s``);
- ``slow, off``: with the slow backlog and ``OUTBOX_SLOW_SEND_AFTER=0``: a pass
  waits for its slowest delivery, as before.

It passes when, with the slow backlog, every fast effect is delivered and the
fast p99 stays within ``OUTBOX_SLOW_SEND_AFTER`` + 1 s (the time the loop gives
a pass before it stops waiting for slow sends), whatever the slow provider's
latency. Bounded: each run stops after ``--limit`` seconds.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa

import adapters
from adapters import DeliveryRequest, DeliveryResult
from outbox import Outbox, db, schema, settings, tools
from outbox.app import App
from outbox.delivery.dispatcher import Dispatcher

CAPS = adapters.Capabilities(True, True, 1.0)


class Sleepy:
    """An adapter that answers after ``seconds``, always delivered."""

    capabilities = CAPS

    def __init__(self, name: str, seconds: float) -> None:
        self.name = name
        self.seconds = seconds
        self.stop = threading.Event()

    def deliver(self, request: DeliveryRequest) -> DeliveryResult:
        self.stop.wait(self.seconds)
        return DeliveryResult.delivered(f"{self.name}-{request.effect_key}", status_code=201)

    def lookup(self, effect_key: str, client_reference: str | None = None) -> adapters.Lookup:
        raise NotImplementedError

    def close(self) -> None:
        self.stop.set()


def _tool(name: str, adapter: str) -> tools.Tool:
    def handle(ctx: tools.ToolContext, args: tools.SupportTaskArgs) -> tools.ToolOutput:
        effect = tools.EffectSpec(
            effect="ping",
            adapter=adapter,
            payload={"subject": args.subject, "body": "", "priority": "low"},
        )
        return tools.ToolOutput(receipt={"status": "queued"}, effects=[effect])

    return tools.Tool(name, 1, tools.SupportTaskArgs, handle, adapters=(adapter,))


def run_case(label: str, options: argparse.Namespace, *, backlog: int, slow_after: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'slow.db'}"
        app = App("bench_slow", tools=[_tool("fast", "fast"), _tool("slow", "slow")])
        fast, slow = Sleepy("fast", 0.005), Sleepy("slow", options.slow_seconds)
        config = settings.load(
            concurrency=8,
            slow_send_after=slow_after,
            poll_interval=0.05,
            shutdown_grace=0,
            lease_duration=max(60, options.slow_seconds * 4),
            lease_renew_interval=20,
        )
        engine = db.create_engine(settings.load(), url=url)
        db.upgrade(engine)
        engine.dispose()
        with Outbox(url, app=app) as box:
            box.create_tenant("t")
            for i in range(backlog):
                box.execute("t", f"slow-{i}", "slow", {"subject": f"s{i}"})
            dispatcher = Dispatcher(box.engine, adapters.Registry([fast, slow]), config)
            thread = threading.Thread(target=dispatcher.run, daemon=True)
            thread.start()
            total = int(options.rate * options.seconds)
            began = time.monotonic()
            for i in range(total):
                due = began + i / options.rate
                pause = due - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
                box.execute("t", f"fast-{i}", "fast", {"subject": f"f{i}"})
                dispatcher.wake()
            outbox = schema.outbox
            query = sa.select(outbox.c.created_at, outbox.c.finished_at).where(
                outbox.c.adapter == "fast"
            )
            deadline = began + options.limit
            rows: list[Any] = []
            while time.monotonic() < deadline:
                with db.read(box.engine) as conn:
                    rows = list(conn.execute(query))
                if all(r.finished_at is not None for r in rows):
                    break
                time.sleep(0.1)
            dispatcher.request_stop()
            slow.close()
            fast.close()
            thread.join(30)
            dispatcher.close()
    done = [r for r in rows if r.finished_at is not None]
    latencies = sorted((r.finished_at - r.created_at).total_seconds() * 1000 for r in done)
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] if latencies else None
    return {
        "label": label,
        "created": total,
        "delivered": len(done),
        "p50_ms": statistics.median(latencies) if latencies else None,
        "p99_ms": p99,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slow-seconds", type=float, default=5.0)
    parser.add_argument("--slow-backlog", type=int, default=40)
    parser.add_argument("--rate", type=float, default=50.0, help="fast creates per second")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long fast creates go on")
    parser.add_argument("--limit", type=float, default=60.0, help="each run's bound, seconds")
    options = parser.parse_args(argv)
    # "skipped: maximum number of running instances reached" while a pass runs: not news.
    logging.getLogger("apscheduler").setLevel(logging.ERROR)
    slow_after = settings.load().slow_send_after.total_seconds()
    alone = run_case("alone", options, backlog=0, slow_after=slow_after)
    on = run_case("slow, on", options, backlog=options.slow_backlog, slow_after=slow_after)
    off = run_case("slow, off", options, backlog=options.slow_backlog, slow_after=0)
    print(
        f"slow provider: {options.slow_backlog} effects at {options.slow_seconds:g} s each; "
        f"fast: {alone['created']} effects at {options.rate:g}/s, 5 ms each"
    )
    for case in (alone, on, off):
        ratio = ""
        if case is not alone and case["p99_ms"] is not None and alone["p99_ms"]:
            ratio = f"  p99 {case['p99_ms'] / alone['p99_ms']:.1f}x alone"
        p50 = "-" if case["p50_ms"] is None else f"{case['p50_ms']:.0f}"
        p99 = "-" if case["p99_ms"] is None else f"{case['p99_ms']:.0f}"
        print(
            f"  {case['label']:<10} delivered={case['delivered']}/{case['created']} "
            f"p50={p50} ms p99={p99} ms{ratio}"
        )
    bound_ms = (slow_after + 1.0) * 1000
    ok = on["delivered"] == on["created"] and (on["p99_ms"] or 1e12) <= bound_ms
    print(
        f"  target: with the slow backlog, every fast effect delivered and p99 <= "
        f"{bound_ms:.0f} ms (slow_send_after + 1 s): {'PASS' if ok else 'MISS'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
