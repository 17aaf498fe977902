"""``python -m bench.perf [--quick] [--cases 1,3] [--db sqlite,postgres] [--reps N]``.

Runs the cases of docs/performance.md, prints one JSON line per measurement,
then a table of medians with each ratio to its same-run baseline and whether
the target is met, and writes ``bench/results/latest.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.perf import harness, report

RESULTS = Path(__file__).resolve().parent.parent / "results" / "latest.json"
# A quick run checks for a regression; it must not replace the full run on record.
QUICK_RESULTS = RESULTS.with_name("quick.json")
ALL_CASES = (1, 2, 3, 4, 5, 6)
QUICK_CASES = (1, 3, 4)
# Hard stops: the whole run, by mode. A case that would start past its share is skipped.
BUDGET_S = {"full": 810.0, "quick": 240.0}
# Roughly what each case takes in a full run (seconds), to skip rather than overrun.
BUDGET_SHARE_S = {1: 170, 2: 0, 3: 300, 4: 120, 5: 70, 6: 100}


@dataclass
class Context:
    """What every case gets: where to write, what to run, and how big."""

    scratch: harness.Scratch
    clients: harness.Clients
    out: harness.Recorder
    backends: list[str]
    reps: int
    quick: bool
    full_size: bool
    deadline: float
    create_clients: tuple[int, ...] = (1, 4)
    create_seconds: float = 2.0
    backlog: int = 50_000
    latency_rate: float = 200.0
    latency_seconds: float = 4.0
    http_concurrency: tuple[int, ...] = (1, 8, 32)
    http_effects: int = 10_000
    scale_effects: int = 5_000
    scale_finished: int = 100_000
    rss_effects: int = 30_000
    cases: tuple[int, ...] = ALL_CASES
    skipped: list[str] = field(default_factory=list)

    def left(self) -> float:
        return self.deadline - time.monotonic()


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.perf", description=__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="cases 1, 3, 4 at a small size (<4 min)"
    )
    parser.add_argument("--cases", help="comma-separated case numbers (default: all, or 1,3,4)")
    parser.add_argument("--db", default="sqlite,postgres", help="sqlite,postgres")
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions (>=3)")
    parser.add_argument(
        "--full-size",
        action="store_true",
        help="the issue's full sizes (100,000-effect backlog, 10 s latency runs, 1,000,000 "
        "finished rows, 1,000,000-effect RSS drain); takes far longer than 10 minutes",
    )
    harness.add_pg_argument(parser, "--pg-url")
    parser.add_argument(
        "--out",
        type=Path,
        help="where to write the results (default: bench/results/latest.json, "
        "or bench/results/quick.json with --quick)",
    )
    return parser.parse_args()


def machine() -> dict[str, Any]:
    model = ""
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem_kib = 0
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    return {
        "cpu": model,
        "nproc": os.cpu_count(),
        "mem_gib": round(mem_kib / 1024 / 1024, 1),
        "python": platform.python_version(),
        "sqlite": __import__("sqlite3").sqlite_version,
        "kernel": platform.release(),
    }


def _git_head() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
            timeout=10,
        ).stdout.strip()
    except OSError:
        return ""


def _runner(number: int) -> Any:
    """Each case's module is imported only when it runs (peers are a bench extra)."""
    if number in (1, 2):
        from bench.perf import create_path

        return create_path.run
    if number == 3:
        from bench.perf import dispatch

        return dispatch.run
    if number == 4:
        from bench.perf import latency

        return latency.run
    if number == 5:
        from bench.perf import delivery

        return delivery.run
    from bench.perf import scale

    return scale.run


def main() -> int:
    args = _parse()
    quick = args.quick
    cases = (
        tuple(int(c) for c in args.cases.split(",") if c.strip())
        if args.cases
        else (QUICK_CASES if quick else ALL_CASES)
    )
    backends = [b.strip() for b in args.db.split(",") if b.strip()]
    reps = max(1, args.reps)
    started = time.monotonic()
    scratch = harness.Scratch(pg_admin_url=args.pg_url)
    clients = harness.Clients(size=8)  # dispatch scales to 8 processes
    ctx = Context(
        scratch=scratch,
        clients=clients,
        out=harness.Recorder(),
        backends=backends,
        reps=reps,
        quick=quick,
        full_size=args.full_size,
        deadline=started + BUDGET_S["quick" if quick else "full"],
        cases=cases,
    )
    if quick:
        ctx.create_clients = (1, 4)
        ctx.create_seconds = 0.8
        ctx.backlog = 10_000
        ctx.latency_seconds = 2.0
        ctx.http_concurrency = (1, 32)
        ctx.scale_effects = 5_000
        ctx.scale_finished = 100_000
        ctx.rss_effects = 20_000
    if args.full_size:
        ctx.backlog = 100_000
        ctx.latency_seconds = 10.0
        ctx.scale_effects = 10_000
        ctx.scale_finished = 1_000_000
        ctx.rss_effects = 1_000_000
        ctx.deadline = started + 3600
    pg_version = ""
    try:
        if "postgres" in backends:
            pg_version = harness.postgres_version(args.pg_url)
        for number in ALL_CASES:
            if number not in cases or (number == 2 and 1 in cases):
                continue  # case 1 measures the replays of the keys it created
            share = BUDGET_SHARE_S[number] * (0.3 if quick else 1.0)
            if ctx.left() < share * 0.5:
                ctx.skipped.append(f"case {number}: skipped, the run's time budget is spent")
                ctx.out.note(ctx.skipped[-1])
                continue
            ctx.out.note(f"case {number} ({ctx.left():.0f}s left)")
            _runner(number)(ctx)
    finally:
        clients.close()
        scratch.close()
    elapsed = time.monotonic() - started
    table = report.build(ctx.out.rows)
    print()
    print(report.render(table))
    cores = os.cpu_count() or 1
    cpu = report.cpu_table(ctx.out.rows, cores)
    if cpu:
        print("\nCPU per operation (clients and database server), and the ceiling it sets:\n")
        print(report.render_cpu(cpu))
    for line in ctx.skipped:
        print(line)
    document = {
        "command": "python -m bench.perf " + " ".join(sys.argv[1:]),
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "git": _git_head(),
        "seconds": round(elapsed, 1),
        "reps": reps,
        "quick": quick,
        "machine": {**machine(), "postgres": pg_version},
        "skipped": ctx.skipped,
        "table": table,
        "cpu": cpu,
        "measurements": ctx.out.rows,
    }
    out: Path = args.out or (QUICK_RESULTS if quick else RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=1) + "\n")
    print(f"\n{len(ctx.out.rows)} measurements in {elapsed:.0f}s; written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
