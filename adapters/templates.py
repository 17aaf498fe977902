"""The template language of the adapters file: ``{{ path }}`` and nothing that can run code.

A template is any text value of ``body``, ``url``, ``headers`` or a lookup
setting. ``{{ ... }}`` holds one expression::

    expression := path ( "|" filter )*
    path       := root ( "." name )*          root: payload, effect_key, effect,
                                              tenant, operation_id, vars, reference
    filter     := default(<JSON literal>)     the value when the path is missing or null
                | string                      the value as text (numbers, true/false)
                | json                        the value as compact JSON text

A value that is exactly one ``{{ ... }}`` keeps its type: ``"{{ payload.amount }}"``
is the number 2000, ``"{{ payload.tags }}"`` the list. Anything else is text:
``"Ticket {{ payload.id }}"``. Text around and between expressions is kept as
written. Tables and arrays of templates are rendered member by member.

A path that names a field the values lack (and has no ``default``) raises
``TemplateError`` with the path, so ``outbox adapters check`` and start-up
(against ``sample_payload``) report it before anything is sent.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ROOTS = ("payload", "effect_key", "effect", "tenant", "operation_id", "vars", "reference")
_EXPR = re.compile(r"\{\{(.*?)\}\}", re.DOTALL)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*|[0-9]+")
_DEFAULT = re.compile(r"default\((.*)\)", re.DOTALL)
_MISSING = object()


class TemplateError(ValueError):
    """A template that cannot be parsed, or names something the values lack."""


@dataclass(frozen=True, slots=True)
class _Expr:
    source: str
    path: tuple[str, ...]
    filters: tuple[tuple[str, Any], ...]


def _parse_expr(source: str) -> _Expr:
    parts = [p.strip() for p in source.split("|")]
    path_text = parts[0]
    if not path_text:
        raise TemplateError("an empty {{ }}")
    path = tuple(path_text.split("."))
    if path[0] not in ROOTS:
        raise TemplateError(f"{{{{ {path_text} }}}} must start with one of {', '.join(ROOTS)}")
    for name in path[1:]:
        if not _NAME.fullmatch(name):
            raise TemplateError(f"{{{{ {path_text} }}}}: {name!r} is not a field name")
    filters: list[tuple[str, Any]] = []
    for text in parts[1:]:
        match = _DEFAULT.fullmatch(text)
        if match:
            try:
                filters.append(("default", json.loads(match.group(1))))
            except ValueError:
                raise TemplateError(
                    f'default(...) needs a JSON literal, e.g. default("normal"), not {text!r}'
                ) from None
        elif text in ("string", "json"):
            filters.append((text, None))
        else:
            raise TemplateError(f"unknown filter {text!r}; use default(...), string or json")
    return _Expr(source.strip(), path, tuple(filters))


@dataclass(frozen=True, slots=True)
class Template:
    """One compiled text template."""

    source: str
    pieces: tuple[str | _Expr, ...]

    @property
    def whole(self) -> _Expr | None:
        """The expression when the template is exactly one ``{{ }}``: its value keeps its type."""
        if len(self.pieces) == 1 and isinstance(self.pieces[0], _Expr):
            return self.pieces[0]
        return None

    @property
    def paths(self) -> tuple[tuple[str, ...], ...]:
        return tuple(p.path for p in self.pieces if isinstance(p, _Expr))

    def render(
        self, values: Mapping[str, Any], quote: Callable[[str, str], str] | None = None
    ) -> Any:
        """The value (typed when ``whole``), or text with ``quote(text, root)`` on each value."""
        whole = self.whole
        if whole is not None and quote is None:
            return _evaluate(whole, values)
        out: list[str] = []
        for piece in self.pieces:
            if isinstance(piece, str):
                out.append(piece)
                continue
            text = _as_text(_evaluate(piece, values))
            out.append(quote(text, piece.path[0]) if quote is not None else text)
        return "".join(out)


def compile_text(source: str) -> Template:
    """Compile one text value; ``TemplateError`` says what is wrong."""
    pieces: list[str | _Expr] = []
    at = 0
    for match in _EXPR.finditer(source):
        if match.start() > at:
            pieces.append(source[at : match.start()])
        pieces.append(_parse_expr(match.group(1)))
        at = match.end()
    if at < len(source):
        pieces.append(source[at:])
    rest = "".join(p for p in pieces if isinstance(p, str))
    if "{{" in rest or "}}" in rest:
        raise TemplateError(f"unbalanced {{{{ or }}}} in {source!r}")
    return Template(source, tuple(pieces))


def has_expressions(source: str) -> bool:
    return "{{" in source


def compile_value(value: Any) -> Any:
    """A TOML value with every text compiled: tables and arrays member by member."""
    if isinstance(value, str):
        return compile_text(value)
    if isinstance(value, Mapping):
        return {str(k): compile_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [compile_value(v) for v in value]
    return value


def render_value(compiled: Any, values: Mapping[str, Any]) -> Any:
    """The value of ``compile_value``'s result for these values."""
    if isinstance(compiled, Template):
        return compiled.render(values)
    if isinstance(compiled, Mapping):
        return {k: render_value(v, values) for k, v in compiled.items()}
    if isinstance(compiled, list):
        return [render_value(v, values) for v in compiled]
    return compiled


def value_paths(compiled: Any) -> list[tuple[str, ...]]:
    """Every path a compiled value reads, for validation."""
    if isinstance(compiled, Template):
        return list(compiled.paths)
    if isinstance(compiled, Mapping):
        return [p for v in compiled.values() for p in value_paths(v)]
    if isinstance(compiled, list):
        return [p for v in compiled for p in value_paths(v)]
    return []


def _evaluate(expr: _Expr, values: Mapping[str, Any]) -> Any:
    value: Any = values.get(expr.path[0], _MISSING)
    for name in expr.path[1:]:
        if isinstance(value, Mapping) and name in value:
            value = value[name]
        elif isinstance(value, Sequence) and not isinstance(value, str) and name.isdigit():
            index = int(name)
            value = value[index] if index < len(value) else _MISSING
        else:
            value = _MISSING
        if value is _MISSING:
            break
    for name, argument in expr.filters:
        if name == "default":
            if value is _MISSING or value is None:
                value = argument
        elif value is _MISSING:
            break
        elif name == "string":
            value = _as_text(value)
        elif name == "json":
            value = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    if value is _MISSING:
        raise TemplateError(f"{{{{ {expr.source} }}}} names a field the payload does not have")
    return value


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return ""
    if isinstance(value, int | float):
        return str(value)
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def find_path(document: Any, path: str) -> Any:
    """``document`` at a dotted ``path`` (``error.code``, ``items.0.id``); ``None`` if absent."""
    value = document
    for part in path.split("."):
        if isinstance(value, Mapping) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return value


def set_path(document: dict[str, Any], path: str, value: Any) -> None:
    """Set ``document`` at a dotted ``path``, making the tables on the way."""
    parts = path.split(".")
    here = document
    for part in parts[:-1]:
        nxt = here.get(part)
        if not isinstance(nxt, dict):
            nxt = {}
            here[part] = nxt
        here = nxt
    here[parts[-1]] = value
