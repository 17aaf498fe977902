"""Against a real uvicorn server on loopback: the lost reply, and one key sent 32 times at once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import anyio
import httpx
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from outbox.api import create_app
from outbox.client import Client, Outcome
from outbox.service import Outbox
from tests.api.conftest import Tokens, written
from tests.support.servers import serve_in_thread

TASK = {"subject": "Parcel lost", "body": "Order 4711"}
HOLD_LIMIT_SECONDS = 15  # bound on the wait for the retry; the test fails long before it


class LoseFirstReply:
    """Hold the first POST's reply until the client's retry arrives, then let it go.

    The route has returned by the time ``http.response.start`` is sent, so the
    write has committed: this is the window "the server commits, the reply is
    lost" (the client's read has timed out and it has moved on). Waiting for the
    retry's arrival, not for a fixed time, keeps the test free of guessed sleeps.
    """

    def __init__(self, app: ASGIApp, on_hold: Callable[[], Any]) -> None:
        self.app = app
        self.on_hold = on_hold
        self.posts = 0
        self.held_state: Any = None
        self.retry_arrived: asyncio.Event | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        if self.retry_arrived is None:
            self.retry_arrived = asyncio.Event()
        self.posts += 1
        if self.posts > 1:
            self.retry_arrived.set()
            await self.app(scope, receive, send)
            return
        arrived = self.retry_arrived

        async def held(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.held_state = await anyio.to_thread.run_sync(self.on_hold)
                with anyio.move_on_after(HOLD_LIMIT_SECONDS):
                    await arrived.wait()
            await send(message)

        await self.app(scope, receive, held)


def test_a_lost_reply_is_retried_with_the_same_key_and_finds_the_same_receipt(
    box: Outbox, tokens: Tokens
) -> None:
    wrapper = LoseFirstReply(create_app(box), on_hold=lambda: written(box))
    pauses: list[float] = []
    with serve_in_thread(wrapper) as base_url:
        client = Client(
            base_url,
            tokens.acme,
            # The first read always times out (its reply is held); the retry and the read
            # after it must each be answered within it, on a busy machine too.
            timeout=5.0,
            deadline=30,
            max_attempts=4,
            sleep=pauses.append,
        )
        with client:
            result = client.create_task("order-4711-lost", TASK)
            view = client.get_operation("order-4711-lost")

    # When the reply was held, the write had already committed.
    assert wrapper.held_state == {"tasks": 1, "operations": 1, "outbox": 1}
    assert result.outcome is Outcome.REPLAYED, result
    assert result.attempts == 2
    assert len(pauses) == 1
    assert result.status_code == 201
    assert view.outcome is Outcome.FOUND, view
    assert view.data is not None and result.receipt == view.data["receipt"]
    assert written(box) == {"tasks": 1, "operations": 1, "outbox": 1}


def test_32_concurrent_requests_with_one_key_make_one_task_and_32_identical_receipts(
    box: Outbox, tokens: Tokens
) -> None:
    headers = {"Authorization": f"Bearer {tokens.acme}", "Idempotency-Key": "same-key"}

    async def burst(base_url: str) -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
        async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=60) as client:
            start = asyncio.Event()

            async def one() -> httpx.Response:
                await start.wait()  # all 32 are ready before any is sent
                return await client.post("/v1/tasks", json=TASK, headers=headers)

            tasks = [asyncio.create_task(one()) for _ in range(32)]
            await asyncio.sleep(0)
            start.set()
            return await asyncio.gather(*tasks)

    with serve_in_thread(create_app(box)) as base_url:
        responses = asyncio.run(burst(base_url))

    assert [r.status_code for r in responses] == [201] * 32, [r.text for r in responses]
    assert len({r.content for r in responses}) == 1
    assert sorted(r.headers["idempotent-replayed"] for r in responses) == ["false"] + ["true"] * 31
    assert written(box) == {"tasks": 1, "operations": 1, "outbox": 1}
