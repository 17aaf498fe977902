"""The hot loops alone, for a sampling profiler: ``make profile`` records each with
py-spy as a flame graph (``docs/images/profile-*.svg``).

``python -m bench.profile dispatch|create [--db postgres|sqlite] [--seconds S]``

- ``dispatch``: ``Dispatcher.run(once=True)`` over a generated backlog
  (no-op adapter), as case 3 of ``make bench`` measures it;
- ``create``: ``Outbox.execute`` of ``create_support_task`` in a loop, one new
  key each, as case 1 measures it.

The database is a fresh clone (PostgreSQL at ``OUTBOX_TEST_POSTGRES_URL`` or
127.0.0.1, else a SQLite file), dropped at the end. Bounded by ``--seconds``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from bench.perf import backlog, create_path, dispatch, harness


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("loop", choices=["dispatch", "create"])
    parser.add_argument("--db", choices=["postgres", "sqlite"], default="postgres")
    parser.add_argument("--seconds", type=float, default=8.0)
    options = parser.parse_args(argv)
    scratch = harness.Scratch(
        os.environ.get("OUTBOX_TEST_POSTGRES_URL") or harness.PG_ADMIN_URL_DEFAULT
    )
    try:
        url = scratch.fresh(options.db)
        if options.loop == "dispatch":
            backlog.fill(url, 400_000)
            done = _dispatch(url, options.seconds)
        else:
            done = _create(url, options.seconds)
    finally:
        scratch.close()
    print(f"{options.loop} on {options.db}: {done} in {options.seconds:g} s", file=sys.stderr)
    return 0


def _dispatch(url: str, seconds: float) -> int:
    now = time.monotonic()
    report = dispatch.outbox_drain(client=0, start_at=now, end_at=now + seconds, url=url)
    return int(report["ops"])


def _create(url: str, seconds: float) -> int:
    now = time.monotonic()
    report = create_path.outbox_client(
        client=0, start_at=now, end_at=now + seconds, url=url, prefix="profile"
    )
    return int(report["ops"])


if __name__ == "__main__":
    sys.exit(main())
