"""Per-tenant API rate limits, on the maintained ``limits`` library (moving window, in memory).

Every tenant gets ``OUTBOX_RATE_LIMIT`` (default ``100/second``) unless it has
its own (``outbox tenants create|update NAME --rate-limit 10/second``, stored
in ``tenants.rate_limit``). ``none`` means no limit. Limits are per process:
with N API processes behind a balancer a tenant gets up to N times its limit.

A request over the limit is answered ``429`` with ``Retry-After`` and the
problem's ``retry: same_key`` (nothing was looked at, nothing was stored; the
same request later is welcome). Every limited answer, 2xx or 429, carries the
IETF draft headers (draft-ietf-httpapi-ratelimit-headers)::

    RateLimit-Policy: "tenant";q=100;w=1
    RateLimit: "tenant";r=37;t=1

Fairness is the point, so a refusal must cost the server next to nothing:
``RateLimitGate`` is ASGI middleware that refuses a flooding tenant's request
on the event loop, before routing, authentication's database read or the
thread pool. It knows which tenant a bearer token belongs to only after that
token has authenticated (``Limiter.remember`` keeps the token's SHA-256
for ``GATE_TRUST_SECONDS``), so a token is never trusted by the gate: an
admitted request is still authenticated against the database, and the gate
can only refuse. A changed limit, or a revoked token (401 instead of 429),
shows within those seconds. And the server does not read the next request of
a connection answered 429 until its Retry-After (at most one second): a
client that ignores Retry-After is slowed down instead of served refusals as
fast as it can ask.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import limits
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from outbox import errors, settings

POLICY_NAME = "tenant"
UNLIMITED = settings.RATE_LIMIT_NONE
TOKENS_REMEMBERED = 10_000  # token hashes the gate knows the tenant of (least recent dropped)
# The gate trusts what it learned of a token this long; then one request goes through
# authentication again, so a changed limit or a revoked token shows within it.
GATE_TRUST_SECONDS = 5.0
STATE_KEY = "outbox_rate_limit"
# A connection answered 429 is not read again for Retry-After seconds, at most this long:
# a client that ignores Retry-After on a keep-alive connection then costs the server one
# refusal per connection per pause instead of one per round trip.
PAUSE_READING_KEY = "outbox_pause_reading"
PAUSE_READING_MAX_SECONDS = 1.0


class RateLimited(errors.OutboxError):
    """This tenant sent more requests than its rate limit allows; send the same request later."""

    problem_type = "too-many-requests"
    title = "Too many requests"
    status = 429
    retry = "same_key"

    def __init__(self, decision: Decision) -> None:
        super().__init__(
            f"the rate limit of this tenant is {decision.text}; retry the same request "
            f"(same Idempotency-Key) after {decision.retry_after} s; nothing was stored"
        )
        self.retry_after_seconds = decision.retry_after
        self.response_headers = decision.headers()


parse = settings.parse_rate_limit


@dataclass(frozen=True, slots=True)
class Decision:
    allowed: bool
    text: str
    quota: int
    window_seconds: int
    remaining: int
    reset_after: int  # seconds until the window has room again (>= 0)

    @property
    def retry_after(self) -> int:
        return max(1, self.reset_after)

    def headers(self) -> dict[str, str]:
        out = {
            "RateLimit-Policy": f'"{POLICY_NAME}";q={self.quota};w={self.window_seconds}',
            "RateLimit": f'"{POLICY_NAME}";r={self.remaining};t={self.reset_after}',
        }
        if not self.allowed:
            out["Retry-After"] = str(self.retry_after)
        return out


class Limiter:
    """One process's counters: a moving window per tenant, and the gate's token map."""

    def __init__(
        self,
        default: str,
        *,
        trust_seconds: float = GATE_TRUST_SECONDS,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.default = default
        self.trust_seconds = trust_seconds
        self.monotonic = monotonic
        self._storage = MemoryStorage()
        self._limiter = MovingWindowRateLimiter(self._storage)
        self._parsed: dict[str, limits.RateLimitItem | None] = {}
        self._tokens: OrderedDict[str, tuple[str, str | None, float]] = OrderedDict()
        self._lock = threading.Lock()

    def _item(self, text: str) -> limits.RateLimitItem | None:
        if text not in self._parsed:
            try:
                self._parsed[text] = parse(text)
            except ValueError:
                self._parsed[text] = parse(self.default)  # a bad stored value: the default
        return self._parsed[text]

    def check(self, tenant: str, own: str | None) -> Decision | None:
        """Count one request of ``tenant``; None when it has no limit."""
        text = own or self.default
        item = self._item(text)
        if item is None:
            return None
        allowed = self._limiter.hit(item, tenant)
        reset_at, remaining = self._limiter.get_window_stats(item, tenant)
        return Decision(
            allowed=allowed,
            text=text,
            quota=item.amount,
            window_seconds=item.get_expiry(),
            remaining=max(0, remaining),
            reset_after=max(0, math.ceil(reset_at - time.time())),
        )

    def remember(self, token: str, tenant: str, own: str | None) -> None:
        """After authentication: the gate may refuse this token's requests from now on."""
        digest = hashlib.sha256(token.encode("utf-8")).hexdigest()
        with self._lock:
            self._tokens[digest] = (tenant, own, self.monotonic() + self.trust_seconds)
            self._tokens.move_to_end(digest)
            while len(self._tokens) > TOKENS_REMEMBERED:
                self._tokens.popitem(last=False)

    def known(self, token: str) -> tuple[str, str | None] | None:
        """The tenant and own limit of a token that authenticated recently, else None."""
        digest = hashlib.sha256(token.encode("utf-8")).hexdigest()
        with self._lock:
            entry = self._tokens.get(digest)
            if entry is None:
                return None
            if entry[2] <= self.monotonic():
                del self._tokens[digest]  # stale: authentication looks again
                return None
            return entry[0], entry[1]


def _bearer(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            text: str = bytes(value).decode("latin-1")
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


class RateLimitGate:
    """Pure ASGI middleware: refuse a known token's tenant over its limit, before anything
    else runs; add the RateLimit headers to every answer that was counted."""

    def __init__(self, app: ASGIApp, limiter: Limiter) -> None:
        self.app = app
        self.limiter = limiter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        token = _bearer(scope)
        known = self.limiter.known(token) if token else None
        if known is not None:
            decision = self.limiter.check(*known)
            if decision is not None and not decision.allowed:
                from outbox.api import problems

                # Refused here too: the connection's next request waits for Retry-After.
                state[PAUSE_READING_KEY] = min(
                    float(decision.retry_after), PAUSE_READING_MAX_SECONDS
                )
                await problems.render(RateLimited(decision))(scope, receive, send)
                return
            # Counted here: authentication must not count it again.
            state[STATE_KEY] = decision if decision is not None else False

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                if message["status"] == 429:
                    # Ask the server not to read this connection's next request before
                    # the caller may retry (``connections.HeaderTimeoutProtocol``).
                    decision = state.get(STATE_KEY)
                    wait = decision.retry_after if isinstance(decision, Decision) else 1
                    state[PAUSE_READING_KEY] = min(float(wait), PAUSE_READING_MAX_SECONDS)
                decision = state.get(STATE_KEY)
                if decision:
                    headers = list(message.get("headers", []))
                    present = {k.lower() for k, _ in headers}
                    for name, value in decision.headers().items():
                        key = name.lower().encode("latin-1")
                        if key not in present:
                            headers.append((key, value.encode("latin-1")))
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def count_authenticated(
    state: dict[str, object], limiter: Limiter, token: str, tenant: str, own: str | None
) -> None:
    """From authentication: count the request unless the gate already did; raise if over."""
    limiter.remember(token, tenant, own)  # also refreshes a tenant's changed limit
    if STATE_KEY in state:
        return
    decision = limiter.check(tenant, own)
    state[STATE_KEY] = decision if decision is not None else False
    if decision is not None and not decision.allowed:
        raise RateLimited(decision)
