"""The end-to-end story, from real runs on a fresh SQLite file (``make demo``).

1. The lost reply at the tool boundary: the create commits, the reply is lost,
   the caller retries with the same key and gets the same receipt.
2. An honouring provider drops a reply: the dispatcher retries with the same
   key and the provider answers with the ticket it already made.
3. An ignoring provider drops a reply: the effect goes ``outcome_unknown``,
   the reconciler's lookup finds the ticket, succeeded.
4. An ignoring provider without lookup: the item reaches the review queue and
   an operator resolves it from the CLI.
Finally the providers' ledgers: one ticket per effect, and keys minted for
retries: 0.

Every figure printed is read back from the database or the provider's ledger.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

import adapters
from outbox import Outbox, db, errors, logs, schema, settings
from outbox.delivery.dispatcher import Dispatcher
from reconciler import sweeps

TOOL = "create_support_task"


def counts(box: Outbox) -> str:
    with db.read(box.engine) as conn:
        n = {
            name: conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one()
            for name, table in (
                ("tasks", schema.tasks),
                ("operations", schema.operations),
                ("outbox", schema.outbox),
            )
        }
    return f"tasks={n['tasks']} operations={n['operations']} outbox={n['outbox']}"


class ReplyLost(TimeoutError):
    pass


def lost_reply_story(url: str) -> None:
    print("== 1. The reply is lost after the commit ==")
    with Outbox(url) as box:
        box.create_tenant("acme")
        arguments = {"subject": "Check delayed delivery", "body": "Order 1234 is late"}
        try:
            box.execute("acme", "op-lost-reply", TOOL, arguments)
            raise ReplyLost("the caller's read timed out")
        except ReplyLost:
            print("Committed, but response was lost")
        print(f"After timeout: {counts(box)}")
    # The retry arrives on a new connection pool, as from a restarted worker.
    with Outbox(url) as box:
        retry = box.execute("acme", "op-lost-reply", TOOL, arguments)
        print(f"Retry: {retry.receipt_json} (replayed={retry.replayed})")
        print(f"After retry: {counts(box)}")
        try:
            box.execute("acme", "op-lost-reply", TOOL, {**arguments, "subject": "Other"})
        except errors.IdempotencyKeyReused as exc:
            print(f"Conflict: {exc}")
        print(f"After conflict: {counts(box)}")


# --- the effect stories: real fake-provider processes on loopback --------------------

# Short timings so the story takes seconds; the defaults are in docs/configuration.md.
DEMO_SETTINGS = {
    "backoff_initial": "0.2s",
    "backoff_max": "1s",
    "lease_duration": "6s",
    "lease_renew_interval": "2s",
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def provider(work: Path, name: str, *flags: str) -> Iterator[str]:
    """A fake provider as its own process (it stands for someone else's system)."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fake_provider",
            "serve",
            "--port",
            str(port),
            "--seed",
            "7",
            "--db",
            str(work / f"{name}.db"),
            "--log-level",
            "warning",
            *flags,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                httpx.get(f"{base}/_admin/health", timeout=1).raise_for_status()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"the fake provider {name} did not start") from None
                time.sleep(0.05)
        yield base
    finally:
        proc.terminate()
        proc.wait(10)


def fresh_database(work: Path, name: str) -> str:
    url = f"sqlite:///{work / f'{name}.db'}"
    engine = db.create_engine(settings.load(), url=url)
    db.upgrade(engine)
    engine.dispose()
    with Outbox(url) as box:
        box.create_tenant("acme")
    return url


def registry_for(work: Path, name: str, base: str, *, honours: bool, lookup: bool) -> str:
    path = work / f"{name}-adapters.toml"
    path.write_text(
        "[adapters.helpdesk]\n"
        'kind = "helpdesk"\n'
        f'base_url = "{base}"\n'
        f"honours_idempotency_keys = {str(honours).lower()}\n"
        f"supports_lookup = {str(lookup).lower()}\n"
        "lookup_settle_seconds = 0.3\n",
        encoding="utf-8",
    )
    return str(path)


def drop_next_reply(base: str) -> None:
    httpx.post(f"{base}/_admin/faults", json={"script": ["drop_after_commit"]}).raise_for_status()


def effect_row(url: str) -> Any:
    engine = db.create_engine(settings.load(), url=url)
    try:
        with db.read(engine) as conn:
            return conn.execute(sa.select(schema.outbox)).one()
    finally:
        engine.dispose()


def attempts_of(url: str) -> list[Any]:
    engine = db.create_engine(settings.load(), url=url)
    try:
        with db.read(engine) as conn:
            return list(
                conn.execute(sa.select(schema.attempts).order_by(schema.attempts.c.id)).all()
            )
    finally:
        engine.dispose()


def dispatch_until_settled(url: str, adapters_file: str, *, rounds: int = 40) -> None:
    """Run the dispatcher pass by pass until the effect leaves pending (bounded)."""
    config = settings.load(**DEMO_SETTINGS)
    engine = db.create_engine(config, url=url)
    registry = adapters.load_registry(adapters_file)
    dispatcher = Dispatcher(engine, registry, config, worker_id="demo-dispatcher")
    try:
        for _ in range(rounds):
            dispatcher.run_once()
            row = effect_row(url)
            if row.status != "pending":
                return
            wait = (row.next_attempt_at - schema.utcnow()).total_seconds()
            time.sleep(min(max(wait, 0.0), 1.0) + 0.01)
    finally:
        dispatcher.close()
        registry.close()
        engine.dispose()


def reconcile_once(url: str, adapters_file: str) -> dict[str, int]:
    config = settings.load(**DEMO_SETTINGS)
    engine = db.create_engine(config, url=url)
    registry = adapters.load_registry(adapters_file)
    try:
        return sweeps.run_all_once(sweeps.build(engine, registry, config, worker="demo-reconciler"))
    finally:
        registry.close()
        engine.dispose()


def describe_attempts(url: str) -> None:
    for a in attempts_of(url):
        print(
            f"  attempt {a.attempt_no}: key={a.effect_key} outcome={a.outcome} "
            f"status={a.status_code} error={(a.error or '-')[:60]}"
        )


def ledger(base: str) -> dict[str, Any]:
    stats: dict[str, Any] = httpx.get(f"{base}/_admin/stats").json()
    effects: dict[str, Any] = httpx.get(f"{base}/_admin/effects").json()
    stats["effects"] = effects["effects"]
    return stats


def create(url: str, operation_id: str, subject: str) -> None:
    with Outbox(url) as box:
        result = box.execute("acme", operation_id, TOOL, {"subject": subject})
    print(f"Created {operation_id}: {result.receipt_json}")


def honour_story(work: Path, results: list[tuple[str, str, dict[str, Any]]]) -> None:
    print("\n== 2. An honouring provider drops a reply: same key, one ticket ==")
    url = fresh_database(work, "honour")
    with provider(work, "honour-provider", "--mode", "honour") as base:
        adapters_file = registry_for(work, "honour", base, honours=True, lookup=True)
        create(url, "op-honour", "Refund for order 1234")
        drop_next_reply(base)
        dispatch_until_settled(url, adapters_file)
        row = effect_row(url)
        describe_attempts(url)
        print(f"Effect: status={row.status} provider_ref={row.provider_ref}")
        results.append((url, base, ledger(base)))


def lookup_story(work: Path, results: list[tuple[str, str, dict[str, Any]]]) -> None:
    print("\n== 3. An ignoring provider drops a reply: outcome_unknown, the lookup finds it ==")
    url = fresh_database(work, "lookup")
    with provider(work, "lookup-provider", "--mode", "ignore") as base:
        adapters_file = registry_for(work, "lookup", base, honours=False, lookup=True)
        create(url, "op-lookup", "Replace broken lid")
        drop_next_reply(base)
        dispatch_until_settled(url, adapters_file)
        row = effect_row(url)
        describe_attempts(url)
        print(f"After the dispatcher: status={row.status} reason={row.reason} (no resend)")
        time.sleep(0.4)  # the adapter's lookup settle time (0.3 s), so "not found" is trusted
        done = reconcile_once(url, adapters_file)
        row = effect_row(url)
        print(f"Reconciler pass: {done}")
        print(f"After the lookup: status={row.status} reason={row.reason} ref={row.provider_ref}")
        results.append((url, base, ledger(base)))


def review_story(work: Path, results: list[tuple[str, str, dict[str, Any]]]) -> None:
    print("\n== 4. An ignoring provider without lookup: a person decides ==")
    url = fresh_database(work, "review")
    with provider(work, "review-provider", "--mode", "ignore", "--no-lookup") as base:
        adapters_file = registry_for(work, "review", base, honours=False, lookup=False)
        create(url, "op-review", "Chargeback dispute")
        drop_next_reply(base)
        dispatch_until_settled(url, adapters_file)
        time.sleep(0.4)  # the settle time passes; with no lookup, the reconciler asks a person
        reconcile_once(url, adapters_file)
        outbox_cli = [sys.executable, "-m", "outbox.cli", "--database-url", url]
        listing = subprocess.run(
            [*outbox_cli, "review", "list", "--json"], capture_output=True, text=True, check=True
        )
        [item] = json.loads(listing.stdout)
        print(
            f"$ outbox review list  ->  effect {item['id']} group={item['group']} "
            f"key={item['effect_key']}"
        )
        # The operator looks the key up in the helpdesk's own records...
        [ticket] = [
            e for e in ledger(base)["effects"] if e["client_reference"] == item["effect_key"]
        ]
        command = [
            "review",
            "resolve",
            str(item["id"]),
            "--happened",
            "--provider-ref",
            ticket["id"],
            "--reason",
            "ticket found in the helpdesk UI",
            "--actor",
            "alice",
        ]
        print(f"$ outbox {' '.join(command)}")
        resolved = subprocess.run(
            [*outbox_cli, *command], capture_output=True, text=True, check=False
        )
        print("  " + (resolved.stdout.strip() or resolved.stderr.strip()).replace("\n", "\n  "))
        row = effect_row(url)
        print(f"After the decision: status={row.status} reason={row.reason} ref={row.provider_ref}")
        results.append((url, base, ledger(base)))


def summary(results: list[tuple[str, str, dict[str, Any]]]) -> int:
    print("\n== The providers' ledgers ==")
    failures = 0
    minted = 0
    for url, _base, stats in results:
        row = effect_row(url)
        keys = {row.effect_key} | {a.effect_key for a in attempts_of(url)}
        tickets = [e for e in stats["effects"] if e["client_reference"] == row.effect_key]
        strangers = [
            e
            for e in stats["effects"]
            if e["client_reference"] not in keys and e.get("idempotency_key") not in keys
        ]
        minted += len(keys - {row.effect_key}) + len(strangers)
        ok = len(tickets) == 1 and row.status == "succeeded"
        failures += not ok
        print(
            f"  {Path(url).stem:<7} effect {row.effect_key}: tickets={len(tickets)} "
            f"status={row.status} {'ok' if ok else 'WRONG'}"
        )
    print(f"Keys minted for retries: {minted}")
    return 1 if failures or minted else 0


def main() -> int:
    logs.configure(level="ERROR")  # the story prints what matters; the logs would repeat it
    work = Path(tempfile.mkdtemp(prefix="outbox-demo-"))
    url = f"sqlite:///{work / 'outbox.db'}"
    engine = db.create_engine(settings.load(), url=url)
    db.upgrade(engine)
    engine.dispose()
    print(f"Working folder: {work} (fresh SQLite files)\n")
    lost_reply_story(url)
    results: list[tuple[str, str, dict[str, Any]]] = []
    honour_story(work, results)
    lookup_story(work, results)
    review_story(work, results)
    code = summary(results)
    print(NEXT_STEPS)
    return code


NEXT_STEPS = """
== What to open next ==
  make run        the whole service on this machine (= outbox dev). It prints:
                    API      http://127.0.0.1:8000/v1  (OpenAPI: http://127.0.0.1:8000/docs)
                    Console  http://127.0.0.1:8000/console/sign-in, with an operator token
                    Review   http://127.0.0.1:8000/console/queue  (or: outbox review list)
                  and an agent token to call the API with.
  make test       lint, types and every test
  docs            docs/getting-started.md, then the rest under docs/ (make docs builds the site)"""


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
