"""A dispatcher's memory over a long drain, at the issue's size: a million effects.

``python -m bench.perf.rss [--effects 1000000] [--db postgres] [--limit 1500]``
(``make bench-rss``)

``make bench`` measures a dispatcher's memory over a 30,000-effect drain, which
a small leak a delivery would pass unseen. This drains the full backlog the way
``outbox dispatcher --once`` does (``Dispatcher.run(once=True)``, the no-op
adapter) in a process of its own, while a thread in it reads the process's RSS
and the deliveries counted so far (the ``outbox_deliveries_total`` counter) once a
second. Growth is the RSS at the end against the RSS once a tenth of the effects
are delivered, when start-up and the first passes' caches are behind it. The
target is at most 10%.

Bounded: the drain stops at ``--limit`` seconds (SIGTERM's way: the pass in progress
is recorded first) and the run says how far it got. Exit status 0 when the
backlog was drained within the target, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from typing import Any

from bench.perf import backlog, dispatch, harness

TARGET_PCT = 10.0
SAMPLE_S = 1.0


def drain(*, client: int, start_at: float, end_at: float, url: str) -> dict[str, Any]:
    """One dispatcher's ``run(once=True)`` over the backlog, sampled once a second."""
    from outbox import metrics

    def delivered() -> int:
        return int(
            sum(
                sample.value
                for family in metrics.DELIVERIES.collect()
                for sample in family.samples
                if sample.name.endswith("_total")
            )
        )

    samples: list[tuple[float, int, int]] = []
    stop = threading.Event()

    def sample() -> None:
        while True:
            samples.append((time.monotonic(), delivered(), harness.rss_kib()))
            if stop.wait(SAMPLE_S):
                return

    d = dispatch.dispatcher(url)
    sampler = threading.Thread(target=sample, name="rss-sampler", daemon=True)
    try:
        harness.wait_until(start_at)
        started = time.monotonic()
        sampler.start()
        timer = threading.Timer(max(0.0, end_at - started), d.request_stop)
        timer.start()
        try:
            done = d.run(once=True)
        finally:
            timer.cancel()
        ended = time.monotonic()
    finally:
        stop.set()
        if sampler.ident is not None:  # started
            sampler.join(10)
        d.close()
        d.adapters.close()
        d.engine.dispose()
    samples.append((ended, delivered(), harness.rss_kib()))
    return {"ops": done, "started": started, "ended": ended, "samples": samples}


def growth(samples: list[tuple[float, int, int]], total: int) -> tuple[int, int, float]:
    """(RSS once a tenth is delivered, RSS at the end, growth in %), in KiB."""
    early = next((kib for _, done, kib in samples if done >= total // 10), samples[0][2])
    end = samples[-1][2]
    return early, end, (end - early) / early * 100


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--effects", type=int, default=1_000_000)
    parser.add_argument("--db", choices=["postgres", "sqlite"], default="postgres")
    parser.add_argument("--limit", type=float, default=1500.0, help="seconds the drain may take")
    harness.add_pg_argument(parser)
    options = parser.parse_args(argv)
    scratch = harness.Scratch(options.pg)
    clients = harness.Clients(1)
    try:
        url = scratch.fresh(options.db)
        began = time.monotonic()
        backlog.fill(url, options.effects)
        print(f"{options.effects:,} effects due, made in {time.monotonic() - began:.0f} s")
        (report,) = clients.run(drain, 1, options.limit, url=url)
    finally:
        clients.close()
        scratch.close()
    samples, done = report["samples"], report["ops"]
    seconds = report["ended"] - report["started"]
    early, end, pct = growth(samples, options.effects)
    start = samples[0][0]
    print("delivered   seconds   RSS MiB")
    step = max(1, options.effects // 10)
    mark = 0
    for at, count, kib in samples:
        if count >= mark or (at, count, kib) == samples[-1]:
            print(f"{count:>9,}   {at - start:7.1f}   {kib / 1024:7.1f}")
            mark = (count // step + 1) * step
    drained = done >= options.effects
    met = drained and pct <= TARGET_PCT
    print(
        json.dumps(
            {
                "case": "rss",
                "db": options.db,
                "effects": options.effects,
                "delivered": done,
                "seconds": round(seconds, 1),
                "effects_per_s": round(done / seconds) if seconds else None,
                "rss_early_mib": round(early / 1024, 1),
                "rss_end_mib": round(end / 1024, 1),
                "rss_max_mib": round(max(kib for _, _, kib in samples) / 1024, 1),
                "growth_pct": round(pct, 2),
            }
        )
    )
    verdict = "PASS" if met else "MISS"
    tail = "" if drained else f" (drained {done:,} of {options.effects:,} in {options.limit:.0f} s)"
    print(
        f"dispatcher RSS over {done:,} effects: {pct:+.1f}% "
        f"({early / 1024:.1f} -> {end / 1024:.1f} MiB), target <= {TARGET_PCT:.0f}%: {verdict}{tail}"
    )
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
