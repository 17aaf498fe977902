"""``python -m bench.chaos``: the chaos run, its figures, and an exit code that means it.

    python -m bench.chaos [--db sqlite|postgres|both] [--operations N] [--kills N]
                          [--max-seconds S] [--seed N] [--dispatchers K]

``--operations``, ``--kills`` and ``--max-seconds`` are per database; each is
shared out over the phases (one per provider mode). ``--max-seconds 0`` bounds
a run by count alone: every call is made, every kill lands, the drain waits. Exit status 0 when every
invariant held on every database, 1 when one failed (the offending rows are
printed), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.chaos import run

PHASE_SHARES = {"honour": 0.4, "ignore_lookup": 0.3, "ignore_nolookup": 0.3}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.chaos",
        description="Crash and fault run with invariant checks, on SQLite and PostgreSQL.",
    )
    p.add_argument("--db", choices=["sqlite", "postgres", "both"], default="both")
    p.add_argument("--operations", type=int, default=5000, help="calls per database")
    p.add_argument("--kills", type=int, default=21, help="kill -9 per database")
    p.add_argument(
        "--max-seconds",
        type=float,
        default=300.0,
        help="time bound per database (seconds); 0: bounded by count alone",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dispatchers", type=int, default=3, choices=[2, 3, 4])
    p.add_argument("--workers", type=int, default=8, help="load generator threads")
    p.add_argument(
        "--phases",
        default=",".join(PHASE_SHARES),
        help="provider modes to run, comma separated (default: all three)",
    )
    p.add_argument(
        "--pg-url",
        default=os.environ.get("OUTBOX_TEST_POSTGRES_URL") or run.PG_ADMIN_URL_DEFAULT,
        help="PostgreSQL server where scratch databases outbox_chaos_* are created",
    )
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    p.add_argument("--keep", action="store_true", help="keep the run directory (logs)")
    return p


def plan_phases(
    names: Sequence[str], operations: int, kills: int, seconds: float
) -> list[tuple[run.Phase, int, int, float | None]]:
    """Each phase with its share of the operations, kills and time."""
    total = sum(PHASE_SHARES[n] for n in names)
    planned = []
    for name in names:
        share = PHASE_SHARES[name] / total
        planned.append(
            (
                run.PHASES[name],
                max(10, round(operations * share)),
                max(1, math.ceil(kills * share)),
                seconds * share if seconds else None,
            )
        )
    return planned


def run_database(
    database: str,
    names: Sequence[str],
    args: argparse.Namespace,
    run_dir: Path,
    log: Any = print,
) -> list[run.PhaseResult]:
    results = []
    for phase, operations, kills, seconds in plan_phases(
        names, args.operations, args.kills, args.max_seconds
    ):
        options = run.PhaseOptions(
            database=database,
            operations=operations,
            kills=kills,
            seconds=seconds,
            seed=args.seed,
            dispatchers=args.dispatchers,
            workers=args.workers,
            run_dir=run_dir,
            pg_admin_url=args.pg_url,
        )
        bound = f"{seconds:.0f}s" if seconds is not None else "no time bound"
        log(f"[{database}] phase {phase.name}: {operations} calls, {kills} kills, {bound}")
        results.append(run.run_phase(phase, options, log=log))
    return results


SUMMED = (
    "operations requested",
    "distinct keys",
    "keys with a valid first call",
    "tasks created",
    "conflicts answered (422 reused)",
    "invalid calls refused (422)",
    "replays answered",
    "first calls whose reply was lost, then replayed",
    "effects",
    "effects succeeded",
    "effects failed",
    "tickets at the provider",
    "duplicate tickets",
    "keys minted for retries",
    "lost operations",
    "effects not settled",
    "deadline breaches",
    "kills (kill -9)",
    "restarts",
    "reconciler SIGTERM restarts",
    "pg backends terminated",
    "provider faults injected",
    "outcome_unknown reached",
    "resolved by lookup",
    "resolved by review",
    "resends authorised by a lookup or an operator",
    "attempts",
    "load seconds",
    "drain seconds",
    "phase seconds",
)


def totals(results: Sequence[run.PhaseResult]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in SUMMED:
        out[name] = round(sum(r.figures.get(name, 0) or 0 for r in results), 1)
        if float(out[name]).is_integer():
            out[name] = int(out[name])
    load_s = sum(r.figures.get("load seconds", 0) for r in results)
    calls = sum(r.figures.get("calls made", 0) for r in results)
    out["throughput: calls per second (load)"] = round(calls / load_s, 1) if load_s else 0.0
    phase_s = sum(r.figures.get("phase seconds", 0) for r in results)
    effects = out["effects"]
    out["throughput: effects settled per second (whole run)"] = (
        round(effects / phase_s, 1) if phase_s else 0.0
    )
    return out


def print_phase(result: run.PhaseResult) -> None:
    print(f"\n== {result.database} / {result.phase}: {'PASS' if result.ok else 'FAIL'}")
    width = max((len(k) for k in result.figures), default=10)
    for key, value in result.figures.items():
        print(f"  {key:<{width}}  {value}")
    if result.error:
        print(f"  ERROR {result.error}")
    for violation in result.violations:
        print("  " + violation.render().replace("\n", "\n  "))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    names = [n.strip() for n in args.phases.split(",") if n.strip()]
    unknown = [n for n in names if n not in run.PHASES]
    if unknown or not names:
        print(f"unknown phase(s) {unknown}; choose from {', '.join(run.PHASES)}", file=sys.stderr)
        return 2
    if args.operations < 10 or args.kills < 0 or 0 < args.max_seconds < 20 or args.max_seconds < 0:
        print("--operations >= 10, --kills >= 0, --max-seconds 0 or >= 20", file=sys.stderr)
        return 2
    databases = ["sqlite", "postgres"] if args.db == "both" else [args.db]
    run_dir = Path(tempfile.mkdtemp(prefix="outbox_chaos_"))
    command = "python -m bench.chaos " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"{command}\nrun directory (logs): {run_dir}", flush=True)
    started = time.monotonic()
    report: dict[str, Any] = {"command": command, "databases": {}}
    ok = True
    try:
        for database in databases:
            results = run_database(
                database, names, args, run_dir, log=lambda m: print(m, flush=True)
            )
            for result in results:
                print_phase(result)
            summary = totals(results)
            passed = all(r.ok for r in results)
            ok = ok and passed
            print(f"\n== {database}: {'PASS' if passed else 'FAIL'} (all phases)")
            for key, value in summary.items():
                print(f"  {key:<52}  {value}")
            report["databases"][database] = {
                "ok": passed,
                "totals": summary,
                "phases": {
                    r.phase: {
                        "ok": r.ok,
                        "figures": r.figures,
                        "error": r.error,
                        "violations": [
                            {"name": v.name, "detail": v.detail, "rows": v.rows[:50]}
                            for v in r.violations
                        ],
                    }
                    for r in results
                },
            }
    finally:
        report["seconds"] = round(time.monotonic() - started, 1)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
        if ok and not args.keep:
            shutil.rmtree(run_dir, ignore_errors=True)
        else:
            print(f"logs kept in {run_dir}")
    print(f"\n{'PASS' if ok else 'FAIL'} in {report['seconds']}s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
