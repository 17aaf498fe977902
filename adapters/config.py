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
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import httpx

from adapters import auth as auth_kinds
from adapters import classify, helpdesk, presets, ratelimit, secrets, testing, webhooks
from adapters.errors import ConfigError
from adapters.http import HttpAdapter, HttpAdapterConfig
from adapters.protocol import Adapter, Capabilities
from adapters.registry import Registry
from adapters.secrets import Secret

ADAPTERS_ENV = "OUTBOX_ADAPTERS"
"""Environment variable naming the adapters TOML file."""

KINDS = ("http", "helpdesk", "noop")

# --- the keys of an [adapters.NAME] table: ONE place -----------------------------
# Each block is one feature; a new feature adds its own block and joins it to
# _HTTP_KEYS below (and documents every key in docs/adapters.md).

_CAPABILITY_KEYS = {
    "honours_idempotency_keys",
    "supports_lookup",
    "lookup_settle_seconds",
    "key_retention",
}
_REQUEST_KEYS = {
    "kind",
    "preset",
    "url",
    "method",
    "headers",
    "auth_env",
    "auth",
    "body",
    "body_format",
    "vars",
    "idempotency_header",
    "client_reference_field",
    "reference_field",
    "sample_payload",
}
_LOOKUP_KEYS = {
    "lookup_url",
    "lookup_by",
    "lookup_method",
    "lookup_params",
    "lookup_list_field",
    "lookup_match",
    "lookup_match_contains",
    "lookup_reference_field",
    "lookup_inconclusive_if",
}
_TRANSPORT_KEYS = {
    "connect_timeout",
    "read_timeout",
    "total_timeout",
    "max_connections",
    "rate_limit",
    "rate_limit_wait",
}
_CLASSIFY_KEYS = {"classify"}
# Webhook receiver settings (webhook_format, webhook_secret, ...) go in a block here.
_WEBHOOK_KEYS: set[str] = set()

_HTTP_KEYS = (
    _CAPABILITY_KEYS
    | _REQUEST_KEYS
    | _LOOKUP_KEYS
    | _TRANSPORT_KEYS
    | _CLASSIFY_KEYS
    | _WEBHOOK_KEYS
)
_KEYS_BY_KIND: Mapping[str, frozenset[str]] = {
    "http": frozenset(_HTTP_KEYS),
    "helpdesk": frozenset(_HTTP_KEYS | {"base_url"}),
    "noop": frozenset({"kind"}),
}
# --- webhooks: their own block; adapters/webhooks.py owns and reads these keys ---
_KEYS_BY_KIND = {kind: keys | webhooks.KEYS for kind, keys in _KEYS_BY_KIND.items()}
# --- end of webhooks ---


def all_keys() -> frozenset[str]:
    """Every key an [adapters.NAME] table may hold (docs/adapters.md describes each)."""
    return frozenset().union(*_KEYS_BY_KIND.values())


# The [adapters.NAME.auth] table: its keys by type (the first of each is "type").
AUTH_KEYS: Mapping[str, frozenset[str]] = {
    "bearer": frozenset({"type", "token"}),
    "basic": frozenset({"type", "username", "password"}),
    "api_key": frozenset({"type", "name", "value", "in"}),
    "oauth2_client_credentials": frozenset(
        {
            "type",
            "token_url",
            "client_id",
            "client_secret",
            "scope",
            "audience",
            "client_auth",
            "refresh_leeway_seconds",
        }
    ),
}
_AUTH_REQUIRED: Mapping[str, tuple[str, ...]] = {
    "bearer": ("token",),
    "basic": ("username", "password"),
    "api_key": ("name", "value"),
    "oauth2_client_credentials": ("token_url", "client_id", "client_secret"),
}
# One [[adapters.NAME.classify]] rule.
CLASSIFY_RULE_KEYS = frozenset({"status", "match", "headers", "body_contains", "outcome", "why"})
_T = TypeVar("_T")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(s|sec|seconds?|m|min|minutes?|h|hours?|d|days?)\s*")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def load_registry(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    transport: httpx.BaseTransport | None = None,
) -> Registry:
    """The registry described by ``path`` (or ``$OUTBOX_ADAPTERS``, or the default).

    ``env`` replaces ``os.environ`` (for the file path and for every
    ``${NAME}`` secret); ``transport`` is given to every HTTP adapter (tests
    pass an ``httpx.MockTransport`` or a respx router's). Every mistake is a
    ``ConfigError`` raised here, at start-up, never at the first send.
    """
    environ = os.environ if env is None else env
    if path is None:
        path = environ.get(ADAPTERS_ENV) or None
    if path is None:
        return Registry([helpdesk.helpdesk_adapter(transport=transport, env=environ)])
    document, source = read_document(path)
    return registry_from_document(
        document,
        env=environ,
        transport=transport,
        source=str(source),
        base_dir=source.parent,
    )


def read_document(path: str | os.PathLike[str]) -> tuple[dict[str, Any], Path]:
    """The parsed adapters file and its path; ``ConfigError`` when it cannot be."""
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
    return document, source


def registry_from_document(
    document: Mapping[str, Any],
    *,
    env: Mapping[str, str] | None = None,
    transport: httpx.BaseTransport | None = None,
    source: str = "<config>",
    base_dir: Path | None = None,
) -> Registry:
    """The registry for an already parsed TOML document (see the module docstring)."""
    extra = sorted(set(document) - {"adapters"})
    if extra:
        close = difflib.get_close_matches(extra[0], ["adapters"], n=1)
        hint = "; did you mean 'adapters'?" if close else ""
        raise ConfigError(
            f"{source}: unknown top-level key {extra[0]!r}{hint} "
            "(put each adapter in its own [adapters.NAME] table)"
        )
    tables = document.get("adapters")
    if not isinstance(tables, dict) or not tables:
        raise ConfigError(f"{source}: no adapters configured; add an [adapters.NAME] table")
    registry = Registry()
    try:
        for name, table in tables.items():
            registry.register(
                build_adapter(name, table, env=env, transport=transport, base_dir=base_dir)
            )
            # --- webhooks (adapters/webhooks.py) ---
            webhook = webhooks.from_table(name, table, os.environ if env is None else env)
            if webhook is not None:
                registry.webhooks[name] = webhook
    except BaseException:
        registry.close()  # do not leak the connection pools already made
        raise
    return registry


def build_adapter(
    name: str,
    table: Any,
    *,
    env: Mapping[str, str] | None = None,
    transport: httpx.BaseTransport | None = None,
    base_dir: Path | None = None,
    sample_payload: Mapping[str, Any] | None = None,
) -> Adapter:
    """One adapter from its ``[adapters.NAME]`` table (``sample_payload`` replaces the table's)."""
    environ = os.environ if env is None else env
    if not _NAME.fullmatch(name):
        raise ConfigError(
            "is not a usable adapter name; use letters, digits, '_', '-' and '.'", adapter=name
        )
    if not isinstance(table, dict):
        raise ConfigError(f"must be a table ([adapters.{name}]), not a value", adapter=name)
    table = _with_preset(name, table)
    if sample_payload is not None:
        table = {**table, "sample_payload": dict(sample_payload)}
    spec = _Spec(name, table, env=environ, base_dir=base_dir)
    kind = spec.string("kind")
    if kind is None:
        raise ConfigError(
            f"is missing; set kind = one of {', '.join(KINDS)}", adapter=name, field="kind"
        )
    if kind not in KINDS:
        raise ConfigError(
            f"{kind!r} is not one of {', '.join(KINDS)}{_did_you_mean(kind, KINDS)}",
            adapter=name,
            field="kind",
        )
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
    config = _http_config(spec, base, transport)
    return HttpAdapter(name, config, transport=transport, env=environ)


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, sorted(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _with_preset(name: str, table: dict[str, Any]) -> dict[str, Any]:
    """The table over its preset: the adapter's own keys win (tables are merged one level)."""
    preset_name = table.get("preset")
    if preset_name is None:
        return table
    if not isinstance(preset_name, str) or preset_name not in presets.PRESETS:
        known = ", ".join(sorted(presets.PRESETS))
        hint = _did_you_mean(str(preset_name), presets.PRESETS)
        raise ConfigError(
            f"{preset_name!r} is not a preset{hint} (presets: {known})",
            adapter=name,
            field="preset",
        )
    merged = presets.table(preset_name)
    for key, value in table.items():
        if key in ("vars", "headers", "lookup_params") and isinstance(value, dict):
            merged[key] = {**merged.get(key, {}), **value}
        elif key == "classify" and isinstance(value, list):
            merged[key] = [*value, *merged.get(key, [])]  # the adapter's rules are tried first
        else:
            merged[key] = value
    if "body" in table and "sample_payload" not in table:
        merged.pop("sample_payload", None)  # the preset's sample fits the preset's body only
    merged.setdefault("kind", "http")
    return merged


def _http_config(
    spec: _Spec, base: HttpAdapterConfig, transport: httpx.BaseTransport | None
) -> HttpAdapterConfig:
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
        key_retention_seconds=spec.duration("key_retention"),
    )
    return HttpAdapterConfig(
        url=_default(spec.string("url"), base.url),
        method=_default(spec.string("method"), base.method),
        headers=_default(spec.headers("headers"), base.headers),
        auth_env=spec.string("auth_env"),
        idempotency_header=spec.switchable("idempotency_header", base.idempotency_header),
        # With a body template the body is exactly what the template says: no
        # hidden field is added unless client_reference_field names one.
        client_reference_field=spec.switchable(
            "client_reference_field",
            None if spec.body("body") is not None else base.client_reference_field,
        ),
        reference_field=spec.switchable("reference_field", base.reference_field),
        lookup_url=lookup_url,
        lookup_list_field=spec.switchable("lookup_list_field", base.lookup_list_field),
        connect_timeout=_default(spec.number("connect_timeout"), base.connect_timeout),
        read_timeout=_default(spec.number("read_timeout"), base.read_timeout),
        total_timeout=_default(spec.number("total_timeout"), base.total_timeout),
        capabilities=capabilities,
        max_connections=_default(spec.integer("max_connections"), base.max_connections),
        body=spec.body("body"),
        body_format=_default(spec.choice("body_format", ("json", "form")), base.body_format),
        vars=_default(spec.variables("vars"), base.vars),
        auth=spec.auth("auth", transport),
        classify_rules=spec.classify_rules("classify"),
        lookup_by=spec.choice("lookup_by", ("key", "client_reference", "reference")),
        lookup_method=_default(spec.choice("lookup_method", ("GET", "POST")), "GET"),
        lookup_params=_default(spec.text_table("lookup_params"), {}),
        lookup_match=_default(spec.text_table("lookup_match"), {}),
        lookup_match_contains=_default(spec.text_table("lookup_match_contains"), {}),
        lookup_reference_field=spec.string("lookup_reference_field"),
        lookup_inconclusive_if=_default(spec.subtable("lookup_inconclusive_if"), {}),
        rate_limit=spec.string("rate_limit"),
        rate_limit_wait=_default(
            spec.number("rate_limit_wait", minimum=0.0), ratelimit.RATE_LIMIT_WAIT_DEFAULT
        ),
        sample_payload=spec.subtable("sample_payload"),
    )


def _default(value: _T | None, fallback: _T) -> _T:
    return fallback if value is None else value


class _Spec:
    """Typed reads of one [adapters.NAME] table; each mistake names the field."""

    def __init__(
        self,
        adapter: str,
        table: Mapping[str, Any],
        *,
        env: Mapping[str, str] | None = None,
        base_dir: Path | None = None,
    ) -> None:
        self.adapter = adapter
        self.table = table
        self.env: Mapping[str, str] = os.environ if env is None else env
        self.base_dir = base_dir

    def fail(self, field: str, message: str) -> ConfigError:
        return ConfigError(message, adapter=self.adapter, field=field)

    def reject_unknown(self, allowed: frozenset[str], kind: str) -> None:
        for key in sorted(set(self.table) - allowed):
            hint = _did_you_mean(key, allowed)
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

    def headers(self, field: str) -> dict[str, str | Secret] | None:
        """Header values; one that names a secret (``${NAME}``, ``file:``) is resolved now."""
        value: dict[str, str] | None = self._typed(
            field,
            lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
            'a table of text values ({ "X-Name" = "value" })',
        )
        if value is None:
            return None
        out: dict[str, str | Secret] = {}
        for name, text in value.items():
            if secrets.is_reference(text):
                out[name] = self.secret(text, f"{field}.{name}")
            else:
                out[name] = text
        return out

    def secret(self, text: str, field: str) -> Secret:
        return secrets.resolve(
            text, adapter=self.adapter, field=field, env=self.env, base_dir=self.base_dir
        )

    def choice(self, field: str, choices: tuple[str, ...]) -> str | None:
        value = self.string(field)
        if value is not None and value not in choices:
            raise self.fail(
                field,
                f"{value!r} is not one of {', '.join(choices)}{_did_you_mean(value, choices)}",
            )
        return value

    def subtable(self, field: str) -> dict[str, Any] | None:
        value: dict[str, Any] | None = self._typed(
            field, lambda v: isinstance(v, dict), "a table ({ key = value, ... })"
        )
        return None if value is None else dict(value)

    def text_table(self, field: str) -> dict[str, str] | None:
        value: dict[str, str] | None = self._typed(
            field,
            lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
            'a table of text values ({ "path" = "{{ effect_key }}" })',
        )
        return None if value is None else dict(value)

    def variables(self, field: str) -> dict[str, Any] | None:
        """``vars``: constants for templates; ``${NAME}`` and ``file:`` are read now."""
        value = self.subtable(field)
        if value is None:
            return None
        out: dict[str, Any] = {}
        for name, item in value.items():
            if isinstance(item, str) and secrets.is_reference(item):
                out[name] = secrets.resolve_plain(
                    item,
                    adapter=self.adapter,
                    field=f"{field}.{name}",
                    env=self.env,
                    base_dir=self.base_dir,
                )
            else:
                out[name] = item
        return out

    def body(self, field: str) -> Any:
        if field not in self.table:
            return None
        value = self.table[field]
        if not isinstance(value, dict | list | str):
            raise self.fail(field, f"must be a table, an array or a text template, not {value!r}")
        return value

    def duration(self, field: str) -> float | None:
        """Seconds: a number, or text such as ``"24h"``, ``"30m"``, ``"2d"``, ``"90s"``."""
        if field not in self.table:
            return None
        value = self.table[field]
        if isinstance(value, int | float) and not isinstance(value, bool):
            seconds = float(value)
        elif isinstance(value, str) and (match := _DURATION.fullmatch(value)):
            seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2)[0]]
        else:
            raise self.fail(field, f'must be seconds or a duration like "24h", not {value!r}')
        if not math.isfinite(seconds) or seconds <= 0:
            raise self.fail(field, f"must be a duration > 0, not {value!r}")
        return seconds

    def auth(self, field: str, transport: httpx.BaseTransport | None) -> Any:
        table = self.subtable(field)
        if table is None:
            return None
        where = field
        kind = table.get("type")
        if kind is None:
            raise self.fail(
                f"{where}.type", f"is missing; set type = one of {', '.join(AUTH_KEYS)}"
            )
        if kind not in AUTH_KEYS:
            raise self.fail(
                f"{where}.type",
                f"{kind!r} is not one of {', '.join(AUTH_KEYS)}{_did_you_mean(str(kind), AUTH_KEYS)}",
            )
        for key in sorted(set(table) - AUTH_KEYS[kind]):
            hint = _did_you_mean(key, AUTH_KEYS[kind])
            raise self.fail(f"{where}.{key}", f"is not a setting of {kind} auth{hint}")
        for key in _AUTH_REQUIRED[kind]:
            if key not in table:
                raise self.fail(f"{where}.{key}", f"is missing; {kind} auth needs it")
        for key, value in table.items():
            if key == "refresh_leeway_seconds":
                continue
            if not isinstance(value, str) or not value:
                raise self.fail(f"{where}.{key}", "must be non-empty text")

        def secret(key: str) -> Secret:
            return self.secret(table[key], f"{where}.{key}")

        def plain(key: str) -> str | None:
            if key not in table:
                return None
            return secrets.resolve_plain(
                table[key],
                adapter=self.adapter,
                field=f"{where}.{key}",
                env=self.env,
                base_dir=self.base_dir,
            )

        if kind == "bearer":
            return auth_kinds.BearerAuth(secret("token"))
        if kind == "basic":
            return auth_kinds.BasicAuth(secret("username"), secret("password"))
        if kind == "api_key":
            location = table.get("in", "header")
            if location not in ("header", "query"):
                raise self.fail(f"{where}.in", f"{location!r} is not one of header, query")
            name = table["name"]
            if location == "header" and not _HEADER_NAME.fullmatch(name):
                raise self.fail(f"{where}.name", f"{name!r} is not a header name")
            return auth_kinds.ApiKeyAuth(name, secret("value"), location)
        client_auth = table.get("client_auth", "basic")
        if client_auth not in ("basic", "body"):
            raise self.fail(f"{where}.client_auth", f"{client_auth!r} is not one of basic, body")
        leeway = table.get(
            "refresh_leeway_seconds", auth_kinds.OAUTH2_REFRESH_LEEWAY_SECONDS_DEFAULT
        )
        if isinstance(leeway, bool) or not isinstance(leeway, int | float) or leeway < 0:
            raise self.fail(f"{where}.refresh_leeway_seconds", "must be a number of seconds >= 0")
        token_url = plain("token_url") or ""
        if not token_url.startswith(("https://", "http://")):
            raise self.fail(f"{where}.token_url", f"{token_url!r} must start with https://")
        return auth_kinds.OAuth2ClientCredentials(
            token_url=token_url,
            client_id=plain("client_id") or "",
            client_secret=secret("client_secret"),
            scope=plain("scope"),
            audience=plain("audience"),
            client_auth=client_auth,
            refresh_leeway_seconds=float(leeway),
            transport=transport,
        )

    def classify_rules(self, field: str) -> tuple[classify.Override, ...]:
        if field not in self.table:
            return ()
        rules = self.table[field]
        if not isinstance(rules, list) or not all(isinstance(r, dict) for r in rules):
            raise self.fail(field, "must be an array of tables ([[adapters.NAME.classify]])")
        out = []
        for index, rule in enumerate(rules):
            where = f"{field}[{index}]"
            for key in sorted(set(rule) - CLASSIFY_RULE_KEYS):
                raise self.fail(
                    f"{where}.{key}",
                    f"is not a rule setting{_did_you_mean(key, CLASSIFY_RULE_KEYS)}",
                )
            outcome = rule.get("outcome")
            if outcome not in classify.OVERRIDE_OUTCOMES:
                choices = ", ".join(classify.OVERRIDE_OUTCOMES)
                raise self.fail(
                    f"{where}.outcome",
                    f"{outcome!r} is not one of {choices}"
                    f"{_did_you_mean(str(outcome), classify.OVERRIDE_OUTCOMES)}",
                )
            out.append(
                classify.Override(
                    outcome=classify.OVERRIDE_OUTCOMES[outcome],
                    status=self._statuses(rule.get("status"), f"{where}.status"),
                    match=self._rule_table(rule, "match", where, any_value=True),
                    headers=self._rule_table(rule, "headers", where, any_value=False),
                    body_contains=self._rule_text(rule, "body_contains", where),
                    why=self._rule_text(rule, "why", where) or "",
                )
            )
            if not (out[-1].status or out[-1].match or out[-1].headers or out[-1].body_contains):
                raise self.fail(
                    where, "matches every reply; give status, match, headers or body_contains"
                )
        return tuple(out)

    def _statuses(self, value: Any, where: str) -> frozenset[int]:
        if value is None:
            return frozenset()
        items = value if isinstance(value, list) else [value]
        codes: set[int] = set()
        for item in items:
            if isinstance(item, int) and not isinstance(item, bool) and 100 <= item <= 599:
                codes.add(item)
            elif isinstance(item, str) and re.fullmatch(r"[1-5]xx", item):
                first = int(item[0]) * 100
                codes.update(range(first, first + 100))
            else:
                raise self.fail(
                    where, f'must be a status (409), a class ("5xx") or an array, not {item!r}'
                )
        return frozenset(codes)

    def _rule_table(
        self, rule: Mapping[str, Any], key: str, where: str, *, any_value: bool
    ) -> dict[str, Any] | None:
        if key not in rule:
            return None
        value = rule[key]
        if not isinstance(value, dict) or (
            not any_value and not all(isinstance(v, str) for v in value.values())
        ):
            raise self.fail(f"{where}.{key}", "must be a table of path = value")
        return dict(value)

    def _rule_text(self, rule: Mapping[str, Any], key: str, where: str) -> str | None:
        if key not in rule:
            return None
        value = rule[key]
        if not isinstance(value, str):
            raise self.fail(f"{where}.{key}", "must be text")
        return value
