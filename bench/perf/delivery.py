"""Case 5: HTTP delivery end to end, against the fake provider over loopback.

Outbox: a dispatcher process with the ``helpdesk`` adapter from an
``OUTBOX_ADAPTERS`` TOML file, ``concurrency`` 1, 8 and 32, draining a backlog with
``Dispatcher.run(once=True)`` (the loop of ``outbox dispatcher --once``).
Baseline: the fake provider's own capacity, measured with a plain httpx load
loop at the same concurrency sending the same request (JSON body and a fresh
``Idempotency-Key`` each), in the same run.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from bench.perf import backlog, dispatch, harness

ADAPTER = "helpdesk"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Provider:
    """``fake-provider serve`` in its own process, stopped with the case."""

    def __init__(self, tmp: Path) -> None:
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        exe = Path(sys.executable).with_name("fake-provider")
        self.process = subprocess.Popen(
            [
                str(exe),
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--mode",
                "honour",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.adapters_toml = tmp / f"adapters-{self.port}.toml"
        self.adapters_toml.write_text(
            f'[adapters.{ADAPTER}]\nkind = "helpdesk"\nbase_url = "{self.base_url}"\n'
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("the fake provider did not start within 20s")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


def outbox_http(
    *, client: int, start_at: float, end_at: float, url: str, adapters_toml: str, concurrency: int
) -> dict[str, Any]:
    import adapters
    from outbox import db, settings
    from outbox.delivery.dispatcher import Dispatcher

    os.environ["OUTBOX_ADAPTERS"] = adapters_toml
    config = settings.load(
        sqlite_synchronous="NORMAL", concurrency=concurrency, claim_batch_size=100
    )
    engine = db.create_engine(config, url=url)
    registry = adapters.load_registry(config.adapters)
    d = Dispatcher(engine, registry, config, worker_id=f"bench-http-{uuid.uuid4().hex[:6]}")
    try:
        # ``outbox dispatcher --once``'s loop (write-behind, the held claim connection).
        # Before: ``run_once()`` in a loop, which has neither.
        return dispatch.run_once_until(d, start_at, end_at)
    finally:
        d.close()
        registry.close()
        engine.dispose()


def provider_load(
    *, client: int, start_at: float, end_at: float, base_url: str, concurrency: int
) -> dict[str, Any]:
    """A plain httpx loop: ``concurrency`` threads sharing one client, as the adapter does."""
    body = json.loads(backlog.PAYLOAD)
    counts = [0] * concurrency
    limits = httpx.Limits(
        max_connections=max(concurrency, 1), max_keepalive_connections=concurrency
    )
    with httpx.Client(base_url=base_url, limits=limits, timeout=15.0) as http:

        def loop(slot: int) -> None:
            while time.monotonic() < end_at:
                key = f"obx_{uuid.uuid4().hex}"
                reply = http.post(
                    "/v1/tickets",
                    json={**body, "client_reference": key},
                    headers={"Idempotency-Key": key},
                )
                if reply.status_code < 300:
                    counts[slot] += 1

        harness.wait_until(start_at)
        started = time.monotonic()
        threads = [threading.Thread(target=loop, args=(i,)) for i in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(end_at - time.monotonic() + 30)
        return {"ops": sum(counts), "started": started, "ended": time.monotonic()}


def run(ctx: Any) -> None:
    backend = "postgres" if "postgres" in ctx.backends else ctx.backends[0]
    seconds = 2.0 if ctx.quick else 3.0
    provider = Provider(ctx.scratch.tmp)
    try:
        for rep in range(ctx.reps):
            for concurrency in ctx.http_concurrency:
                for system in harness.rotated(["outbox", "provider"], rep):
                    _measure(ctx, rep, backend, system, concurrency, seconds, provider)
    finally:
        provider.stop()


def _measure(
    ctx: Any,
    rep: int,
    backend: str,
    system: str,
    concurrency: int,
    seconds: float,
    provider: Provider,
) -> None:
    if system == "provider":
        reports = ctx.clients.run(
            provider_load, 1, seconds, base_url=provider.base_url, concurrency=concurrency
        )
    else:
        url = ctx.scratch.fresh(backend)
        try:
            # More than the window can drain at the provider's own pace.
            backlog.fill(url, ctx.http_effects, adapter=ADAPTER)
            reports = ctx.clients.run(
                outbox_http,
                1,
                seconds,
                url=url,
                adapters_toml=str(provider.adapters_toml),
                concurrency=concurrency,
            )
        finally:
            ctx.scratch.drop(url)
    done, span = harness.throughput(reports)
    ctx.out.emit(
        case="http",
        system=system,
        db=backend,
        concurrency=concurrency,
        rep=rep,
        effects=done,
        seconds=span,
        effects_per_s=done / span,
    )
