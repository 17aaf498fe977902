"""Case 6: dispatch with a large finished history, and a dispatcher's memory over a long drain.

Throughput: the same 10,000 fresh effects dispatched by one process from a
database holding 1,000,000 finished effects (each with its operation record and
attempt row) and from an empty one, interleaved. The hot queries use partial
indexes on live rows, so the history should not matter.

Memory: one dispatcher process drains a backlog and samples its own RSS; the
figure is the growth from the first tenth of the drain to the end.
"""

from __future__ import annotations

import time
from typing import Any

from bench.perf import backlog, dispatch, harness

DRAIN_LIMIT_S = 60.0
# The size; the default run uses less to fit in 10 minutes.
FULL_HISTORY = 1_000_000


def drain_all(*, client: int, start_at: float, end_at: float, url: str) -> dict[str, Any]:
    return dispatch.outbox_drain(client=client, start_at=start_at, end_at=end_at, url=url)


def rss_drain(
    *, client: int, start_at: float, end_at: float, url: str, total: int
) -> dict[str, Any]:
    d = dispatch.dispatcher(url)
    samples: list[tuple[int, int]] = []
    try:
        harness.wait_until(start_at)
        started = time.monotonic()
        done = 0
        next_sample = 0
        while time.monotonic() < end_at:
            handled = d.run_once()
            if handled == 0:
                break
            done += handled
            if done >= next_sample:
                samples.append((done, harness.rss_kib()))
                next_sample += max(1, total // 50)
        samples.append((done, harness.rss_kib()))
        return {"ops": done, "started": started, "ended": time.monotonic(), "samples": samples}
    finally:
        d.close()
        d.adapters.close()
        d.engine.dispose()


def run(ctx: Any) -> None:
    histories: dict[tuple[str, int], str] = {}
    try:
        for backend in ctx.backends:
            for finished in (0, ctx.scale_finished):
                url = ctx.scratch.fresh(backend)
                histories[(backend, finished)] = url
                if finished:
                    started = time.monotonic()
                    backlog.fill(url, finished, finished=True)
                    ctx.out.note(
                        f"{backend}: {finished:,} finished rows in {time.monotonic() - started:.0f}s"
                    )
        for rep in range(ctx.reps):
            for backend in ctx.backends:
                for finished in harness.rotated([0, ctx.scale_finished], rep):
                    url = histories[(backend, finished)]
                    backlog.fill(url, ctx.scale_effects)
                    (report,) = ctx.clients.run(drain_all, 1, DRAIN_LIMIT_S, url=url)
                    done, span = harness.throughput([report])
                    ctx.out.emit(
                        case="scale",
                        system="outbox",
                        db=backend,
                        finished=finished,
                        rep=rep,
                        effects=done,
                        seconds=span,
                        effects_per_s=done / span,
                        note="" if finished in (0, FULL_HISTORY) else "scaled down; --full-size",
                    )
    finally:
        for url in histories.values():
            ctx.scratch.drop(url)
    for backend in ctx.backends[-1:] if not ctx.full_size else ctx.backends:
        _rss(ctx, backend)


def _rss(ctx: Any, backend: str) -> None:
    url = ctx.scratch.fresh(backend)
    try:
        backlog.fill(url, ctx.rss_effects)
        limit = 3600.0 if ctx.full_size else DRAIN_LIMIT_S * 2
        (report,) = ctx.clients.run(rss_drain, 1, limit, url=url, total=ctx.rss_effects)
    finally:
        ctx.scratch.drop(url)
    samples = report["samples"]
    early = next((kib for done, kib in samples if done >= ctx.rss_effects // 10), samples[0][1])
    end = samples[-1][1]
    ctx.out.emit(
        case="rss",
        system="outbox",
        db=backend,
        rep=0,
        effects=report["ops"],
        rss_early_mib=early / 1024,
        rss_end_mib=end / 1024,
        growth_pct=(end - early) / early * 100,
        note=f"{report['ops']:,}-effect drain" + ("" if ctx.full_size else "; --full-size: 1M"),
    )
