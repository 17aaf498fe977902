"""Run the refunds app end to end with the stock processes only (``make example``).

It starts, as separate programs: two ``fake-provider serve`` (payments in
honour mode, chat in ignore mode, each dropping its first reply after
committing), ``outbox serve``, ``outbox dispatcher`` and ``outbox reconciler``,
all with ``OUTBOX_APP=refunds_app.app:app``, after ``outbox db upgrade`` and a
tenant and token made with ``outbox tenants create`` / ``outbox tokens create``.
Then it speaks HTTP: every call twice with one Idempotency-Key (the second
must replay byte for byte). One refund is over the approval limit: it answers
202 awaiting_approval and its effect stays held until ``outbox approvals
approve`` releases it. Then it waits until every effect is settled, and reads
the providers' ledgers for duplicates.

The last line it prints:

    example: created=N delivered=N unknown=0 duplicates=0

Ports are free loopback ports; the app's adapters file is copied with those
ports into the work folder and named by ``OUTBOX_ADAPTERS``. The database is
a fresh SQLite file in the work folder, or ``OUTBOX_DATABASE_URL`` when set.
Exit status 0 only if every effect was delivered once.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import httpx

HERE = Path(__file__).resolve().parent
APP = "refunds_app.app:app"
ADAPTERS_FILE = HERE / "refunds_app" / "adapters.toml"
PORTS_IN_FILE = {"payments": 9101, "chat": 9102}
TIMEOUT_SECONDS = 300.0  # generous: a busy 2-core machine, five Python processes
REFUNDS = 5
MESSAGES = 5
LARGE_REFUND = "refund-large"  # over the approval limit: an operator approves it


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_for(what: str, check: Callable[[], Any], procs: list[subprocess.Popen[bytes]]) -> Any:
    deadline = time.monotonic() + TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise SystemExit(f"example: {proc.args[1:3]} exited with {proc.returncode}")
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise SystemExit(f"example: timed out waiting for {what}")


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="var/example", help="work folder (emptied first)")
    options = parser.parse_args(argv)
    work = Path(options.work).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)

    ports = {name: free_port() for name in ("api", *PORTS_IN_FILE)}
    adapters_text = ADAPTERS_FILE.read_text(encoding="utf-8")
    for name, port in PORTS_IN_FILE.items():
        adapters_text = adapters_text.replace(f"127.0.0.1:{port}", f"127.0.0.1:{ports[name]}")
    (work / "adapters.toml").write_text(adapters_text, encoding="utf-8")

    env = dict(os.environ)
    env["OUTBOX_APP"] = APP
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    env["OUTBOX_ADAPTERS"] = str(work / "adapters.toml")
    env.setdefault("OUTBOX_DATABASE_URL", f"sqlite:///{work / 'outbox.db'}")
    env["OUTBOX_SWEEP_INTERVAL"] = "1s"
    env["OUTBOX_BACKOFF_INITIAL"] = "0.2s"
    env["PYTHONUNBUFFERED"] = "1"
    bin_dir = Path(sys.executable).parent

    def tool(name: str) -> str:
        found = shutil.which(name, path=str(bin_dir)) or shutil.which(name)
        if found is None:
            raise SystemExit(f"example: {name} is not installed (pip install -e .)")
        return found

    outbox, fake = tool("outbox"), tool("fake-provider")

    def run(*args: str) -> str:
        done = subprocess.run([outbox, *args], check=False, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"example: outbox {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout.strip()

    say(run("db", "upgrade"))
    run("tenants", "create", "shop")
    token = run("tokens", "create", "--tenant", "shop", "--role", "agent", "--label", "example")

    logs: list[IO[bytes]] = []
    procs: list[subprocess.Popen[bytes]] = []

    def start(name: str, *command: str) -> None:
        log = (work / f"{name}.log").open("wb")
        logs.append(log)
        procs.append(
            subprocess.Popen(list(command), env=env, stdout=log, stderr=subprocess.STDOUT, cwd=work)
        )

    try:
        for name, mode in (("payments", "honour"), ("chat", "ignore")):
            # Each drops its first reply after committing: the lost reply, from both sides.
            start(
                name, fake, "serve", "--port", str(ports[name]), "--mode", mode,
                "--script", "drop_after_commit", "--lookup-lag-ms", "0", "--log-level", "warning",
            )  # fmt: skip
        start("api", outbox, "serve", "--port", str(ports["api"]))
        start("dispatcher", outbox, "dispatcher")
        start("reconciler", outbox, "reconciler")
        api = f"http://127.0.0.1:{ports['api']}"
        for name in PORTS_IN_FILE:
            health = f"http://127.0.0.1:{ports[name]}/_admin/health"
            wait_for(name, lambda url=health: answers(url), procs)
        wait_for("the API", lambda: answers(f"{api}/readyz"), procs)
        say(f"example: serving on {api} (logs in {work})")

        def approve(operation_id: str) -> None:
            reason = "checked with finance"
            decided = json.loads(
                run("approvals", "approve", operation_id, "--tenant", "shop", "--reason", reason)
            )
            say(f"example: {operation_id} {decided['status']} by {decided['decision']['actor']}")

        return drive(api, token, ports, procs, approve)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for log in logs:
            log.close()


def drive(
    api: str,
    token: str,
    ports: dict[str, int],
    procs: list[subprocess.Popen[bytes]],
    approve: Callable[[str], None],
) -> int:
    calls: list[tuple[str, str, dict[str, Any]]] = []
    for n in range(REFUNDS):
        arguments = {
            "order_id": f"ord_{1000 + n}",
            "amount_cents": 500 + n,
            "currency": "EUR",
            "reason": "parcel arrived damaged",
        }
        calls.append(("issue_refund", f"refund-{n}", arguments))
    for n in range(MESSAGES):
        arguments = {"customer_id": f"cus_{n}", "message": "Your refund is on its way."}
        calls.append(("notify_customer", f"notify-{n}", arguments))
    large = {"order_id": "ord_2000", "amount_cents": 75_000, "currency": "EUR", "reason": "lost"}
    calls.append(("issue_refund", LARGE_REFUND, large))

    created = 0
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=api, headers=headers, timeout=30) as client:
        for name, key, arguments in calls:
            first = client.post(
                f"/v1/tools/{name}", json=arguments, headers={"Idempotency-Key": key}
            )
            again = client.post(
                f"/v1/tools/{name}", json=arguments, headers={"Idempotency-Key": key}
            )
            expected = 202 if key == LARGE_REFUND else 201
            if first.status_code != expected or again.status_code != expected:
                raise SystemExit(f"example: {name} {key}: {first.status_code} {first.text}")
            if again.content != first.content or again.headers["idempotent-replayed"] != "true":
                raise SystemExit(f"example: {name} {key}: the retry did not replay the receipt")
            created += first.headers["idempotent-replayed"] == "false"

        # The large refund waits for an operator: held, so nothing was sent. Approved
        # with the stock CLI, it is released to the dispatcher like any other.
        held = client.get(f"/v1/operations/{LARGE_REFUND}").json()
        if [e["status"] for e in held["effects"]] != ["held"]:
            raise SystemExit(f"example: {LARGE_REFUND} is not held: {held}")
        approve(LARGE_REFUND)

        def effects() -> list[dict[str, Any]]:
            out: list[dict[str, Any]] = []
            for _, key, _ in calls:
                out.extend(client.get(f"/v1/operations/{key}").json()["effects"])
            return out

        def settled() -> list[dict[str, Any]] | None:
            now = effects()
            done = all(e["status"] in ("succeeded", "failed") or e["awaiting_review"] for e in now)
            return now if done else None

        final = wait_for("every effect to settle", settled, procs)
    delivered = sum(e["status"] == "succeeded" for e in final)
    unknown = sum(e["status"] == "outcome_unknown" for e in final)
    duplicates = 0
    for name in PORTS_IN_FILE:
        stats = httpx.get(f"http://127.0.0.1:{ports[name]}/_admin/stats", timeout=10).json()
        duplicates += sum(count - 1 for count in stats["duplicates"].values())
        say(f"example: {name}: {stats['tickets']} tickets, requests {stats['requests']}")
    print(
        f"example: created={created} delivered={delivered} unknown={unknown} duplicates={duplicates}"
    )
    ok = created == len(calls) and delivered == len(final) == created and duplicates == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
