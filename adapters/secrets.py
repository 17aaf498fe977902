"""Secrets in the adapters file: ``${ENV_NAME}`` or ``file:PATH``, resolved once at start-up.

A value that *is* a reference (the whole string) is replaced by what it names:
``"${STRIPE_API_KEY}"`` by that environment variable, ``"file:/run/secrets/stripe"``
by the file's text with the trailing newline stripped (the Docker and
Kubernetes secret-file convention). A reference may also sit inside a longer
text (``"Token ${ZENDESK_TOKEN}"``).

A resolved value is a ``Secret``: its ``str()`` and ``repr()`` are ``"***"``,
so an f-string, a log call or an exception that picks one up shows nothing.
Code that needs the value calls ``reveal()``, in one place: where the request
is built. Every adapter keeps a ``Redactor`` of its secrets and passes each
error text it returns through it, so a provider that echoes a credential back
cannot put it in the database, the console or a log line.

A missing variable, an unreadable file or an empty value is a ``ConfigError``
naming the adapter, the key and the variable or path, never a value.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from adapters.errors import ConfigError

REDACTED = "***"
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_FILE_PREFIX = "file:"
_MIN_REDACT_CHARS = 4
"""Shorter secret values are not searched for in error texts (they would match by chance)."""


class Secret:
    """A credential. Prints as ``***``; ``reveal()`` is the only way to the value."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __str__(self) -> str:
        return REDACTED

    def __repr__(self) -> str:
        return f"Secret({REDACTED})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(("secret", self._value))

    def __reduce__(self) -> tuple[object, ...]:  # never pickled into a queue or a cache
        raise TypeError("a Secret cannot be pickled")


def is_reference(text: str) -> bool:
    """True when ``text`` names a secret (``${NAME}`` anywhere, or ``file:`` at the start)."""
    return text.startswith(_FILE_PREFIX) or _ENV_REF.search(text) is not None


def resolve(
    text: str,
    *,
    adapter: str,
    field: str,
    env: Mapping[str, str],
    base_dir: Path | None = None,
) -> Secret:
    """The secret ``text`` names; plain text is taken as it is (and still kept secret).

    ``field`` is the dotted key in the adapter's table (``auth.token``), for the error.
    """
    if text.startswith(_FILE_PREFIX):
        raw = text[len(_FILE_PREFIX) :]
        path = Path(raw).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        try:
            value = path.read_text(encoding="utf-8").rstrip("\r\n")
        except OSError as exc:
            raise ConfigError(
                f"cannot read the secret file {raw!r} ({exc.strerror or type(exc).__name__})",
                adapter=adapter,
                field=field,
            ) from None
        if not value:
            raise ConfigError(f"the secret file {raw!r} is empty", adapter=adapter, field=field)
        return Secret(value)

    def substitute(match: re.Match[str]) -> str:
        name = match.group(1)
        value = env.get(name, "")
        if not value:
            raise ConfigError(
                f"environment variable ${{{name}}} is not set (or empty); "
                "export it before starting",
                adapter=adapter,
                field=field,
            )
        return value

    return Secret(_ENV_REF.sub(substitute, text))


def resolve_plain(
    text: str, *, adapter: str, field: str, env: Mapping[str, str], base_dir: Path | None = None
) -> str:
    """``resolve`` for a value that is not itself a credential (a client id, a user name)."""
    return resolve(text, adapter=adapter, field=field, env=env, base_dir=base_dir).reveal()


def default_env() -> Mapping[str, str]:
    return os.environ


class Redactor:
    """Replaces every known secret value in a text by ``***``."""

    def __init__(self, secrets: Iterable[Secret] = ()) -> None:
        values = {s.reveal() for s in secrets}
        # Longest first: a secret that contains another is replaced whole.
        self._values = sorted((v for v in values if len(v) >= _MIN_REDACT_CHARS), key=len)[::-1]

    def add(self, secret: Secret) -> None:
        self._values = sorted({*self._values, secret.reveal()}, key=len)[::-1]
        self._values = [v for v in self._values if len(v) >= _MIN_REDACT_CHARS]

    def __call__(self, text: str) -> str:
        for value in self._values:
            if value in text:
                text = text.replace(value, REDACTED)
        return text

    def __bool__(self) -> bool:
        return bool(self._values)

    def __repr__(self) -> str:
        return f"Redactor({len(self._values)} secret(s))"
