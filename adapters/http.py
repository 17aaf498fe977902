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
  variable (read once, at construction), or whatever the ``auth`` object adds
  (``adapters.auth``: bearer, basic, API key, OAuth2 client credentials).

With a ``body`` template (``adapters.templates``) the body is the template
rendered from the payload and the effect key instead of the payload itself,
and ``body_format = "form"`` sends it ``application/x-www-form-urlencoded``
(nested tables as ``a[b]=v``, arrays as ``a[0]=v``, the convention of Stripe
and Twilio). ``classify_rules`` are the provider's own exceptions to the
classification table, tried in order before it. A ``rate_limit`` makes
every thread wait for a slot before sending (``adapters.ratelimit``). Every
error text the adapter returns passes through its ``Redactor``: no secret
value leaves it.

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
from urllib.parse import quote, urlencode, urlsplit

import httpx

from adapters import auth as auth_kinds
from adapters import classify, ratelimit, templates
from adapters.errors import AdapterClosed, ConfigError, PayloadError
from adapters.protocol import Capabilities, DeliveryRequest, DeliveryResult, LookupResult
from adapters.secrets import REDACTED, Redactor, Secret

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
LOOKUP_METHODS = ("GET", "POST")
BODY_FORMATS = ("json", "form")
LOOKUP_BY = ("key", "client_reference", "reference")
LOOKUP_FIELDS = frozenset({"effect_key", "reference"})
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # an HTTP header name (RFC 9110 token)
_LEGACY_PLACEHOLDER = re.compile(r"(?<!\{)\{(effect_key|reference)\}(?!\})")


def _utcnow() -> datetime:
    return datetime.now(UTC)


@dataclasses.dataclass(frozen=True, slots=True)
class HttpAdapterConfig:
    """Everything an ``HttpAdapter`` needs; ``validate(name)`` checks it."""

    url: str
    method: str = "POST"
    headers: Mapping[str, str | Secret] = dataclasses.field(default_factory=dict)
    auth_env: str | None = None  # env var holding a bearer token; never the token itself
    idempotency_header: str | None = IDEMPOTENCY_HEADER_DEFAULT
    # Dotted path in the body set to the effect key (the client reference we send).
    client_reference_field: str | None = CLIENT_REFERENCE_FIELD_DEFAULT
    # Dotted path in the reply holding the provider's reference.
    reference_field: str | None = REFERENCE_FIELD_DEFAULT
    lookup_url: str | None = None  # template with {{ effect_key }} and/or {{ reference }}
    lookup_list_field: str | None = LOOKUP_LIST_FIELD_DEFAULT  # dotted path to the result list
    connect_timeout: float = CONNECT_TIMEOUT_DEFAULT
    read_timeout: float = READ_TIMEOUT_DEFAULT
    total_timeout: float = TOTAL_TIMEOUT_DEFAULT
    capabilities: Capabilities = CAPABILITIES_DEFAULT
    max_connections: int = MAX_CONNECTIONS_DEFAULT
    # --- declarative requests (docs/adapters.md) ---
    body: Any = None  # a template (table, array or text); None: the payload itself
    body_format: str = "json"
    # {{ vars.NAME }}: constants; kept out of repr (one may be read from ${ENV}).
    vars: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False)
    auth: Any = None  # an ``adapters.auth`` object, secrets resolved
    classify_rules: tuple[classify.Override, ...] = ()
    lookup_by: str | None = None  # "key", "client_reference" or "reference"
    lookup_method: str = "GET"
    lookup_params: Mapping[str, str] = dataclasses.field(default_factory=dict)  # templates
    lookup_match: Mapping[str, str] = dataclasses.field(default_factory=dict)  # path: template
    lookup_match_contains: Mapping[str, str] = dataclasses.field(default_factory=dict)
    lookup_reference_field: str | None = None  # default: reference_field
    lookup_inconclusive_if: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    rate_limit: str | None = None  # "25/second"
    rate_limit_wait: float = ratelimit.RATE_LIMIT_WAIT_DEFAULT
    sample_payload: Mapping[str, Any] | None = None  # checked against the templates at start-up

    def validate(self, adapter: str) -> None:
        """Raise ``ConfigError`` naming the adapter, the field and the fix."""

        def fail(field: str, message: str) -> ConfigError:
            return ConfigError(message, adapter=adapter, field=field)

        _check_url(
            _render_probe(self.url, "url", fail, self.vars) if "{{" in self.url else self.url,
            "url",
            fail,
        )
        if self.method not in METHODS:
            raise fail("method", f"{self.method!r} is not one of {', '.join(METHODS)}")
        for name, value in self.headers.items():
            if not isinstance(name, str) or not _TOKEN.fullmatch(name):
                raise fail("headers", f"{name!r} is not a valid header name")
            if isinstance(value, Secret):
                continue
            if not isinstance(value, str) or not value.isascii() or not value.isprintable():
                raise fail("headers", f"the value of {name!r} must be printable ASCII text")
        reserved = {"authorization"} if (self.auth_env or self.auth is not None) else set()
        if self.idempotency_header:
            reserved.add(self.idempotency_header.lower())
        clash = sorted(n for n in self.headers if n.lower() in reserved)
        if clash:
            raise fail("headers", f"{clash[0]!r} is set by the adapter itself; remove it")
        if self.auth_env is not None and not self.auth_env:
            raise fail("auth_env", "must name an environment variable, or be left out")
        if self.auth_env is not None and self.auth is not None:
            raise fail("auth_env", "and an [auth] table both given; keep one")
        if self.idempotency_header is not None and not _TOKEN.fullmatch(self.idempotency_header):
            raise fail("idempotency_header", f"{self.idempotency_header!r} is not a header name")
        for field in (
            "client_reference_field",
            "reference_field",
            "lookup_list_field",
            "lookup_reference_field",
        ):
            if getattr(self, field) == "":
                raise fail(field, "must be a non-empty field name, or be left out")
        for field in ("connect_timeout", "read_timeout", "total_timeout", "rate_limit_wait"):
            seconds = getattr(self, field)
            if isinstance(seconds, bool) or not isinstance(seconds, int | float):
                raise fail(field, f"must be a number of seconds, not {seconds!r}")
            if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and "timeout" in field):
                raise fail(field, f"must be a number of seconds > 0, not {seconds!r}")
        if isinstance(self.max_connections, bool) or not isinstance(self.max_connections, int):
            raise fail("max_connections", f"must be an integer, not {self.max_connections!r}")
        if self.max_connections < 1:
            raise fail("max_connections", f"must be at least 1, not {self.max_connections}")
        if self.body_format not in BODY_FORMATS:
            raise fail(
                "body_format", f"{self.body_format!r} is not one of {', '.join(BODY_FORMATS)}"
            )
        if (
            self.body_format == "form"
            and self.body is not None
            and not isinstance(self.body, Mapping)
        ):
            raise fail("body", "a form-encoded body must be a table of fields")
        if self.rate_limit is not None:
            try:
                ratelimit.parse_rate(self.rate_limit)
            except ValueError:
                raise fail(
                    "rate_limit", f'{self.rate_limit!r} is not a rate; write e.g. "25/second"'
                ) from None
        if self.lookup_method not in LOOKUP_METHODS:
            raise fail("lookup_method", f"{self.lookup_method!r} is not one of GET, POST")
        if self.lookup_by is not None and self.lookup_by not in LOOKUP_BY:
            raise fail("lookup_by", f"{self.lookup_by!r} is not one of {', '.join(LOOKUP_BY)}")
        compiled = _compile_all(self, fail)
        if self.lookup_url is not None:
            roots = {p[0] for p in compiled.lookup_paths}
            probe = (
                compiled.lookup_url.render(
                    {"effect_key": "k", "reference": "r", "vars": dict(self.vars)}, quote=_quote
                )
                if compiled.lookup_url is not None
                else self.lookup_url
            )
            _check_url(probe, "lookup_url", fail)
            if not roots & LOOKUP_FIELDS:
                raise fail(
                    "lookup_url",
                    "must contain {effect_key} or {reference} (or {{ effect_key }}, "
                    "{{ reference }} in it or in lookup_params)",
                )
            if self.lookup_by == "reference" and "reference" not in roots:
                raise fail("lookup_by", 'is "reference" but the lookup never uses {{ reference }}')
            if self.lookup_by in ("key", "client_reference") and "effect_key" not in roots:
                raise fail(
                    "lookup_by",
                    f"is {self.lookup_by!r} but the lookup never uses {{{{ effect_key }}}}",
                )
        if self.capabilities.supports_lookup and self.lookup_url is None:
            raise fail("supports_lookup", "is true but there is no lookup_url; add one")
        if self.sample_payload is not None:
            _check_sample(self, compiled, fail)


def _quote(text: str, root: str) -> str:
    """A value put into a URL: nothing from an effect may add a path segment or a query."""
    # vars are the operator's own constants ("octo/hello" is two path segments).
    return quote(text, safe="/" if root == "vars" else "")


def _verbatim(text: str, root: str) -> str:
    return text


def _render_probe(
    template: str, field: str, fail: Callable[[str, str], ConfigError], variables: Mapping[str, Any]
) -> str:
    try:
        compiled = templates.compile_text(template)
    except templates.TemplateError as exc:
        raise fail(field, str(exc)) from None
    probe = {
        "payload": _Anything(),
        "effect_key": "k",
        "effect": "e",
        "tenant": "t",
        "operation_id": "o",
        "reference": "r",
        "vars": dict(variables),
    }
    try:
        return str(compiled.render(probe, quote=_quote))
    except templates.TemplateError as exc:
        raise fail(field, str(exc)) from None


class _Anything(dict[str, Any]):
    """Stands for a payload nobody has shown us: every field exists."""

    def __contains__(self, key: object) -> bool:
        return True

    def __getitem__(self, key: str) -> Any:
        return _Anything()

    def get(self, key: str, default: Any = None) -> Any:
        return _Anything()


@dataclasses.dataclass(frozen=True, slots=True)
class _Compiled:
    url: templates.Template
    headers: Mapping[str, templates.Template | Secret]
    body: Any
    lookup_url: templates.Template | None
    lookup_params: Mapping[str, templates.Template]
    lookup_match: Mapping[str, templates.Template]
    lookup_match_contains: Mapping[str, templates.Template]

    @property
    def lookup_paths(self) -> list[tuple[str, ...]]:
        paths = list(self.lookup_url.paths) if self.lookup_url is not None else []
        for group in (self.lookup_params, self.lookup_match, self.lookup_match_contains):
            for template in group.values():
                paths += template.paths
        return paths


def _legacy_lookup(url: str) -> str:
    """``{effect_key}`` (the first lookup syntax) as ``{{ effect_key }}``."""
    if "{{" in url:
        return url
    return _LEGACY_PLACEHOLDER.sub(lambda m: "{{ " + m.group(1) + " }}", url)


def _compile_all(config: HttpAdapterConfig, fail: Callable[[str, str], ConfigError]) -> _Compiled:
    def one(field: str, value: Any) -> Any:
        try:
            return templates.compile_value(value)
        except templates.TemplateError as exc:
            raise fail(field, str(exc)) from None

    lookup_url = None
    if config.lookup_url is not None:
        if "{{" not in config.lookup_url:
            _legacy_template_fields(config.lookup_url, fail)
        lookup_url = one("lookup_url", _legacy_lookup(config.lookup_url))
    headers: dict[str, templates.Template | Secret] = {}
    for name, value in config.headers.items():
        headers[name] = value if isinstance(value, Secret) else one(f"headers.{name}", value)
    compiled = _Compiled(
        url=one("url", config.url),
        headers=headers,
        body=one("body", config.body) if config.body is not None else None,
        lookup_url=lookup_url,
        lookup_params={k: one(f"lookup_params.{k}", v) for k, v in config.lookup_params.items()},
        lookup_match={k: one(f"lookup_match.{k}", v) for k, v in config.lookup_match.items()},
        lookup_match_contains={
            k: one(f"lookup_match_contains.{k}", v) for k, v in config.lookup_match_contains.items()
        },
    )
    # What each place may name: the body has no provider reference yet.
    for field, paths in (
        ("url", compiled.url.paths),
        ("body", templates.value_paths(compiled.body)),
        *((f"headers.{n}", t.paths) for n, t in headers.items() if not isinstance(t, Secret)),
    ):
        for path in paths:
            if path[0] == "reference":
                raise fail(field, "{{ reference }} exists only in lookups")
    for path in compiled.lookup_paths:
        if path[0] in ("payload", "effect", "tenant", "operation_id"):
            raise fail(
                "lookup_url",
                f"{{{{ {'.'.join(path)} }}}}: a lookup knows only effect_key, reference and vars",
            )
    for field, paths in (
        ("url", compiled.url.paths),
        ("body", templates.value_paths(compiled.body)),
        ("lookup_url", compiled.lookup_paths),
    ):
        for path in paths:
            if path[0] == "vars" and (len(path) < 2 or path[1] not in config.vars):
                name = ".".join(path)
                raise fail(field, f"{{{{ {name} }}}} names a var that is not set; add it to vars")
    return compiled


def _check_sample(
    config: HttpAdapterConfig, compiled: _Compiled, fail: Callable[[str, str], ConfigError]
) -> None:
    values = _values_for(
        config, config.sample_payload or {}, "sample-effect-key", "sample", "t", "o"
    )
    for field, template in (
        ("url", compiled.url),
        *((f"headers.{n}", t) for n, t in compiled.headers.items()),
    ):
        if isinstance(template, Secret):
            continue
        try:
            template.render(values, quote=_quote)
        except templates.TemplateError as exc:
            raise fail(field, f"{exc} (checked against sample_payload)") from None
    if compiled.body is not None:
        _render_body(
            compiled.body,
            values,
            lambda where, msg: fail(where, msg + " (checked against sample_payload)"),
        )


def _render_body(
    compiled: Any,
    values: Mapping[str, Any],
    fail: Callable[[str, str], Exception],
    where: str = "body",
) -> Any:
    """``templates.render_value`` that says which key of the body failed."""
    if isinstance(compiled, templates.Template):
        try:
            return compiled.render(values)
        except templates.TemplateError as exc:
            raise fail(where, str(exc)) from None
    if isinstance(compiled, Mapping):
        return {k: _render_body(v, values, fail, f"{where}.{k}") for k, v in compiled.items()}
    if isinstance(compiled, list):
        return [_render_body(v, values, fail, f"{where}.{i}") for i, v in enumerate(compiled)]
    return compiled


def _values_for(
    config: HttpAdapterConfig,
    payload: Mapping[str, Any],
    effect_key: str,
    effect: str,
    tenant: str,
    operation_id: str,
) -> dict[str, Any]:
    return {
        "payload": payload,
        "effect_key": effect_key,
        "effect": effect,
        "tenant": tenant,
        "operation_id": operation_id,
        "vars": dict(config.vars),
    }


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


def _legacy_template_fields(template: str, fail: Callable[[str, str], ConfigError]) -> set[str]:
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


def form_encode(body: Mapping[str, Any]) -> list[tuple[str, str]]:
    """A nested table as form fields: ``a[b]=v`` for tables, ``a[0]=v`` for arrays.

    The bracket convention Stripe and Twilio document; booleans are ``true`` /
    ``false``, null is the empty string (Stripe's "unset"). Order is kept.
    """
    pairs: list[tuple[str, str]] = []

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for key, inner in value.items():
                walk(f"{prefix}[{key}]" if prefix else str(key), inner)
        elif isinstance(value, list | tuple):
            for index, inner in enumerate(value):
                walk(f"{prefix}[{index}]", inner)
        elif isinstance(value, bool):
            pairs.append((prefix, "true" if value else "false"))
        elif value is None:
            pairs.append((prefix, ""))
        elif isinstance(value, int | float | str):
            pairs.append((prefix, str(value)))
        else:
            raise TypeError(f"{prefix}: {type(value).__name__} cannot be a form field")

    walk("", body)
    return pairs


@dataclasses.dataclass(frozen=True, slots=True)
class _Reply:
    status_code: int
    headers: httpx.Headers
    body: bytes
    failure: str | None  # why the body could not be read in full, if it could not


@dataclasses.dataclass(frozen=True, slots=True)
class PreparedRequest:
    """What ``deliver`` would send, with every secret shown as ``***`` (for ``adapters check``)."""

    method: str
    url: str
    headers: list[tuple[str, str]]
    body: str

    def render(self) -> str:
        lines = [f"{self.method} {self.url}"]
        lines += [f"{name}: {value}" for name, value in self.headers]
        return "\n".join([*lines, "", self.body])


class HttpAdapter:
    """An ``Adapter`` for an HTTP provider. See the module docstring."""

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
        self._auth: Any = config.auth
        if config.auth_env:
            token = (os.environ if env is None else env).get(config.auth_env, "")
            if not token:
                raise ConfigError(
                    f"environment variable {config.auth_env} is not set; "
                    "set it to the provider's bearer token",
                    adapter=name,
                    field="auth_env",
                )
            self._auth = auth_kinds.BearerAuth(Secret(token))
        self._redact = Redactor()
        if self._auth is not None:
            for secret in self._auth.secrets():
                self._redact.add(secret)
            if isinstance(self._auth, auth_kinds.OAuth2ClientCredentials):
                self._auth.on_new_secret = self._redact.add
        for value in config.headers.values():
            if isinstance(value, Secret):
                self._redact.add(value)
        self._compiled = _compile_all(config, lambda f, m: ConfigError(m, adapter=name, field=f))
        self._lookup_roots = {p[0] for p in self._compiled.lookup_paths}
        self._limiter = (
            ratelimit.RateLimiter(config.rate_limit, max_wait=config.rate_limit_wait, key=name)
            if config.rate_limit
            else None
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
            trust_env=False,  # no proxy or netrc credentials picked up from the host
        )

    def __repr__(self) -> str:
        return f"HttpAdapter(name={self.name!r}, url={self._redact(self.config.url)!r})"

    @property
    def auth(self) -> Any:
        """The ``adapters.auth`` object in use, or None."""
        return self._auth

    def redact(self, text: str) -> str:
        """``text`` with every secret this adapter knows replaced by ``***``."""
        return self._redact(text)

    # -- deliver -----------------------------------------------------------

    def deliver(self, request: DeliveryRequest) -> DeliveryResult:
        self._check_open()
        http_request = self._build_delivery(request)
        result = self._deliver_built(http_request)
        if result.error:
            result = dataclasses.replace(result, error=self._redact(result.error))
        return result

    def _deliver_built(self, http_request: httpx.Request) -> DeliveryResult:
        # Everything below happens after the send may have started: classify, never raise.
        reply_or_result = self._exchange(http_request)
        if isinstance(reply_or_result, DeliveryResult):
            return reply_or_result
        reply = reply_or_result
        if reply.status_code == 401 and self._auth is not None:
            self._auth.rejected()  # a cached token may be stale: fetch a new one next time
        result = None
        if self.config.classify_rules and reply.failure is None:
            result = classify.classify_overrides(
                self.config.classify_rules,
                reply.status_code,
                reply.headers,
                reply.body,
                reference_field=self.config.reference_field,
                now=self._now,
            )
        if result is None:
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

    def _request_parts(self, request: DeliveryRequest) -> tuple[str, dict[str, str], bytes, str]:
        """URL, headers (without credentials), body bytes and content type for ``request``."""
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
        values = _values_for(
            self.config,
            request.payload,
            key,
            request.effect,
            request.tenant,
            request.operation_id,
        )

        def fail(where: str, message: str) -> PayloadError:
            return PayloadError(
                f"adapter {self.name} {where}: {message}", adapter=self.name, effect_key=key
            )

        body_value: Any
        if self._compiled.body is None:
            body_value = dict(request.payload)
        else:
            body_value = _render_body(self._compiled.body, values, fail)
        field = self.config.client_reference_field
        if field is not None:
            if not isinstance(body_value, dict):
                raise fail("client_reference_field", "needs a body that is a table")
            present = templates.find_path(body_value, field)
            if present not in (None, key):
                raise PayloadError(
                    f"payload field {field!r} is reserved for the effect key and holds another value",
                    adapter=self.name,
                    effect_key=key,
                )
            templates.set_path(body_value, field, key)
        try:
            if self.config.body_format == "form":
                if not isinstance(body_value, Mapping):
                    raise TypeError("a form body must be a table")
                content = urlencode(form_encode(body_value)).encode("ascii")
                content_type = "application/x-www-form-urlencoded"
            else:
                # Canonical bytes: a provider comparing bodies under one key (422 on
                # a mismatch) must see the same request on every attempt, whatever
                # key order the payload came back from the database in.
                content = json.dumps(
                    body_value,
                    sort_keys=self._compiled.body is None,
                    separators=(",", ":"),
                    ensure_ascii=False,
                    allow_nan=False,
                ).encode("utf-8")
                content_type = "application/json"
        except (TypeError, ValueError) as exc:
            raise PayloadError(
                f"payload is not serialisable as {self.config.body_format}: {exc}",
                adapter=self.name,
                effect_key=key,
            ) from exc
        try:
            url = str(self._compiled.url.render(values, quote=_quote))
        except templates.TemplateError as exc:
            raise fail("url", str(exc)) from None
        # The configured headers may replace Accept and Content-Type (GitHub's media
        # type, Slack's charset); the key and the credentials are the adapter's.
        headers: dict[str, str] = {"Content-Type": content_type, "Accept": "application/json"}
        for name, template in self._compiled.headers.items():
            if isinstance(template, Secret):
                headers[name] = template.reveal()
                continue
            try:
                text = str(template.render(values, quote=_verbatim))
            except templates.TemplateError as exc:
                raise fail(f"headers.{name}", str(exc)) from None
            if not (text.isascii() and text.isprintable()):
                raise fail(f"headers.{name}", "renders to a value that is not printable ASCII")
            headers[name] = text
        if self.config.idempotency_header:
            headers[self.config.idempotency_header] = key
        return url, headers, content, content_type

    def _build_delivery(self, request: DeliveryRequest) -> httpx.Request:
        url, headers, content, _ = self._request_parts(request)
        return self._build(self.config.method, url, headers, content, request.effect_key)

    def _build(
        self,
        method: str,
        url: str,
        headers: dict[str, str],
        content: bytes | None,
        effect_key: str | None,
        params: dict[str, str] | None = None,
    ) -> httpx.Request:
        try:
            return self._client.build_request(
                method,
                url,
                content=content,
                headers=headers,
                params=params or None,
                timeout=self._timeout,
            )
        except Exception as exc:  # e.g. a key that cannot be a header value
            raise PayloadError(
                self._redact(f"request could not be built: {classify.describe_exception(exc)}"),
                adapter=self.name,
                effect_key=effect_key,
            ) from exc

    def prepare(self, request: DeliveryRequest) -> PreparedRequest:
        """The request ``deliver(request)`` would send, secrets as ``***``; nothing is sent.

        Credentials appear as the header or parameter they go in, with ``***``
        for the value (an OAuth2 token is not fetched for this).
        """
        url, headers, content, content_type = self._request_parts(request)
        params: dict[str, str] = {}
        if self._auth is not None:
            if isinstance(self._auth, auth_kinds.OAuth2ClientCredentials):
                headers["Authorization"] = f"Bearer {REDACTED}"
            else:
                self._auth.apply(headers, params)
        built = self._build(self.config.method, url, headers, content, request.effect_key, params)
        shown: list[tuple[str, str]] = []
        for name, value in built.headers.items():
            if name.lower() == "authorization" and " " in value:
                scheme = value.split(" ", 1)[0]
                value = f"{scheme} {REDACTED}"
            shown.append((name, self._redact(value)))
        body = content.decode("utf-8", errors="replace")
        return PreparedRequest(
            method=built.method,
            url=self._redact(str(built.url)),
            headers=shown,
            body=self._redact(body) if content_type else body,
        )

    # -- lookup ------------------------------------------------------------

    def lookup(self, effect_key: str, reference: str | None) -> LookupResult:
        self._check_open()
        result = self._lookup(effect_key, reference)
        if result.error:
            result = dataclasses.replace(result, error=self._redact(result.error))
        return result

    def _lookup_values(self, effect_key: str, reference: str | None) -> dict[str, Any]:
        return {
            "effect_key": effect_key,
            "reference": reference or "",
            "vars": dict(self.config.vars),
        }

    def build_lookup(self, effect_key: str, reference: str | None) -> httpx.Request:
        """The lookup request for this key (and reference); credentials not yet added."""
        assert self._compiled.lookup_url is not None
        values = self._lookup_values(effect_key, reference)
        url = str(self._compiled.lookup_url.render(values, quote=_quote))
        params = {k: str(t.render(values)) for k, t in self._compiled.lookup_params.items()}
        headers: dict[str, str] = {"Accept": "application/json"}
        for name, template in self._compiled.headers.items():
            if name.lower() == "content-type":
                continue  # the delivery's, not the lookup's
            if isinstance(template, Secret):
                headers[name] = template.reveal()
            elif not template.paths or all(p[0] in ("vars", "effect_key") for p in template.paths):
                headers[name] = str(template.render(values, quote=_verbatim))
        if self.config.lookup_method == "POST":
            return self._client.build_request(
                "POST", url, data=params or None, headers=headers, timeout=self._timeout
            )
        return self._client.build_request(
            "GET", url, params=params or None, headers=headers, timeout=self._timeout
        )

    def _lookup(self, effect_key: str, reference: str | None) -> LookupResult:
        if self._compiled.lookup_url is None:
            return LookupResult.inconclusive(f"adapter {self.name!r} has no lookup_url")
        if "reference" in self._lookup_roots and not reference:
            return LookupResult.inconclusive("the lookup needs a provider reference; there is none")
        try:
            http_request = self.build_lookup(effect_key, reference)
        except Exception as exc:  # noqa: BLE001 - a lookup never raises for a bad URL
            return LookupResult.inconclusive(classify.describe_exception(exc))
        reply = self._exchange(http_request)
        if isinstance(reply, DeliveryResult):
            return LookupResult.inconclusive(reply.error or "transport error")
        if reply.failure is not None:
            return LookupResult.inconclusive(f"HTTP {reply.status_code}; {reply.failure}")
        if reply.status_code == 401 and self._auth is not None:
            self._auth.rejected()
        if reply.status_code == 404 and "reference" in self._lookup_roots:
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
        return self._interpret_lookup(document, effect_key, reference)

    def _interpret_lookup(
        self, document: Any, effect_key: str, reference: str | None = None
    ) -> LookupResult:
        explicit = bool(self.config.lookup_match or self.config.lookup_match_contains)
        list_field = self.config.lookup_list_field
        items = templates.find_path(document, list_field) if list_field else None
        if list_field is not None and items is not None:
            if not isinstance(items, list):
                return LookupResult.inconclusive(
                    f"{list_field!r} in the lookup reply is not a list"
                )
            values = self._lookup_values(effect_key, reference)
            if explicit:
                matching = [item for item in items if self._matches(item, values)]
            else:
                matching = [item for item in items if self._carries_key(item, effect_key)]
            if not matching:
                unsure = self._inconclusive_reason(document)
                if unsure:
                    return LookupResult.inconclusive(unsure)
                if not items or explicit:
                    # An explicit match rule reads every item: none matching is an answer.
                    return LookupResult.not_found()
                # Items for other keys mean the provider ignored our filter: its
                # "no match" proves nothing, so this is not an authoritative not_found.
                return LookupResult.inconclusive(
                    f"the lookup returned {len(items)} item(s), none for this effect key"
                )
            if explicit and len(matching) > 1:
                return LookupResult.inconclusive(
                    f"{len(matching)} items match this effect key: a person should look"
                )
            document = matching[0]
        elif explicit:
            if not self._matches(document, self._lookup_values(effect_key, reference)):
                return LookupResult.inconclusive("the lookup reply does not match this effect")
        elif not self._carries_key(document, effect_key):
            return LookupResult.inconclusive("the lookup reply is for another effect key")
        field = self.config.lookup_reference_field or self.config.reference_field
        ref = classify.reference_in(document, field) if field else None
        if ref is None:
            return LookupResult.inconclusive(f"the lookup reply has no {field!r} reference")
        return LookupResult.found(ref)

    def _inconclusive_reason(self, document: Any) -> str | None:
        for path, expected in self.config.lookup_inconclusive_if.items():
            if templates.find_path(document, path) == expected:
                return f"the lookup reply has {path} = {json.dumps(expected)}: not complete"
        return None

    def _matches(self, item: Any, values: Mapping[str, Any]) -> bool:
        for path, template in self._compiled.lookup_match.items():
            found = templates.find_path(item, path)
            if found is None or str(found) != str(template.render(values)):
                return False
        for path, template in self._compiled.lookup_match_contains.items():
            found = templates.find_path(item, path)
            if not isinstance(found, str) or str(template.render(values)) not in found:
                return False
        return True

    def _carries_key(self, item: Any, effect_key: str) -> bool:
        """False only when the item names a different key; absent fields are trusted."""
        field = self.config.client_reference_field
        if not isinstance(item, dict):
            return False
        if field is None:
            return True
        found = templates.find_path(item, field)
        return found is None or found == effect_key

    # -- the exchange --------------------------------------------------------

    def _exchange(self, http_request: httpx.Request) -> _Reply | DeliveryResult:
        """Send and read the reply within total_timeout; a failed send is classified."""
        if self._limiter is not None and not self._limiter.acquire():
            return DeliveryResult.not_sent(
                f"rate limit {self.config.rate_limit} of adapter {self.name!r} reached here; "
                f"no slot within {self.config.rate_limit_wait}s"
            )
        if self._auth is not None:
            headers: dict[str, str] = {}
            params: dict[str, str] = {}
            try:
                self._auth.apply(headers, params)
            except auth_kinds.AuthUnavailable as exc:
                return DeliveryResult.not_sent(self._redact(str(exc)))
            for name, value in headers.items():
                http_request.headers[name] = value
            if params:
                http_request.url = http_request.url.copy_merge_params(params)
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
