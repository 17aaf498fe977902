"""``HttpAdapter``: deliver effects as JSON over HTTP, classify with ``classify``.

One ``httpx.Client`` per adapter, shared by every dispatcher thread (httpx's
connection pool is thread-safe), sized by ``max_connections``.

What goes on the wire for ``deliver(request)``:

- ``{method} {url}`` with the body ``payload`` plus
  ``{client_reference_field: effect_key}``, serialised canonically (sorted keys,
  no whitespace) so that every attempt of one effect sends identical bytes;
- the header ``{idempotency_header}: {effect_key}``. The adapter never makes up
  a key: the effect's key is the only one it sends;
- ``Authorization: Bearer <token>`` when ``auth_env`` names an environment
  variable (read once, at construction).

The request is built and checked before anything is sent; a problem there raises
``PayloadError``. Once the send has started, every problem is classified and
returned, never raised.

Timeouts. httpx bounds each phase separately (waiting for a pooled connection,
connecting, each write, each read), and has no overall limit. So each phase is
given ``min(its own timeout, total_timeout)`` (the pool wait uses the connect
timeout), and the body of the reply is read in chunks with a check of the
``total_timeout`` deadline after each one. A reply that trickles in past the
deadline is abandoned: its status is kept and the result says why. One blocking
read can still overrun the deadline by at most ``min(read_timeout,
total_timeout)``; that bound is the price of staying on httpx's synchronous API
without a watchdog thread.

Connections. At most ``max_connections`` requests are in flight per adapter; a
thread that finds them all busy waits up to ``connect_timeout`` for a slot and
then gets NOT_SENT (``PoolTimeout``). The slot is taken here, not in httpcore's
pool, for the reason given in ``_exchange``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import string
import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import Any
from urllib.parse import quote, urlsplit

import httpx

from adapters import classify
from adapters.errors import AdapterClosed, ConfigError, PayloadError
from adapters.protocol import Capabilities, DeliveryRequest, DeliveryResult, LookupResult

CONNECT_TIMEOUT_DEFAULT = 2.0
READ_TIMEOUT_DEFAULT = 10.0
TOTAL_TIMEOUT_DEFAULT = 15.0
MAX_CONNECTIONS_DEFAULT = 64
IDEMPOTENCY_HEADER_DEFAULT = "Idempotency-Key"
CLIENT_REFERENCE_FIELD_DEFAULT = "client_reference"
REFERENCE_FIELD_DEFAULT = "id"
LOOKUP_LIST_FIELD_DEFAULT = "tickets"
MAX_RESPONSE_BYTES = 1024 * 1024
"""Replies are read up to this size; a bigger one is abandoned (as unreadable)."""

CAPABILITIES_DEFAULT = Capabilities(honours_idempotency_keys=False, supports_lookup=False)
"""Promise nothing unless the configuration says so: ambiguous sends go to review."""

METHODS = ("POST", "PUT", "PATCH")
LOOKUP_FIELDS = frozenset({"effect_key", "reference"})
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # an HTTP header name (RFC 9110 token)


def _utcnow() -> datetime:
    return datetime.now(UTC)


@dataclasses.dataclass(frozen=True, slots=True)
class HttpAdapterConfig:
    """Everything an ``HttpAdapter`` needs; ``validate(name)`` checks it."""

    url: str
    method: str = "POST"
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    auth_env: str | None = None  # env var holding a bearer token; never the token itself
    idempotency_header: str | None = IDEMPOTENCY_HEADER_DEFAULT
    client_reference_field: str | None = CLIENT_REFERENCE_FIELD_DEFAULT  # body field for the key
    reference_field: str | None = REFERENCE_FIELD_DEFAULT  # reply field with the provider's ref
    lookup_url: str | None = None  # template with {effect_key} and/or {reference}
    lookup_list_field: str | None = LOOKUP_LIST_FIELD_DEFAULT
    connect_timeout: float = CONNECT_TIMEOUT_DEFAULT
    read_timeout: float = READ_TIMEOUT_DEFAULT
    total_timeout: float = TOTAL_TIMEOUT_DEFAULT
    capabilities: Capabilities = CAPABILITIES_DEFAULT
    max_connections: int = MAX_CONNECTIONS_DEFAULT

    def validate(self, adapter: str) -> None:
        """Raise ``ConfigError`` naming the adapter, the field and the fix."""

        def fail(field: str, message: str) -> ConfigError:
            return ConfigError(message, adapter=adapter, field=field)

        _check_url(self.url, "url", fail)
        if self.method not in METHODS:
            raise fail("method", f"{self.method!r} is not one of {', '.join(METHODS)}")
        for name, value in self.headers.items():
            if not isinstance(name, str) or not _TOKEN.fullmatch(name):
                raise fail("headers", f"{name!r} is not a valid header name")
            if not isinstance(value, str) or not value.isascii() or not value.isprintable():
                raise fail("headers", f"the value of {name!r} must be printable ASCII text")
        reserved = {"authorization"} if self.auth_env else set()
        if self.idempotency_header:
            reserved.add(self.idempotency_header.lower())
        clash = sorted(n for n in self.headers if n.lower() in reserved)
        if clash:
            raise fail("headers", f"{clash[0]!r} is set by the adapter itself; remove it")
        if self.auth_env is not None and not self.auth_env:
            raise fail("auth_env", "must name an environment variable, or be left out")
        if self.idempotency_header is not None and not _TOKEN.fullmatch(self.idempotency_header):
            raise fail("idempotency_header", f"{self.idempotency_header!r} is not a header name")
        for field in ("client_reference_field", "reference_field", "lookup_list_field"):
            if getattr(self, field) == "":
                raise fail(field, "must be a non-empty field name, or be left out")
        for field in ("connect_timeout", "read_timeout", "total_timeout"):
            seconds = getattr(self, field)
            if isinstance(seconds, bool) or not isinstance(seconds, int | float):
                raise fail(field, f"must be a number of seconds, not {seconds!r}")
            if not math.isfinite(seconds) or seconds <= 0:
                raise fail(field, f"must be a number of seconds > 0, not {seconds!r}")
        if isinstance(self.max_connections, bool) or not isinstance(self.max_connections, int):
            raise fail("max_connections", f"must be an integer, not {self.max_connections!r}")
        if self.max_connections < 1:
            raise fail("max_connections", f"must be at least 1, not {self.max_connections}")
        if self.lookup_url is not None:
            fields = _template_fields(self.lookup_url, fail)
            _check_url(self.lookup_url.format(effect_key="k", reference="r"), "lookup_url", fail)
            if not fields:
                raise fail("lookup_url", "must contain {effect_key} or {reference}")
        if self.capabilities.supports_lookup and self.lookup_url is None:
            raise fail("supports_lookup", "is true but there is no lookup_url; add one")


def _check_url(url: str, field: str, fail: Callable[[str, str], ConfigError]) -> None:
    try:
        parts = urlsplit(url)
        hostname = parts.hostname
    except ValueError as exc:
        raise fail(field, f"{url!r} is not a URL ({exc})") from exc
    if parts.scheme not in ("http", "https"):
        raise fail(field, f"{url!r} must start with http:// or https://")
    if not hostname:
        raise fail(field, f"{url!r} has no host")
    if parts.username is not None or parts.password is not None:
        raise fail(field, "must not carry credentials; name an environment variable in auth_env")


def _template_fields(template: str, fail: Callable[[str, str], ConfigError]) -> set[str]:
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as exc:
        raise fail("lookup_url", f"is not a valid template ({exc})") from exc
    unknown = names - LOOKUP_FIELDS
    if unknown:
        raise fail(
            "lookup_url",
            f"unknown placeholder {{{min(unknown)}}}; use {{effect_key}} or {{reference}}",
        )
    return names


@dataclasses.dataclass(frozen=True, slots=True)
class _Reply:
    status_code: int
    headers: httpx.Headers
    body: bytes
    failure: str | None  # why the body could not be read in full, if it could not


class HttpAdapter:
    """An ``Adapter`` for a JSON-over-HTTP provider. See the module docstring."""

    def __init__(
        self,
        name: str,
        config: HttpAdapterConfig,
        client: httpx.Client | None = None,
        transport: httpx.BaseTransport | None = None,
        *,
        env: Mapping[str, str] | None = None,
        now: Callable[[], datetime] = _utcnow,
    ) -> None:
        if not name:
            raise ConfigError("an adapter needs a non-empty name")
        config.validate(name)
        if client is not None and transport is not None:
            raise ValueError("pass a client or a transport, not both")
        self.name = name
        self.config = config
        self.capabilities = config.capabilities
        self._now = now
        self._auth: dict[str, str] = {}
        if config.auth_env:
            token = (os.environ if env is None else env).get(config.auth_env, "")
            if not token:
                raise ConfigError(
                    f"environment variable {config.auth_env} is not set; "
                    "set it to the provider's bearer token",
                    adapter=name,
                    field="auth_env",
                )
            self._auth = {"Authorization": f"Bearer {token}"}
        self._lookup_fields = (
            _template_fields(config.lookup_url, lambda f, m: ConfigError(m))
            if config.lookup_url
            else set()
        )
        self._owns_client = client is None
        self._client = client if client is not None else self._make_client(transport)
        self._timeout = httpx.Timeout(
            connect=min(config.connect_timeout, config.total_timeout),
            read=min(config.read_timeout, config.total_timeout),
            write=min(config.read_timeout, config.total_timeout),
            pool=min(config.connect_timeout, config.total_timeout),
        )
        self._slots = threading.BoundedSemaphore(config.max_connections)
        self._close_lock = threading.Lock()
        self._closed = False

    def _make_client(self, transport: httpx.BaseTransport | None) -> httpx.Client:
        limits = httpx.Limits(
            max_connections=self.config.max_connections,
            max_keepalive_connections=self.config.max_connections,
        )
        return httpx.Client(
            transport=transport,
            limits=limits,
            follow_redirects=False,  # a 3xx is classified, never followed with our key
            # Refuse cookies: one client serves every tenant, so nothing a reply
            # sets may ride along on the next tenant's request.
            cookies=CookieJar(policy=DefaultCookiePolicy(allowed_domains=[])),
            headers={"User-Agent": f"outbox-adapter/{self.name}"},
        )

    def __repr__(self) -> str:
        return f"HttpAdapter(name={self.name!r}, url={self.config.url!r})"

    # -- deliver -----------------------------------------------------------

    def deliver(self, request: DeliveryRequest) -> DeliveryResult:
        self._check_open()
        http_request = self._build_delivery(request)
        # Everything below happens after the send may have started: classify, never raise.
        reply_or_result = self._exchange(http_request)
        if isinstance(reply_or_result, DeliveryResult):
            return reply_or_result
        reply = reply_or_result
        result = classify.classify_status(
            reply.status_code,
            reply.headers,
            reply.body,
            reference_field=self.config.reference_field,
            now=self._now,
        )
        if reply.failure is not None:
            error = result.error or f"HTTP {reply.status_code}"
            result = dataclasses.replace(result, error=f"{error}; {reply.failure}")
        return result

    def _build_delivery(self, request: DeliveryRequest) -> httpx.Request:
        key = request.effect_key
        if not isinstance(key, str) or not key:
            raise PayloadError(
                f"effect {request.effect_id} has no effect_key", adapter=self.name, effect_key=None
            )
        if self.config.idempotency_header and not (key.isascii() and key.isprintable()):
            # Caught here, not by h11 mid-send, where it would look ambiguous.
            raise PayloadError(
                f"effect key {key!r} cannot be a header value (printable ASCII only)",
                adapter=self.name,
                effect_key=key,
            )
        if not isinstance(request.payload, Mapping):
            raise PayloadError(
                f"payload must be a JSON object, not {type(request.payload).__name__}",
                adapter=self.name,
                effect_key=key,
            )
        body: dict[str, Any] = dict(request.payload)
        field = self.config.client_reference_field
        if field is not None:
            if body.get(field, key) != key:
                raise PayloadError(
                    f"payload field {field!r} is reserved for the effect key and holds another value",
                    adapter=self.name,
                    effect_key=key,
                )
            body[field] = key
        try:
            # Canonical bytes: a provider comparing bodies under one key (422 on
            # a mismatch) must see the same request on every attempt, whatever
            # key order the payload came back from the database in.
            content = json.dumps(
                body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
            ).encode("utf-8")
        except (TypeError, ValueError) as exc:
            raise PayloadError(
                f"payload is not JSON-serialisable: {exc}", adapter=self.name, effect_key=key
            ) from exc
        headers = {
            **self.config.headers,
            "Content-Type": "application/json",
            "Accept": "application/json",
            **self._auth,
        }
        if self.config.idempotency_header:
            headers[self.config.idempotency_header] = key
        try:
            return self._client.build_request(
                self.config.method,
                self.config.url,
                content=content,
                headers=headers,
                timeout=self._timeout,
            )
        except Exception as exc:  # e.g. a key that cannot be a header value
            raise PayloadError(
                f"request could not be built: {classify.describe_exception(exc)}",
                adapter=self.name,
                effect_key=key,
            ) from exc

    # -- lookup ------------------------------------------------------------

    def lookup(self, effect_key: str, reference: str | None) -> LookupResult:
        self._check_open()
        template = self.config.lookup_url
        if template is None:
            return LookupResult.inconclusive(f"adapter {self.name!r} has no lookup_url")
        if "reference" in self._lookup_fields and not reference:
            return LookupResult.inconclusive("the lookup needs a provider reference; there is none")
        url = template.format(
            effect_key=quote(effect_key, safe=""), reference=quote(reference or "", safe="")
        )
        try:
            http_request = self._client.build_request(
                "GET",
                url,
                headers={**self.config.headers, "Accept": "application/json", **self._auth},
                timeout=self._timeout,
            )
        except Exception as exc:  # noqa: BLE001 - a lookup never raises for a bad URL
            return LookupResult.inconclusive(classify.describe_exception(exc))
        reply = self._exchange(http_request)
        if isinstance(reply, DeliveryResult):
            return LookupResult.inconclusive(reply.error or "transport error")
        if reply.failure is not None:
            return LookupResult.inconclusive(f"HTTP {reply.status_code}; {reply.failure}")
        if reply.status_code == 404 and "reference" in self._lookup_fields:
            return LookupResult.not_found()  # lookup by id: the provider has no such record
        if not 200 <= reply.status_code <= 299:
            excerpt = classify.body_excerpt(reply.body)
            return LookupResult.inconclusive(f"HTTP {reply.status_code}: {excerpt}".rstrip(": "))
        try:
            document: Any = json.loads(reply.body)
        except ValueError:
            return LookupResult.inconclusive(
                f"HTTP {reply.status_code} with a body that is not JSON: "
                f"{classify.body_excerpt(reply.body)}"
            )
        return self._interpret_lookup(document, effect_key)

    def _interpret_lookup(self, document: Any, effect_key: str) -> LookupResult:
        list_field = self.config.lookup_list_field
        if list_field is not None and isinstance(document, dict) and list_field in document:
            items = document[list_field]
            if not isinstance(items, list):
                return LookupResult.inconclusive(
                    f"{list_field!r} in the lookup reply is not a list"
                )
            if not items:
                return LookupResult.not_found()
            matching = [item for item in items if self._carries_key(item, effect_key)]
            if not matching:
                # Items for other keys mean the provider ignored our filter: its
                # "no match" proves nothing, so this is not an authoritative not_found.
                return LookupResult.inconclusive(
                    f"the lookup returned {len(items)} item(s), none for this effect key"
                )
            document = matching[0]
        elif not self._carries_key(document, effect_key):
            return LookupResult.inconclusive("the lookup reply is for another effect key")
        field = self.config.reference_field
        ref = classify.reference_in(document, field) if field else None
        if ref is None:
            return LookupResult.inconclusive(f"the lookup reply has no {field!r} reference")
        return LookupResult.found(ref)

    def _carries_key(self, item: Any, effect_key: str) -> bool:
        """False only when the item names a different key; absent fields are trusted."""
        field = self.config.client_reference_field
        if not isinstance(item, dict):
            return False
        return field is None or field not in item or item[field] == effect_key

    # -- the exchange --------------------------------------------------------

    def _exchange(self, http_request: httpx.Request) -> _Reply | DeliveryResult:
        """Send and read the reply within total_timeout; a failed send is classified."""
        deadline = time.monotonic() + self.config.total_timeout
        # Never queue inside httpcore's pool: with more threads than connections,
        # httpcore 1.0.9 can close a connection it has just handed to a queued
        # request (encode/httpcore#1110), which shows up as ReadError (EBADF) or
        # a hang until the read timeout: false AMBIGUOUS results. Waiting here
        # instead is bounded like httpx's pool wait, and nothing has been sent.
        if not self._slots.acquire(timeout=self._timeout.pool or 0.0):
            return DeliveryResult.not_sent(
                f"PoolTimeout: all {self.config.max_connections} connections stayed busy "
                f"for {self._timeout.pool}s"
            )
        try:
            return self._exchange_in_slot(http_request, deadline)
        finally:
            self._slots.release()

    def _exchange_in_slot(
        self, http_request: httpx.Request, deadline: float
    ) -> _Reply | DeliveryResult:
        try:
            response = self._client.send(http_request, stream=True)
        except Exception as exc:  # noqa: BLE001 - raised once the send began: classify it
            return classify.classify_exception(
                exc, reference_field=self.config.reference_field, now=self._now
            )
        chunks: list[bytes] = []
        size = 0
        failure: str | None = None
        try:
            for chunk in response.iter_bytes():
                chunks.append(chunk)
                size += len(chunk)
                if size > MAX_RESPONSE_BYTES:
                    failure = f"reply body larger than {MAX_RESPONSE_BYTES} bytes, abandoned"
                    break
                if time.monotonic() > deadline:
                    failure = f"total_timeout of {self.config.total_timeout}s passed while reading the body"
                    break
        except Exception as exc:  # noqa: BLE001 - the status is known; keep it, note why
            failure = f"body not read: {classify.describe_exception(exc)}"
        finally:
            response.close()
        return _Reply(response.status_code, response.headers, b"".join(chunks), failure)

    # -- lifecycle -----------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed or self._client.is_closed:
            raise AdapterClosed(self.name)

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self._owns_client:
            self._client.close()
