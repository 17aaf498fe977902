"""In-process access to a fake provider that fails the way a socket would.

httpx's ``ASGITransport`` has no socket and no timeouts: an aborted reply
reaches the client as the app's own :class:`~fake_provider.app.ConnectionDropped`,
and a held reply simply arrives late. :class:`ProviderTransport` maps both to
what an HTTP client over a real connection sees (``httpx.RemoteProtocolError``
and ``httpx.ReadTimeout``), so code that classifies transport errors can be
tested in-process against the same provider it meets over real HTTP.
"""

from __future__ import annotations

import math

import anyio
import httpx
from starlette.types import ASGIApp

from fake_provider import app as app_


class ProviderTransport(httpx.AsyncBaseTransport):
    """An ``httpx.ASGITransport`` that honours the read timeout and drops like a socket."""

    def __init__(self, app: ASGIApp) -> None:
        self._inner = httpx.ASGITransport(app=app)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeouts = request.extensions.get("timeout", {})
        read_timeout = timeouts.get("read")
        # The whole exchange is bounded by the read timeout: in-process there
        # is no separate connect or write phase worth timing.
        limit = math.inf if read_timeout is None else float(read_timeout)
        try:
            with anyio.fail_after(limit):
                return await self._inner.handle_async_request(request)
        except app_.ConnectionDropped as exc:
            raise httpx.RemoteProtocolError(
                "server closed the connection without a complete reply", request=request
            ) from exc
        except TimeoutError as exc:
            raise httpx.ReadTimeout("timed out waiting for the reply", request=request) from exc

    async def aclose(self) -> None:
        await self._inner.aclose()
