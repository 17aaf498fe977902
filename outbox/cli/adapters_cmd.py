"""``outbox adapters ...``: check an adapter before it sends anything, list the presets.

``outbox adapters check NAME [--payload FILE] [--live]`` loads the adapters
file exactly as every process does at start-up (so it fails the same way, with
the same one-line error naming the adapter and the key), then prints the
request the adapter would send for a sample payload: method, URL, headers and
body, every secret shown as ``***``. ``--live`` also sends one lookup for a
key that cannot exist, which proves the credentials and the lookup path
without creating anything.

``load(path)`` is the one way the processes (dispatcher, reconciler, serve)
and this command turn a file into a registry; an app that carries its own
adapters file passes its path here.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import adapters
from outbox import app as apps
from outbox import errors, settings

SAMPLE_EFFECT_KEY = "sample-effect-key"
HELPDESK_SAMPLE_PAYLOAD: Mapping[str, Any] = {
    "subject": "Printer on fire",
    "body": "Third floor, by the window.",
    "priority": "normal",
}
"""What ``check helpdesk`` shows without ``--payload``: the demo tool's payload shape."""


def load(
    path: str | os.PathLike[str] | None, *, env: Mapping[str, str] | None = None
) -> adapters.Registry:
    """The registry of ``path`` (None: ``$OUTBOX_ADAPTERS`` or the default), or ``ConfigError``."""
    try:
        return adapters.load_registry(path, env=env)
    except adapters.AdapterError as exc:
        raise errors.ConfigError(f"adapters: {exc}") from exc


def check_at_startup(path: str | os.PathLike[str] | None) -> None:
    """Load and close: a process that does not deliver still refuses a broken file."""
    load(path).close()


def register(sub: Any) -> None:
    p_adapters = sub.add_parser("adapters", help="check adapters, list presets")
    a_sub = p_adapters.add_subparsers(dest="adapters_command", metavar="ACTION", required=True)

    p = a_sub.add_parser(
        "check",
        help="validate an adapter and print the request it would send (secrets as ***)",
    )
    p.add_argument("name", metavar="NAME", help="the adapter, as named in the adapters file")
    p.add_argument(
        "--adapters",
        default=None,
        metavar="FILE",
        help="the adapters file (default OUTBOX_ADAPTERS; none: the built-in helpdesk)",
    )
    p.add_argument(
        "--payload",
        default=None,
        metavar="FILE",
        help="a JSON file with a sample payload (default: the adapter's sample_payload)",
    )
    p.add_argument(
        "--live",
        action="store_true",
        help="also send one lookup for a key that cannot exist (proves credentials and lookup)",
    )
    p.set_defaults(handler=cmd_check)

    p = a_sub.add_parser("presets", help="the providers with a preset, and what each needs")
    p.set_defaults(handler=cmd_presets)


def _read_payload(path: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise errors.ConfigError(f"--payload: cannot read {path!r} ({exc.strerror})") from None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise errors.ConfigError(f"--payload: {path!r} is not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise errors.ConfigError(f"--payload: {path!r} must hold a JSON object")
    return value


def build_for_check(
    path: str | os.PathLike[str] | None,
    name: str,
    payload: Mapping[str, Any] | None,
    *,
    env: Mapping[str, str] | None = None,
) -> adapters.Adapter:
    """Every adapter of the file checked as at start-up; ``name`` returned, built for ``payload``."""
    environ = os.environ if env is None else env
    if path is None:
        registry = load(None, env=environ)
        try:
            return _pick(registry, name)
        except BaseException:
            registry.close()
            raise
    try:
        document, source = adapters.read_document(path)
        tables = document.get("adapters")
        if isinstance(tables, dict) and name not in tables:
            known = sorted(tables)
            import difflib

            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise errors.ConfigError(
                f"adapters: no adapter named {name!r} in {str(source)!r}{hint} "
                f"(adapters: {', '.join(known) or 'none'})"
            )
        # The whole file first, as a process would load it...
        adapters.load_registry(path, env=environ).close()
        # ...then the one adapter again, with the sample payload given here.
        assert isinstance(tables, dict)
        return adapters.build_adapter(
            name, tables[name], env=environ, base_dir=source.parent, sample_payload=payload
        )
    except adapters.AdapterError as exc:
        raise errors.ConfigError(f"adapters: {exc}") from exc


def _pick(registry: adapters.Registry, name: str) -> adapters.Adapter:
    try:
        return registry.get(name)
    except adapters.UnknownAdapter as exc:
        raise errors.ConfigError(f"adapters: {exc}") from None


def cmd_check(args: argparse.Namespace) -> int:
    path = args.adapters if args.adapters is not None else settings.load().adapters
    if path is None:
        path = apps.from_args(args).adapters_file  # the app's own file, if it has one
    payload = _read_payload(args.payload) if args.payload else None
    adapter = build_for_check(path, args.name, payload)
    try:
        for line in describe(adapter, payload):
            print(line)
        if args.live:
            return _live(adapter)
    finally:
        adapter.close()
    return 0


def describe(adapter: adapters.Adapter, payload: Mapping[str, Any] | None) -> list[str]:
    """What ``check`` prints for one adapter: its promises, then the exact request."""
    caps = adapter.capabilities
    lines = [f"adapter {adapter.name}: configuration OK ({type(adapter).__name__})"]
    lines.append(f"  honours idempotency keys: {'yes' if caps.honours_idempotency_keys else 'no'}")
    if caps.key_retention_seconds is not None:
        lines.append(
            f"  key retention: {_duration(caps.key_retention_seconds)} "
            "(past it: lookup, never a resend)"
        )
    lines.append(
        f"  lookup: {'yes' if caps.supports_lookup else 'no (ambiguous sends go to review)'}"
    )
    if not isinstance(adapter, adapters.HttpAdapter):
        return lines
    config = adapter.config
    if config.lookup_url is not None:
        lines.append(f"  lookup by: {config.lookup_by or 'as the lookup_url says'}")
    if config.auth is not None or config.auth_env:
        kind = config.auth.kind if config.auth is not None else "bearer"
        lines.append(f"  auth: {kind}")
    if config.rate_limit:
        lines.append(f"  rate limit: {config.rate_limit} (wait up to {config.rate_limit_wait}s)")
    for rule in config.classify_rules:
        lines.append(f"  classify: {rule.describe()}")
    sample = payload if payload is not None else config.sample_payload
    if sample is None and adapter.name == "helpdesk" and config.body is None:
        sample = HELPDESK_SAMPLE_PAYLOAD
    source = (
        "--payload"
        if payload is not None
        else "sample_payload"
        if config.sample_payload is not None
        else "a built-in sample"
        if sample is not None
        else "an empty payload (give --payload FILE or sample_payload)"
    )
    request = adapters.DeliveryRequest(
        effect_id=0,
        effect_key=SAMPLE_EFFECT_KEY,
        tenant="sample-tenant",
        operation_id="sample-operation",
        effect="sample",
        payload=dict(sample or {}),
        attempt=1,
    )
    try:
        prepared = adapter.prepare(request)
    except adapters.PayloadError as exc:
        raise errors.ConfigError(f"adapters: {exc} (payload: {source})") from None
    lines += [
        "",
        f"The request it would send for {source}, effect key {SAMPLE_EFFECT_KEY!r}:",
        "",
        prepared.render(),
    ]
    return lines


def _live(adapter: adapters.Adapter) -> int:
    if not adapter.capabilities.supports_lookup:
        print(f"--live: adapter {adapter.name} has no lookup; nothing was sent")
        return 1
    key = f"outbox-check-{secrets.token_hex(8)}"
    answer = adapter.lookup(key, f"outbox-check-nonexistent-{secrets.token_hex(4)}")
    if answer.status is adapters.LookupStatus.NOT_FOUND:
        print(f"--live: lookup of {key!r}: not found, as expected (credentials and lookup work)")
        return 0
    if answer.status is adapters.LookupStatus.FOUND:
        print(
            f"--live: lookup of {key!r} FOUND {answer.provider_ref!r}: the match rule is too loose"
        )
        return 1
    print(f"--live: lookup of {key!r} was inconclusive: {answer.error}")
    return 1


def cmd_presets(args: argparse.Namespace) -> int:
    for preset in adapters.PRESETS.values():
        print(f"{preset.name:<9} {preset.summary}")
        for need in preset.needs:
            print(f"{'':<9}   needs: {need}")
        print(f"{'':<9}   docs:  {preset.docs[0]}")
    return 0


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"
