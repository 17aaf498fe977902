"""How an adapter proves who it is: bearer, basic, API key, OAuth2 client credentials.

Each kind is declared in the adapter's ``[adapters.NAME.auth]`` table (see
``docs/adapters.md``) and built once, at start-up, with its secrets resolved.
``apply(headers, params)`` adds the credentials to one request; it is called
*before* the send begins, so a failure there (the token endpoint is down) is
``AuthUnavailable``, which the adapter turns into NOT_SENT: the provider saw
nothing.

OAuth2 client credentials (RFC 6749 section 4.4) go through authlib's httpx
client: it builds the token request (client authentication by HTTP Basic or
in the body) and parses the token reply. The token is cached in the adapter,
shared by every dispatcher thread under one lock, and fetched again only when
it is within ``refresh_leeway_seconds`` of its ``expires_in``, or after the
provider answered 401 to it.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import quote

import httpx

from adapters.secrets import Secret

OAUTH2_REFRESH_LEEWAY_SECONDS_DEFAULT = 30.0
"""A cached token is replaced this long before the provider said it expires."""
OAUTH2_TOKEN_TIMEOUT_DEFAULT = 10.0

KINDS = ("bearer", "basic", "api_key", "oauth2_client_credentials")


class AuthUnavailable(Exception):
    """Credentials could not be obtained for this request; nothing was sent."""


class Auth(Protocol):
    kind: str

    def apply(self, headers: dict[str, str], params: dict[str, str]) -> None:
        """Add the credentials to one request's headers or query parameters."""
        ...

    def rejected(self) -> None:
        """The provider answered 401: forget what may be stale (a cached token)."""
        ...

    def secrets(self) -> list[Secret]:
        """Every value that must never be shown (for the adapter's redactor)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class BearerAuth:
    token: Secret
    kind: str = "bearer"

    def apply(self, headers: dict[str, str], params: dict[str, str]) -> None:
        headers["Authorization"] = f"Bearer {self.token.reveal()}"

    def rejected(self) -> None:
        pass

    def secrets(self) -> list[Secret]:
        return [self.token, Secret(f"Bearer {self.token.reveal()}")]

    def close(self) -> None:
        pass


@dataclass(frozen=True, slots=True)
class BasicAuth:
    username: Secret
    password: Secret
    kind: str = "basic"

    def _header(self) -> str:
        pair = f"{self.username.reveal()}:{self.password.reveal()}".encode()
        return "Basic " + base64.b64encode(pair).decode("ascii")

    def apply(self, headers: dict[str, str], params: dict[str, str]) -> None:
        headers["Authorization"] = self._header()

    def rejected(self) -> None:
        pass

    def secrets(self) -> list[Secret]:
        # The user name is often an account id (Twilio's AccountSid): kept out of
        # error texts too, as is the encoded pair.
        encoded = self._header()
        return [self.username, self.password, Secret(encoded), Secret(encoded[len("Basic ") :])]

    def close(self) -> None:
        pass


@dataclass(frozen=True, slots=True)
class ApiKeyAuth:
    name: str
    value: Secret
    location: str  # "header" or "query"
    kind: str = "api_key"

    def apply(self, headers: dict[str, str], params: dict[str, str]) -> None:
        if self.location == "query":
            params[self.name] = self.value.reveal()
        else:
            headers[self.name] = self.value.reveal()

    def rejected(self) -> None:
        pass

    def secrets(self) -> list[Secret]:
        return [self.value, Secret(quote(self.value.reveal(), safe=""))]

    def close(self) -> None:
        pass


def _token_request(
    client_id: str,
    client_secret: str,
    client_auth: str,
    scope: str | None,
    extra: Mapping[str, str],
) -> tuple[dict[str, str], str]:
    """Headers and form body of an RFC 6749 section 4.4 token request, encoded by authlib.

    authlib's own httpx client is not used: where the ``httpx2`` distribution is
    installed (the MCP SDK brings it) authlib switches to it, and our httpx
    transports (connection limits, tests' mocks) would no longer apply.
    """
    from authlib.common.encoding import to_native
    from authlib.oauth2.rfc6749.parameters import prepare_token_request

    fields = dict(extra)
    headers = {
        "Accept": "application/json",
        "Content-Type": "application/x-www-form-urlencoded",
    }
    if client_auth == "body":
        fields.update(client_id=client_id, client_secret=client_secret)
    else:
        pair = f"{quote(client_id, safe='')}:{quote(client_secret, safe='')}"
        headers["Authorization"] = "Basic " + to_native(base64.b64encode(pair.encode()))
    body = prepare_token_request("client_credentials", scope=scope, **fields)
    return headers, body


@dataclass(eq=False)
class OAuth2ClientCredentials:
    """A cached client-credentials token; see the module docstring."""

    token_url: str
    client_id: str
    client_secret: Secret
    scope: str | None = None
    audience: str | None = None
    client_auth: str = "basic"  # "basic": client_secret_basic, "body": client_secret_post
    refresh_leeway_seconds: float = OAUTH2_REFRESH_LEEWAY_SECONDS_DEFAULT
    transport: httpx.BaseTransport | None = None
    clock: Callable[[], float] | None = None  # seconds; default time.monotonic
    kind: str = "oauth2_client_credentials"
    fetches: int = 0  # tokens fetched so far (tests, metrics)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _token: Secret | None = field(default=None, repr=False)
    _expires_at: float | None = field(default=None, repr=False)
    _seen: list[Secret] = field(default_factory=list, repr=False)
    _client: Any = field(default=None, repr=False)
    on_new_secret: Callable[[Secret], None] | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        return f"OAuth2ClientCredentials(token_url={self.token_url!r}, client_id=***)"

    def _now(self) -> float:
        if self.clock is not None:
            return self.clock()
        import time

        return time.monotonic()

    def _oauth_client(self) -> httpx.Client:
        if self._client is None:
            self._client = httpx.Client(
                transport=self.transport,
                timeout=OAUTH2_TOKEN_TIMEOUT_DEFAULT,
                follow_redirects=False,
                trust_env=False,
            )
        client: httpx.Client = self._client
        return client

    def _fetch(self, extra: Mapping[str, str]) -> Mapping[str, Any]:
        headers, body = _token_request(
            self.client_id, self.client_secret.reveal(), self.client_auth, self.scope, extra
        )
        answer = self._oauth_client().post(self.token_url, content=body, headers=headers)
        answer.raise_for_status()
        reply = answer.json()
        if not isinstance(reply, Mapping):
            raise TypeError("the token reply is not a JSON object")
        return reply

    def token(self) -> str:
        """A live access token: the cached one, or a new one from the token endpoint."""
        with self._lock:
            now = self._now()
            if self._token is not None and (self._expires_at is None or now < self._expires_at):
                return self._token.reveal()
            extra: dict[str, str] = {}
            if self.audience:
                extra["audience"] = self.audience
            try:
                reply = self._fetch(extra)
            except Exception as exc:  # noqa: BLE001 - any failure here means "not sent"
                raise AuthUnavailable(
                    f"OAuth2 token request to {self.token_url} failed: {type(exc).__name__}"
                    f"{': ' + _short(exc) if str(exc) else ''}"
                ) from None
            access = reply.get("access_token")
            if not isinstance(access, str) or not access:
                raise AuthUnavailable(f"the token reply of {self.token_url} has no access_token")
            self.fetches += 1
            self._token = Secret(access)
            self._seen.append(self._token)
            if self.on_new_secret is not None:
                self.on_new_secret(self._token)
            expires_in = reply.get("expires_in")
            if isinstance(expires_in, int | float) and not isinstance(expires_in, bool):
                self._expires_at = now + max(0.0, float(expires_in) - self.refresh_leeway_seconds)
            else:
                self._expires_at = None  # no expiry given: reuse until a 401
            return access

    def apply(self, headers: dict[str, str], params: dict[str, str]) -> None:
        headers["Authorization"] = f"Bearer {self.token()}"

    def rejected(self) -> None:
        with self._lock:
            self._token = None
            self._expires_at = None

    def secrets(self) -> list[Secret]:
        return [self.client_secret, *self._seen]

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def _short(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
