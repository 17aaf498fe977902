"""How long a burst of lost replies takes to drain once the provider answers again.

The fake provider honours idempotency keys and loses the reply of the first
``--lost`` requests (the ticket is committed, the connection is aborted). A
dispatcher with the default settings then resends each with its own key. The
figure is the time from the last lost reply to the last effect succeeded,
measured twice in one run: with the retry budget as shipped (answered retries
give their token back) and, as the baseline, with that refund switched off
(the budget refills only as its window slides). Both runs also count the
provider's tickets against the effects: a second ticket for one key is a
duplicate.

Bounded: each run stops after ``--limit`` seconds whatever happened.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import sqlalchemy as sa

import adapters
from adapters import helpdesk
from fake_provider import DropMode, Mode, ProviderConfig, create_app
from fake_provider.faults import FaultSpec
from outbox import Outbox, db, schema, settings
from outbox.delivery import retry
from outbox.delivery.dispatcher import Dispatcher
from tests.support.servers import serve_in_thread

TARGET_S = 30.0


@dataclass(frozen=True)
class Drain:
    label: str
    lost: int
    drained_s: float | None  # None: not drained within the limit
    tickets: int
    duplicates: int
    attempts: int

    def line(self) -> str:
        took = "not drained" if self.drained_s is None else f"{self.drained_s:.1f}s"
        return (
            f"{self.label:<9} lost={self.lost} drained_in={took} tickets={self.tickets} "
            f"duplicates={self.duplicates} attempts={self.attempts}"
        )


@contextmanager
def _provider(lost: int) -> Iterator[tuple[Any, str]]:
    app = create_app(ProviderConfig(seed=0, mode=Mode.HONOUR, drop_mode=DropMode.ABORT))
    app.state.faults.replace(FaultSpec.from_json({"script": ["drop_after_commit"] * lost}))
    try:
        with serve_in_thread(app) as base_url:
            yield app, base_url
    finally:
        app.state.ledger.close()


def run(label: str, lost: int, limit_s: float, workdir: Path) -> Drain:
    url = f"sqlite:///{workdir / f'{label}.db'}"
    config = settings.load(database_url=url)
    engine = db.create_engine(config, url=url)
    db.upgrade(engine)
    with _provider(lost) as (app, base_url), Outbox(url, config=config) as box:
        box.create_tenant("bench")
        for i in range(lost):
            box.execute("bench", f"drain-{i}", "create_support_task", {"subject": f"s{i}"})
        registry = adapters.Registry([helpdesk.helpdesk_adapter(base_url)])
        dispatcher = Dispatcher(engine, registry, config, worker_id=label)
        out = schema.outbox
        cleared_at: float | None = None
        drained_s: float | None = None
        started = time.monotonic()
        try:
            while time.monotonic() - started < limit_s:
                dispatcher.run_once()
                if cleared_at is None and app.state.ledger.stats()["tickets"] >= lost:
                    cleared_at = time.monotonic()  # every lost reply has happened
                with db.read(engine) as conn:
                    done = conn.execute(
                        sa.select(sa.func.count()).where(out.c.status == "succeeded")
                    ).scalar_one()
                if done == lost:
                    drained_s = time.monotonic() - (cleared_at or started)
                    break
                time.sleep(0.05)
        finally:
            dispatcher.close()
            registry.close()
        with db.read(engine) as conn:
            attempts = conn.execute(
                sa.select(sa.func.count()).select_from(schema.attempts)
            ).scalar_one()
        keys = [t.idempotency_key for t in app.state.ledger.tickets()]
    engine.dispose()
    return Drain(label, lost, drained_s, len(keys), len(keys) - len(set(keys)), attempts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.drain", description=__doc__)
    parser.add_argument("--lost", type=int, default=70, help="replies lost in the burst")
    parser.add_argument("--limit", type=float, default=90.0, help="seconds per run at most")
    parser.add_argument("--no-baseline", action="store_true", help="skip the refund-off run")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        ours = run("refund", args.lost, args.limit, Path(tmp))
        print(ours.line(), flush=True)
        base = None
        if not args.no_baseline:
            with mock.patch.object(retry.RetryBudget, "record_answered_retry", lambda *a: None):
                base = run("no-refund", args.lost, args.limit, Path(tmp))
            print(base.line(), flush=True)
    ok = ours.drained_s is not None and ours.drained_s <= TARGET_S and ours.duplicates == 0
    summary: dict[str, Any] = {
        "lost": args.lost,
        "drained_s": ours.drained_s,
        "target_s": TARGET_S,
        "duplicates": ours.duplicates,
        "verdict": "PASS" if ok else "MISS",
    }
    if base is not None:
        summary["baseline_drained_s"] = base.drained_s
        if ours.drained_s:
            # A baseline that did not drain counts as the limit: the ratio is then an upper bound.
            summary["ratio_to_baseline_at_most"] = round(
                ours.drained_s / (base.drained_s or args.limit), 3
            )
    print(json.dumps(summary, sort_keys=True))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
