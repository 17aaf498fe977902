"""The overview's time series: delivery attempts per adapter, drawn as inline SVG.

Counted from the ``attempts`` table (joined to ``outbox`` for the tenant and
the adapter), in fixed buckets that end with the current one: twelve of five
minutes for the last hour, twenty-four of one hour for the last day. Bucket
edges are aligned to the bucket width, so two reloads a few seconds apart draw
the same bars. Every attempt that finished is put in one series:

- ``delivered``: the provider confirmed it (``delivered``);
- ``retried``: the provider was not reached, or said to try later
  (``not_sent``, ``retryable``): answers that normally lead to another attempt
  (at a provider that ignores keys, one that may have been acted on goes to
  review instead);
- ``unknown``: a send may have happened and nobody knows (``ambiguous``,
  ``abandoned``): what can end in the review queue;
- ``failed``: it cannot go through (``permanent``, ``adapter_error``).

The SVG is built here, in Python, with every text escaped: no script, no
charting library, no request to anywhere, and it passes the console's
Content-Security-Policy (colours come from classes in ``console.css``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from markupsafe import Markup, escape
from sqlalchemy.engine import Engine

from outbox import db, schema, states

O = states.AttemptOutcome


@dataclass(frozen=True, slots=True)
class Series:
    name: str
    label: str
    outcomes: tuple[O, ...]


SERIES = (
    Series("delivered", "Delivered", (O.DELIVERED,)),
    Series("retried", "Retried", (O.NOT_SENT, O.RETRYABLE)),
    Series("unknown", "Unknown", (O.AMBIGUOUS, O.ABANDONED)),
    Series("failed", "Failed", (O.PERMANENT, O.ADAPTER_ERROR)),
)
SERIES_OF = {outcome.value: s.name for s in SERIES for outcome in s.outcomes}


@dataclass(frozen=True, slots=True)
class Window:
    name: str
    label: str
    bucket: timedelta
    buckets: int

    @property
    def span(self) -> timedelta:
        return self.bucket * self.buckets

    def edges(self, now: datetime) -> list[datetime]:
        """``buckets + 1`` edges; the last bucket is the one ``now`` falls in."""
        width = int(self.bucket.total_seconds())
        epoch = math.floor(now.timestamp())
        end = datetime.fromtimestamp((epoch // width + 1) * width, tz=UTC)
        return [end - self.bucket * (self.buckets - i) for i in range(self.buckets + 1)]


HOUR = Window("hour", "Last hour", timedelta(minutes=5), 12)
DAY = Window("day", "Last day", timedelta(hours=1), 24)
WINDOWS = (HOUR, DAY)


@dataclass(frozen=True, slots=True)
class Plot:
    """One adapter over one window: a count per series per bucket."""

    adapter: str
    window: Window
    edges: list[datetime]
    counts: dict[str, list[int]]  # series name -> one count per bucket

    def total(self, series: str) -> int:
        return sum(self.counts[series])

    @property
    def totals(self) -> list[int]:
        return [sum(c) for c in zip(*self.counts.values(), strict=True)]


def attempt_counts(engine: Engine, tenant: str, window: Window, now: datetime) -> dict[str, Plot]:
    """One plot per adapter that finished an attempt in the window, for one tenant only."""
    att, out = schema.attempts, schema.outbox
    edges = window.edges(now)
    # The bucket as a CASE over the edges: the same SQL on SQLite and PostgreSQL,
    # and the edges are bound through the column's own type (UTC either way).
    bucket = sa.case(
        *[(att.c.finished_at < edge, i) for i, edge in enumerate(edges[1:-1])],
        else_=window.buckets - 1,
    )
    rows = (
        sa.select(out.c.adapter, att.c.outcome, bucket.label("bucket"))
        .select_from(att.join(out, att.c.effect_id == out.c.id))
        .where(
            out.c.tenant == tenant,
            att.c.finished_at.is_not(None),
            att.c.finished_at >= edges[0],
            att.c.finished_at < edges[-1],
        )
        .subquery()
    )
    # Grouped outside: PostgreSQL does not see two bound CASEs as one expression.
    query = sa.select(rows.c.adapter, rows.c.outcome, rows.c.bucket, sa.func.count()).group_by(
        rows.c.adapter, rows.c.outcome, rows.c.bucket
    )
    with db.read(engine) as conn:
        found = conn.execute(query).all()
    plots: dict[str, Plot] = {}
    for adapter, outcome, index, count in found:
        plot = plots.get(adapter)
        if plot is None:
            counts = {s.name: [0] * window.buckets for s in SERIES}
            plot = plots[adapter] = Plot(adapter, window, edges, counts)
        plot.counts[SERIES_OF[str(outcome)]][int(index)] += int(count)
    return dict(sorted(plots.items()))


@dataclass(frozen=True, slots=True)
class Panel:
    """One adapter's plots, one per window, in ``WINDOWS`` order."""

    adapter: str
    plots: list[Plot]


def panels(engine: Engine, tenant: str, now: datetime) -> list[Panel]:
    """Every adapter with an attempt in the last day, with its hour and its day."""
    by_window = {w.name: attempt_counts(engine, tenant, w, now) for w in WINDOWS}
    adapters = sorted(set().union(*(found.keys() for found in by_window.values())))
    out = []
    for adapter in adapters:
        plots = []
        for w in WINDOWS:
            plot = by_window[w.name].get(adapter)
            if plot is None:
                counts = {s.name: [0] * w.buckets for s in SERIES}
                plot = Plot(adapter, w, w.edges(now), counts)
            plots.append(plot)
        out.append(Panel(adapter, plots))
    return out


# --- drawing ------------------------------------------------------------------------

WIDTH, HEIGHT = 420, 190
LEFT, RIGHT, TOP, BOTTOM = 40, 10, 12, 28


def nice_ceiling(value: int) -> int:
    """The smallest 1, 2 or 5 times a power of ten at or above ``value`` (at least 1)."""
    if value <= 1:
        return 1
    power = int(10 ** math.floor(math.log10(value)))
    for step in (1, 2, 5, 10):
        if step * power >= value:
            return step * power
    return 10 * power  # pragma: no cover - the loop always returns


def _hhmm(value: datetime) -> str:
    return value.astimezone(UTC).strftime("%H:%M")


def _attrs(**values: object) -> str:
    return " ".join(
        f'{k.rstrip("_").replace("_", "-")}="{escape(str(v))}"' for k, v in values.items()
    )


def _el(tag: str, body: str = "", **attrs: object) -> str:
    return f"<{tag} {_attrs(**attrs)}>{body}</{tag}>"


def describe(plot: Plot) -> str:
    """The plot in one sentence: what a screen reader says, and the SVG's description."""
    totals = ", ".join(f"{plot.total(s.name)} {s.name}" for s in SERIES)
    return (
        f"{plot.window.label}, adapter {plot.adapter}, in buckets of "
        f"{int(plot.window.bucket.total_seconds() // 60)} minutes from "
        f"{_hhmm(plot.edges[0])} to {_hhmm(plot.edges[-1])} UTC: {totals}."
    )


def svg(plot: Plot) -> Markup:
    """Stacked columns, one per bucket, with a y axis scaled to the fullest bucket."""
    ident = f"plot-{plot.adapter}-{plot.window.name}"
    ident = "".join(c if c.isalnum() or c in "-_" else "_" for c in ident)
    inner_w, inner_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    top = nice_ceiling(max(plot.totals, default=0))
    step = inner_w / plot.window.buckets
    bar_w = max(1.0, step * 0.72)
    parts = [
        _el("title", escape(f"{plot.window.label}: {plot.adapter}"), id=f"{ident}-title"),
        _el("desc", escape(describe(plot)), id=f"{ident}-desc"),
    ]
    # Gridlines and the y axis: zero, half and the top.
    for value in sorted({0, top // 2, top}):
        y = TOP + inner_h - inner_h * value / top
        parts.append(
            _el("line", x1=LEFT, x2=WIDTH - RIGHT, y1=f"{y:.1f}", y2=f"{y:.1f}", class_="grid")
        )
        parts.append(
            _el("text", str(value), x=LEFT - 6, y=f"{y + 4:.1f}", class_="axis", text_anchor="end")
        )
    # The columns, each series stacked on the ones before it.
    for i in range(plot.window.buckets):
        x = LEFT + i * step + (step - bar_w) / 2
        base = 0
        start, end = plot.edges[i], plot.edges[i + 1]
        for s in SERIES:
            count = plot.counts[s.name][i]
            if not count:
                continue
            y0 = TOP + inner_h - inner_h * base / top
            y1 = TOP + inner_h - inner_h * (base + count) / top
            tip = f"{_hhmm(start)}-{_hhmm(end)} UTC: {count} {s.name}"
            parts.append(
                _el(
                    "rect",
                    _el("title", escape(tip)),
                    x=f"{x:.1f}",
                    y=f"{y1:.1f}",
                    width=f"{bar_w:.1f}",
                    height=f"{max(y0 - y1, 0.5):.1f}",
                    class_=f"series-{s.name}",
                    data_series=s.name,
                    data_bucket=i,
                    data_count=count,
                )
            )
            base += count
    # The x axis: the first edge, the middle one and the last.
    parts.append(
        _el(
            "line",
            x1=LEFT,
            x2=WIDTH - RIGHT,
            y1=TOP + inner_h,
            y2=TOP + inner_h,
            class_="axis-line",
        )
    )
    for i, anchor in (
        (0, "start"),
        (plot.window.buckets // 2, "middle"),
        (plot.window.buckets, "end"),
    ):
        x = LEFT + i * step
        parts.append(
            _el(
                "text",
                escape(_hhmm(plot.edges[i])),
                x=f"{x:.1f}",
                y=HEIGHT - 8,
                class_="axis",
                text_anchor=anchor,
            )
        )
    body = "".join(parts)
    head = _attrs(
        viewBox=f"0 0 {WIDTH} {HEIGHT}",
        width="100%",
        role="img",
        aria_labelledby=f"{ident}-title {ident}-desc",
        preserveAspectRatio="xMinYMin meet",
        data_adapter=plot.adapter,
        data_window=plot.window.name,
    )
    return Markup(f'<svg xmlns="http://www.w3.org/2000/svg" {head}>{body}</svg>')
