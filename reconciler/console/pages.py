"""Rendering: the Jinja2 environment, the filters the templates use, the chart.

Templates and static files ship inside the package (no CDN, no external font):
the console must work on a host with no way out to the internet, which is
exactly where an on-call operator may be looking at it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from importlib import resources
from typing import Any
from urllib.parse import quote, urlencode

import jinja2
from starlette.responses import HTMLResponse

from reconciler import review
from reconciler.console import plots

# Every page: no inline script or style, no framing, nothing cached, no referrer.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}

STATIC_FILES = {"console.css": "text/css", "console.js": "text/javascript"}

GROUP_LABELS = {
    review.Group.AWAITING_REVIEW.value: "Awaiting review",
    review.Group.AWAITING_LOOKUP.value: "Awaiting lookup",
}
CHOICE_LABELS = {
    "happened": "It happened",
    "not_happened_requeue": "It did not happen: deliver it again (same key)",
    "not_happened_abandon": "It did not happen, and must not: abandon it",
}


def age(value: timedelta | None) -> str:
    """``timedelta`` as an operator reads it: ``45s``, ``12m 5s``, ``3h 20m``, ``2d 4h``."""
    if value is None:
        return "-"
    seconds = max(0, int(value.total_seconds()))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    if minutes:
        return f"{minutes}m {secs}s"
    return f"{secs}s"


def when(value: datetime | str | None) -> str:
    """A timestamp in UTC to the second; the full value stays in ``<time datetime>``."""
    if value is None:
        return "-"
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return value.strftime("%Y-%m-%d %H:%M:%S UTC")


def iso(value: datetime | str | None) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else value.isoformat()


def pretty_json(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class Alert:
    """What went wrong, shown first on the page and focused when it loads.

    ``summary`` says what failed; each detail is one real cause, with the id
    of the field it is about when there is one (the detail links to it).
    """

    summary: str
    details: tuple[tuple[str, str | None], ...] = ()
    tone: str = "error"  # "error" or "warn"

    @classmethod
    def of(cls, summary: str, *causes: str, tone: str = "error") -> Alert:
        return cls(summary, tuple((c, None) for c in causes), tone)


def operation_url(operation_id: str) -> str:
    """The operation's page: one path segment, every reserved character escaped.

    An id that a browser would read as a dot segment (``.``, ``..``) goes in
    the query instead, where nothing rewrites it.
    """
    if operation_id in ("", ".", ".."):
        return "/console/operations?" + urlencode({"id": operation_id})
    return "/console/operations/" + quote(operation_id, safe="")


def effect_url(effect_id: int) -> str:
    return f"/console/items/{effect_id}"


def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("reconciler.console", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        age=age,
        when=when,
        iso=iso,
        pretty_json=pretty_json,
        operation_url=operation_url,
        effect_url=effect_url,
        plot_svg=plots.svg,
        plot_text=plots.describe,
    )
    env.globals.update(
        group_labels=GROUP_LABELS, choice_labels=CHOICE_LABELS, plot_series=plots.SERIES
    )
    return env


class Renderer:
    def __init__(self) -> None:
        self.env = environment()

    def page(self, template: str, status: int = 200, **context: Any) -> HTMLResponse:
        body = self.env.get_template(template).render(**context)
        return HTMLResponse(body, status_code=status, headers=SECURITY_HEADERS)


def static_file(name: str) -> bytes:
    return resources.files("reconciler.console").joinpath("static", name).read_bytes()


# --- the chart ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Bar:
    label: str
    count: int
    y: int  # top of the bar's row
    width: int  # bar length in px


@dataclass(frozen=True, slots=True)
class Chart:
    bars: list[Bar]
    width: int
    height: int
    label_width: int
    bar_height: int
    plot_width: int


def bar_chart(
    data: list[tuple[str, int]], *, width: int = 480, label_width: int = 120, row: int = 28
) -> Chart:
    """Horizontal bars, one row per label, scaled to the largest count.

    Drawn as inline SVG by the template: no script, no image request, and it
    scales with the page (``viewBox``).
    """
    plot = width - label_width - 48  # room for the count after the bar
    top = max((count for _, count in data), default=0)
    bars = [
        Bar(
            label=label,
            count=count,
            y=i * row,
            width=0 if top == 0 else max(2 if count else 0, round(plot * count / top)),
        )
        for i, (label, count) in enumerate(data)
    ]
    return Chart(bars, width, max(row, row * len(data)), label_width, row - 10, plot)
