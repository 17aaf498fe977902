"""Build the adapter ``Registry`` from a TOML file.

Where the file is: the ``path`` argument, else the ``OUTBOX_ADAPTERS``
environment variable, else nothing, and then the built-in default is used: one
``helpdesk`` adapter for the fake provider on ``http://127.0.0.1:9000``.

The format (``adapters/example.toml`` has every key)::

    [adapters.helpdesk]
    kind = "helpdesk"                 # "http", "helpdesk" (http preset) or "noop"
    base_url = "http://127.0.0.1:9000"

    [adapters.crm]
    kind = "http"
    url = "https://crm.example.com/v1/notes"
    honours_idempotency_keys = false  # required for kind "http": say what the provider promises
    auth_env = "CRM_TOKEN"

Every mistake (an unknown key, a wrong type, a missing url, a bad URL scheme) is
a ``ConfigError`` whose message names the adapter, the field and the fix.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import httpx

from adapters import helpdesk, testing, webhooks
from adapters.errors import ConfigError
from adapters.http import HttpAdapter, HttpAdapterConfig
from adapters.protocol import Adapter, Capabilities
from adapters.registry import Registry

ADAPTERS_ENV = "OUTBOX_ADAPTERS"
"""Environment variable naming the adapters TOML file."""

KINDS = ("http", "helpdesk", "noop")

_CAPABILITY_KEYS = {"honours_idempotency_keys", "supports_lookup", "lookup_settle_seconds"}
_HTTP_KEYS = {
    "kind",
    "url",
    "method",
    "headers",
    "auth_env",
    "idempotency_header",
    "client_reference_field",
    "reference_field",
    "lookup_url",
    "lookup_list_field",
    "connect_timeout",
    "read_timeout",
    "total_timeout",
    "max_connections",
} | _CAPABILITY_KEYS
_KEYS_BY_KIND: Mapping[str, frozenset[str]] = {
    "http": frozenset(_HTTP_KEYS),
    "helpdesk": frozenset(_HTTP_KEYS | {"base_url"}),
    "noop": frozenset({"kind"}),
}
# --- webhooks: their own block; adapters/webhooks.py owns and reads these keys ---
_KEYS_BY_KIND = {kind: keys | webhooks.KEYS for kind, keys in _KEYS_BY_KIND.items()}
# --- end of webhooks ---
_T = TypeVar("_T")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def load_registry(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    transport: httpx.BaseTransport | None = None,
) -> Registry:
    """The registry described by ``path`` (or ``$OUTBOX_ADAPTERS``, or the default).

    ``env`` replaces ``os.environ`` (for the file path and for ``auth_env``
    tokens); ``transport`` is given to every HTTP adapter (tests pass an
    ``httpx.MockTransport`` or a respx router's).
    """
    environ = os.environ if env is None else env
    if path is None:
        path = environ.get(ADAPTERS_ENV) or None
    if path is None:
        return Registry([helpdesk.helpdesk_adapter(transport=transport, env=environ)])
    source = Path(path)
    try:
        text = source.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            f"cannot read the adapters file {str(source)!r} ({exc.strerror}); "
            f"fix the path given in {ADAPTERS_ENV} or as an argument"
        ) from exc
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{str(source)!r} is not valid TOML: {exc}") from exc
    return registry_from_document(document, env=environ, transport=transport, source=str(source))


def registry_from_document(
    document: Mapping[str, Any],
    *,
    env: Mapping[str, str] | None = None,
    transport: httpx.BaseTransport | None = None,
    source: str = "<config>",
) -> Registry:
    """The registry for an already parsed TOML document (see the module docstring)."""
    extra = sorted(set(document) - {"adapters"})
    if extra:
        raise ConfigError(
            f"{source}: unknown top-level key {extra[0]!r}; "
            "put each adapter in its own [adapters.NAME] table"
        )
    tables = document.get("adapters")
    if not isinstance(tables, dict) or not tables:
        raise ConfigError(f"{source}: no adapters configured; add an [adapters.NAME] table")
    registry = Registry()
    try:
        for name, table in tables.items():
            registry.register(_build(name, table, env=env, transport=transport))
            # --- webhooks (adapters/webhooks.py) ---
            webhook = webhooks.from_table(name, table, os.environ if env is None else env)
            if webhook is not None:
                registry.webhooks[name] = webhook
    except BaseException:
        registry.close()  # do not leak the connection pools already made
        raise
    return registry


def _build(
    name: str,
    table: Any,
    *,
    env: Mapping[str, str] | None,
    transport: httpx.BaseTransport | None,
) -> Adapter:
    if not _NAME.fullmatch(name):
        raise ConfigError(
            "is not a usable adapter name; use letters, digits, '_', '-' and '.'", adapter=name
        )
    if not isinstance(table, dict):
        raise ConfigError(f"must be a table ([adapters.{name}]), not a value", adapter=name)
    spec = _Spec(name, table)
    kind = spec.string("kind")
    if kind is None:
        raise ConfigError(
            f"is missing; set kind = one of {', '.join(KINDS)}", adapter=name, field="kind"
        )
    if kind not in KINDS:
        raise ConfigError(f"{kind!r} is not one of {', '.join(KINDS)}", adapter=name, field="kind")
    spec.reject_unknown(_KEYS_BY_KIND[kind], kind)
    if kind == "noop":
        return testing.NoopAdapter(name=name)
    if kind == "helpdesk":
        base_url = spec.string("base_url") or helpdesk.BASE_URL_DEFAULT
        base = helpdesk.helpdesk_config(base_url)
    else:
        url = spec.string("url")
        if url is None:
            raise ConfigError(
                "is missing; set url = the endpoint to POST to", adapter=name, field="url"
            )
        if spec.boolean("honours_idempotency_keys") is None:
            raise ConfigError(
                "is missing; say whether the provider honours idempotency keys "
                "(true: a resend with the same key never makes a second effect)",
                adapter=name,
                field="honours_idempotency_keys",
            )
        base = HttpAdapterConfig(url=url, lookup_url=None)
    config = _http_config(spec, base)
    return HttpAdapter(name, config, transport=transport, env=env)


def _http_config(spec: _Spec, base: HttpAdapterConfig) -> HttpAdapterConfig:
    lookup_url = spec.switchable("lookup_url", base.lookup_url)
    capabilities = Capabilities(
        honours_idempotency_keys=_default(
            spec.boolean("honours_idempotency_keys"), base.capabilities.honours_idempotency_keys
        ),
        supports_lookup=_default(
            spec.boolean("supports_lookup"),
            base.capabilities.supports_lookup if base.lookup_url else lookup_url is not None,
        ),
        lookup_settle_seconds=_default(
            spec.number("lookup_settle_seconds", minimum=0.0),
            base.capabilities.lookup_settle_seconds,
        ),
    )
    return HttpAdapterConfig(
        url=_default(spec.string("url"), base.url),
        method=_default(spec.string("method"), base.method),
        headers=_default(spec.headers("headers"), base.headers),
        auth_env=spec.string("auth_env"),
        idempotency_header=spec.switchable("idempotency_header", base.idempotency_header),
        client_reference_field=spec.switchable(
            "client_reference_field", base.client_reference_field
        ),
        reference_field=spec.switchable("reference_field", base.reference_field),
        lookup_url=lookup_url,
        lookup_list_field=spec.switchable("lookup_list_field", base.lookup_list_field),
        connect_timeout=_default(spec.number("connect_timeout"), base.connect_timeout),
        read_timeout=_default(spec.number("read_timeout"), base.read_timeout),
        total_timeout=_default(spec.number("total_timeout"), base.total_timeout),
        capabilities=capabilities,
        max_connections=_default(spec.integer("max_connections"), base.max_connections),
    )


def _default(value: _T | None, fallback: _T) -> _T:
    return fallback if value is None else value


class _Spec:
    """Typed reads of one [adapters.NAME] table; each mistake names the field."""

    def __init__(self, adapter: str, table: Mapping[str, Any]) -> None:
        self.adapter = adapter
        self.table = table

    def fail(self, field: str, message: str) -> ConfigError:
        return ConfigError(message, adapter=self.adapter, field=field)

    def reject_unknown(self, allowed: frozenset[str], kind: str) -> None:
        for key in sorted(set(self.table) - allowed):
            close = difflib.get_close_matches(key, sorted(allowed), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise self.fail(key, f"is not a setting of a {kind!r} adapter{hint}")

    def _typed(self, field: str, check: Callable[[Any], bool], what: str) -> Any:
        if field not in self.table:
            return None
        value = self.table[field]
        if not check(value):
            raise self.fail(field, f"must be {what}, not {value!r}")
        return value

    def string(self, field: str) -> str | None:
        value: str | None = self._typed(field, lambda v: isinstance(v, str) and v != "", "text")
        return value

    def switchable(self, field: str, fallback: str | None) -> str | None:
        """Text, or ``false`` to switch the feature off; absent keeps ``fallback``."""
        value = self._typed(
            field,
            lambda v: (isinstance(v, str) and v != "") or v is False,
            "text, or false to switch it off",
        )
        if value is None:
            return fallback
        return None if value is False else str(value)

    def boolean(self, field: str) -> bool | None:
        value: bool | None = self._typed(field, lambda v: isinstance(v, bool), "true or false")
        return value

    def number(self, field: str, *, minimum: float | None = None) -> float | None:
        def check(v: Any) -> bool:
            return (
                isinstance(v, int | float)
                and not isinstance(v, bool)
                and math.isfinite(v)
                and (v > 0 if minimum is None else v >= minimum)
            )

        bound = "> 0" if minimum is None else f">= {minimum:g}"
        value = self._typed(field, check, f"a number of seconds {bound}")
        return None if value is None else float(value)

    def integer(self, field: str) -> int | None:
        value: int | None = self._typed(
            field,
            lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
            "a whole number >= 1",
        )
        return value

    def headers(self, field: str) -> dict[str, str] | None:
        value: dict[str, str] | None = self._typed(
            field,
            lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
            'a table of text values ({ "X-Name" = "value" })',
        )
        return None if value is None else dict(value)
