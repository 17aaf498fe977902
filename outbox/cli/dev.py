"""``outbox dev``: the whole service on one machine, with no configuration.

It migrates the embedded SQLite file, creates a tenant ``dev`` with one agent
and one operator token (printed once), then starts four child processes:
the API (with the console), a dispatcher, the reconciler and a fake provider
in honour mode. With an app (``--app`` or ``OUTBOX_APP``), its migrations run
too and the children serve it (``OUTBOX_APP`` in their environment), with the
app's adapters; without one, the demo's helpdesk adapter points at the fake
provider. Each child's lines are prefixed with its name. SIGINT or
SIGTERM stops them all: each gets SIGTERM and ``--grace`` seconds to finish,
then SIGKILL; ``outbox dev`` exits only when none is left.

The fake provider is started as a separate program (``fake-provider``), never
imported: it stands for somebody else's system.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

from outbox import app as apps
from outbox import db, settings
from outbox.service import Outbox

CHILD_NAMES = ("provider", "api", "dispatcher", "reconciler")


def cli_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="bind address of every child")
    parser.add_argument("--port", type=int, default=8000, help="API port (default 8000)")
    parser.add_argument(
        "--provider-port", type=int, default=9000, help="fake provider port (default 9000)"
    )
    parser.add_argument(
        "--provider-mode", choices=["honour", "ignore"], default="honour", help="fake provider mode"
    )
    parser.add_argument("--grace", type=float, default=10.0, help="seconds children get to stop")
    parser.add_argument(
        "--log-format",
        choices=["text", "json"],
        default=None,
        help="the children's log lines: text or JSON (default OUTBOX_LOG_FORMAT, text)",
    )


def _command(*parts: str) -> list[str]:
    return [sys.executable, "-m", *parts]


def _pump(name: str, stream: IO[str], lock: threading.Lock) -> None:
    width = max(len(n) for n in CHILD_NAMES)
    for line in iter(stream.readline, ""):
        with lock:
            sys.stdout.write(f"{name:<{width}} | {line}")
            sys.stdout.flush()
    stream.close()


def cli_run(args: argparse.Namespace) -> int:
    config = settings.load()
    app = apps.from_args(args)
    url = args.database_url or config.database_url
    engine = db.create_engine(config, url=url)
    try:
        db.upgrade(engine)
        app.upgrade(engine)
    finally:
        engine.dispose()
    with Outbox(url, config=config, app=app) as box:
        box.create_tenant("dev")
        agent = box.create_token("dev", "agent", "outbox dev")
        operator = box.create_token("dev", "operator", "outbox dev")

    work = Path("var")
    work.mkdir(exist_ok=True)
    adapters_file = work / "dev-adapters.toml"
    adapters_file.write_text(
        "[adapters.helpdesk]\n"
        'kind = "helpdesk"\n'
        f'base_url = "http://{args.host}:{args.provider_port}"\n'
        f"honours_idempotency_keys = {'true' if args.provider_mode == 'honour' else 'false'}\n"
        "lookup_settle_seconds = 1.0\n",
        encoding="utf-8",
    )
    env = dict(os.environ)
    env["OUTBOX_DATABASE_URL"] = url
    app_spec = getattr(args, "app", None) or os.environ.get(apps.APP_ENV)
    if app_spec:
        # The children serve the same app, with its own adapters (or OUTBOX_ADAPTERS).
        env[apps.APP_ENV] = app_spec
    else:
        env["OUTBOX_ADAPTERS"] = str(adapters_file)
    env["PYTHONUNBUFFERED"] = "1"
    if args.log_format:
        env["OUTBOX_LOG_FORMAT"] = args.log_format
    fake = shutil.which("fake-provider")
    provider_cmd = [fake] if fake else _command("fake_provider")
    commands = {
        "provider": [
            *provider_cmd,
            "serve",
            "--host",
            args.host,
            "--port",
            str(args.provider_port),
            "--mode",
            args.provider_mode,
            "--db",
            str(work / "dev-provider.db"),
        ],
        "api": _command("outbox.cli", "serve", "--host", args.host, "--port", str(args.port)),
        "dispatcher": _command("outbox.cli", "dispatcher"),
        "reconciler": _command("outbox.cli", "reconciler"),
    }

    base = f"http://{args.host}:{args.port}"
    print(f"API      {base}/v1  (OpenAPI: {base}/docs)")
    print(f"Console  {base}/console/sign-in  (sign in with the operator token)")
    print(f"Review   {base}/console/queue  ·  outbox review list  ·  GET {base}/v1/review")
    print(f"Provider http://{args.host}:{args.provider_port}/_admin/stats")
    print(f"Database {url}")
    print(f"Tenant   dev   agent token: {agent}")
    print(f"               operator token: {operator}")
    print(
        "Try      curl -H 'Authorization: Bearer <agent token>' -H 'Idempotency-Key: op-1' "
        f"-H 'Content-Type: application/json' -d '{{\"subject\": \"Late parcel\"}}' "
        f"{base}/v1/tasks"
    )
    print("Ctrl-C stops everything.", flush=True)

    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    lock = threading.Lock()
    children: dict[str, subprocess.Popen[str]] = {}
    pumps: list[threading.Thread] = []
    try:
        for name in CHILD_NAMES:
            proc = subprocess.Popen(
                commands[name],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                # Own process group: a Ctrl-C at the terminal reaches us, and we decide.
                start_new_session=True,
            )
            children[name] = proc
            with lock:
                # Supervisors and tests check that every one of these is gone after we stop.
                print(f"outbox dev: started {name} pid {proc.pid}", flush=True)
            assert proc.stdout is not None
            pump = threading.Thread(target=_pump, args=(name, proc.stdout, lock), daemon=True)
            pump.start()
            pumps.append(pump)
        exit_code = 0
        while not stop.wait(0.2):
            for name, proc in children.items():
                if proc.poll() is not None:
                    print(f"outbox dev: {name} exited with {proc.returncode}; stopping all")
                    exit_code = 1
                    stop.set()
                    break
        return exit_code
    finally:
        _stop_all(children, args.grace)
        for pump in pumps:
            pump.join(2)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _stop_all(children: dict[str, subprocess.Popen[str]], grace: float) -> None:
    for proc in children.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in children.values():
        remaining = max(0.0, deadline - time.monotonic())
        try:
            proc.wait(remaining)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
