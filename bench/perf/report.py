"""Medians, ratios to the same run's baseline, and the issue's targets, as a table.

Every measurement is one row (``case``, ``system``, ``db``, variant fields,
figures). The table groups rows by (case, db, variant, system), takes the
median of each figure over the repetitions, divides by the baseline's median
from the same run, and checks the target that applies. A missed target is
printed as missed, with its ratio. Where a case has a second yardstick
(``ALSO_VS``), Outbox gets one more row, its ratio to that system, which
carries the targets set against that system.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

VARIANT_KEYS = ("clients", "processes", "concurrency", "rate", "finished")
# The figure each case is judged by, and whether bigger is better.
METRICS: dict[str, list[tuple[str, bool]]] = {
    "create": [("ops_per_s", True)],
    "replay": [("ops_per_s", True)],
    "dispatch": [("effects_per_s", True)],
    "latency": [
        ("p50_ms", False),
        ("p90_ms", False),
        ("p99_ms", False),
        ("max_ms", False),
        ("claim_p50_ms", False),  # the claim's share of the latency (Outbox and raw)
    ],
    "http": [("effects_per_s", True)],
    "scale": [("effects_per_s", True)],
    "rss": [("growth_pct", False), ("rss_end_mib", False)],
}
# case -> (baseline system, variant override): what each figure is divided by.
# Replay is judged against the create path of the same run.
BASELINE: dict[str, tuple[str | None, str | None]] = {
    "create": ("raw", None),
    "replay": ("outbox", None),
    "dispatch": ("raw", None),
    "latency": ("raw", None),
    "http": ("provider", None),
    "scale": ("outbox", "finished=0"),
    "rss": (None, None),
}
# case -> systems Outbox is also divided by, one extra row each, beside the baseline
# (which stays the yardstick): "minimal" is the baseline's loop on bare tables with
# one index, so Outbox against it is what our schema costs too.
ALSO_VS: dict[str, tuple[str, ...]] = {"create": ("minimal",), "dispatch": ("minimal",)}


@dataclass(frozen=True)
class Target:
    case: str
    db: str
    variant: str
    system: str
    metric: str
    kind: str  # "ratio>=", "ratio<=", ">=", "<=", ">=x:SYSTEM", ">=x:VARIANT"
    bound: float | str
    text: str


# The targets of the performance issue (#22). Kinds: "ratio>=" / "ratio<=" against the
# case's baseline; ">=" / "<=" an absolute figure; ">=x:SYSTEM" at least ``bound`` times
# another system's median in the same variant; ">=x:VARIANT" at least ``bound`` times the
# same system's median in another variant (scaling: more processes must not do less).
def _outbox(
    case: str, db: str, variant: str, metric: str, kind: str, bound: float | str, text: str
) -> Target:
    """A target on Outbox's own figure (every target is)."""
    return Target(case, db, variant, "outbox", metric, kind, bound, text)


_DBS = ("postgres", "sqlite")
TARGETS = [
    _outbox("create", "postgres", "clients=1", "ops_per_s", "ratio>=", 0.9, ">=0.9x raw"),
    _outbox("create", "postgres", "clients=1", "ops_per_s", ">=x:minimal", 0.85, ">=0.85x minimal"),
    _outbox("create", "postgres", "clients=4", "ops_per_s", "ratio>=", 0.8, ">=0.8x raw"),
    _outbox("create", "sqlite", "clients=1", "ops_per_s", "ratio>=", 0.25, ">=0.25x raw"),
    _outbox("create", "sqlite", "clients=1", "ops_per_s", ">=", 5000, ">=5000/s"),
    *(
        _outbox("replay", db, clients, "ops_per_s", "ratio>=", 2.0, ">=2x create")
        for db in _DBS
        for clients in ("clients=1", "clients=4")
    ),
    _outbox("dispatch", "postgres", "processes=1", "effects_per_s", "ratio>=", 0.6, ">=0.6x raw"),
    _outbox(
        "dispatch",
        "postgres",
        "processes=1",
        "effects_per_s",
        ">=x:pgqueuer",
        1.2,
        ">=1.2x pgqueuer",
    ),
    _outbox("dispatch", "postgres", "processes=2", "effects_per_s", "ratio>=", 0.55, ">=0.55x raw"),
    # Scaling: each count of processes against half as many.
    *(
        _outbox(
            "dispatch",
            "postgres",
            f"processes={n}",
            "effects_per_s",
            f">=x:processes={n // 2}",
            1.0,
            f"not below {n // 2} process{'es' if n > 2 else ''}",
        )
        for n in (2, 4, 8)
    ),
    _outbox("dispatch", "sqlite", "processes=1", "effects_per_s", "ratio>=", 0.35, ">=0.35x raw"),
    _outbox("latency", "postgres", "rate=200", "p50_ms", "ratio<=", 1.3, "<=1.3x raw"),
    _outbox("latency", "postgres", "rate=200", "p99_ms", "<=", 2.5, "<=2.5 ms"),
    _outbox("latency", "sqlite", "rate=200", "p99_ms", "<=", "poll+1", "<=poll+1 ms"),
    *(
        _outbox("http", db, "concurrency=32", "effects_per_s", "ratio>=", 0.8, ">=0.8x provider")
        for db in _DBS
    ),
    *(
        _outbox("scale", db, "finished>0", "effects_per_s", "ratio>=", 0.8, ">=0.8x empty")
        for db in _DBS
    ),
    *(_outbox("rss", db, "", "growth_pct", "<=", 10.0, "<=10% growth") for db in _DBS),
]


def variant_of(row: dict[str, Any]) -> str:
    return ",".join(f"{k}={row[k]}" for k in VARIANT_KEYS if k in row)


def _key(case: str, db: str, variant: str, system: str) -> tuple[str, str, str, str]:
    return (case, db, variant, system)


def _vs(target: Target) -> str | None:
    """The extra row (``ALSO_VS``) a target is printed on, or None: the case's own row."""
    against = target.kind.removeprefix(">=x:") if target.kind.startswith(">=x:") else None
    return against if against in ALSO_VS.get(target.case, ()) else None


def build(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (case, db, variant, system, metric): median, baseline, ratio, target."""
    groups: dict[tuple[str, str, str, str], list[dict[str, Any]]] = {}
    for row in rows:
        key = _key(row["case"], row["db"], variant_of(row), row["system"])
        groups.setdefault(key, []).append(row)
    medians: dict[tuple[str, str, str, str, str], float] = {}
    extras: dict[tuple[str, str, str, str], dict[str, Any]] = {}
    for key, members in groups.items():
        for metric, _ in METRICS.get(key[0], []):
            values = [m[metric] for m in members if isinstance(m.get(metric), int | float)]
            if values:
                medians[(*key, metric)] = statistics.median(values)
            elif any(metric in m for m in members):
                # Measured as null (e.g. creates never delivered): shown, and fails its target.
                medians[(*key, metric)] = float("nan")
        extras[key] = {
            "n": len(members),
            "note": next((m["note"] for m in members if m.get("note")), ""),
            "poll_ms": next((m["poll_ms"] for m in members if "poll_ms" in m), None),
        }
    table = []
    for figure, value in medians.items():
        case, db, variant, system, metric = figure
        base_system, base_variant = BASELINE.get(case, (None, None))
        base_key: tuple[str, str, str, str, str] | None = None
        if case == "replay":
            base_key = ("create", db, variant, "outbox", metric)
        elif base_system is not None:
            base_key = (case, db, base_variant or variant, base_system, metric)
        extra = extras[(case, db, variant, system)]
        entry = _entry(figure, value, base_key, None, medians, extra)
        table.append(_with_spread(entry, groups, base_key))
        if system != "outbox":
            continue
        for other in ALSO_VS.get(case, ()):
            vs_key = (case, db, variant, other, metric)
            # Printed when measured, and when a target needs it (then missed, not left out).
            if vs_key in medians or any(_vs(t) == other and _applies(t, *figure) for t in TARGETS):
                entry = _entry(figure, value, vs_key, other, medians, extra)
                table.append(_with_spread(entry, groups, vs_key))
    order = list(METRICS)
    table.sort(
        key=lambda e: (
            order.index(e["case"]),
            e["db"],
            e["variant"],
            e["system"] != "outbox",
            e["system"],
        )
    )
    return table


def _entry(
    key: tuple[str, str, str, str, str],
    value: float,
    base_key: tuple[str, str, str, str, str] | None,
    vs: str | None,
    medians: dict[tuple[str, str, str, str, str], float],
    extra: dict[str, Any],
) -> dict[str, Any]:
    """One row of the table: ``key``'s median against ``base_key``'s, with the targets
    printed on this row (``vs``: the extra row against that system, else the case's row)."""
    case, db, variant, system, metric = key
    if base_key == key:
        base_key = None
    baseline = medians.get(base_key) if base_key else None
    ratio = value / baseline if baseline and not math.isnan(value) else None
    entry = {
        "case": case,
        "db": db,
        "variant": variant,
        "system": system,
        "metric": metric,
        "median": value,
        "baseline": f"{base_key[0]}/{base_key[3]} {base_key[2]}" if base_key and baseline else "",
        "ratio": ratio,
        "n": extra["n"],
        "note": extra["note"],
        "target": "",
        "met": None,
        "bounds": [],  # the ratio targets' lines, for printing the ratio finely near one
    }
    for target in TARGETS:
        if _vs(target) != vs or not _applies(target, case, db, variant, system, metric):
            continue
        met = _check(target, value, ratio, medians, extra)
        if target.kind in ("ratio>=", "ratio<="):
            entry["bounds"].append(float(target.bound))
        entry["target"] = (entry["target"] + "; " if entry["target"] else "") + target.text
        entry["met"] = met if entry["met"] is None else (entry["met"] and met)
    return entry


def rep_ratios(
    groups: dict[tuple[str, str, str, str], list[dict[str, Any]]],
    key: tuple[str, str, str, str, str],
    base_key: tuple[str, str, str, str, str],
) -> list[float]:
    """The figure over its baseline's, repetition by repetition (the same ``rep`` of an
    interleaved run): how far one repetition's ratio strays from the medians'."""
    metric = key[4]

    def by_rep(k: tuple[str, str, str, str, str]) -> dict[Any, float]:
        return {
            m["rep"]: float(m[metric])
            for m in groups.get(k[:4], [])
            if "rep" in m and isinstance(m.get(metric), int | float)
        }

    mine, base = by_rep(key), by_rep(base_key)
    return [mine[r] / base[r] for r in sorted(mine) if base.get(r)]


def _with_spread(
    entry: dict[str, Any],
    groups: dict[tuple[str, str, str, str], list[dict[str, Any]]],
    base_key: tuple[str, str, str, str, str] | None,
) -> dict[str, Any]:
    """``entry`` with ``rep_ratios``, when it has a ratio to a baseline."""
    if entry["ratio"] is not None and base_key is not None:
        key = (entry["case"], entry["db"], entry["variant"], entry["system"], entry["metric"])
        entry["rep_ratios"] = rep_ratios(groups, key, base_key)
    return entry


def _applies(target: Target, case: str, db: str, variant: str, system: str, metric: str) -> bool:
    if (target.case, target.db, target.system, target.metric) != (case, db, system, metric):
        return False
    if target.variant == "finished>0":  # whatever history size the run could afford
        return variant.startswith("finished=") and variant != "finished=0"
    return target.variant == variant


def _check(
    target: Target,
    value: float,
    ratio: float | None,
    medians: dict[tuple[str, str, str, str, str], float],
    extra: dict[str, Any],
) -> bool:
    if math.isnan(value):
        return False
    if target.kind == "ratio>=":
        return ratio is not None and ratio >= float(target.bound)
    if target.kind == "ratio<=":
        return ratio is not None and ratio <= float(target.bound)
    if target.kind in (">=", "<="):
        bound = float(target.bound) if target.bound != "poll+1" else (extra.get("poll_ms") or 0) + 1
        return value >= bound if target.kind == ">=" else value <= bound
    if target.kind.startswith(">=x:"):
        against = target.kind.removeprefix(">=x:")
        if "=" in against:  # another variant of the same system
            key = (target.case, target.db, against, target.system, target.metric)
        else:  # another system in the same variant
            key = (target.case, target.db, target.variant, against, target.metric)
        other = medians.get(key)
        return other is not None and not math.isnan(other) and value >= float(target.bound) * other
    raise ValueError(f"unknown target kind {target.kind!r}")


def _fmt(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _markdown(head: list[str], rows: list[list[str]]) -> str:
    """A Markdown table (pasted into docs/performance.md as it is)."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def _ratio(ratio: float, bounds: list[float]) -> str:
    """Two decimals; three where two would print a target's own line (0.548 against
    ">=0.55x" would read "0.55x ... MISS")."""
    text = f"{ratio:.2f}"
    if any(text == f"{bound:.2f}" and ratio != bound for bound in bounds):
        text = f"{ratio:.3f}"
    return f"{text}x"


def _spread(ratios: list[float]) -> str:
    """The lowest and highest per-repetition ratio: a target inside it is a coin toss."""
    if len(ratios) < 2:
        return "-"
    return f"{min(ratios):.2f} to {max(ratios):.2f}x"


def render(table: list[dict[str, Any]]) -> str:
    """A Markdown table (it is pasted into docs/performance.md as it is)."""
    head = [
        "case",
        "db",
        "variant",
        "system",
        "figure",
        "median",
        "vs",
        "ratio",
        "per rep",
        "target",
        "met",
    ]
    rows = []
    for e in table:
        met = "" if e["met"] is None else ("PASS" if e["met"] else "**MISS**")
        cells = [
            e["case"],
            e["db"],
            e["variant"] or "-",
            e["system"] + (f" ({e['note']})" if e["note"] else ""),
            e["metric"],
            _fmt(e["median"]),
            e["baseline"] or "-",
            _ratio(e["ratio"], e.get("bounds") or []) if e["ratio"] is not None else "-",
            _spread(e.get("rep_ratios") or []),
            e["target"],
            met,
        ]
        rows.append(cells)
    return _markdown(head, rows)


# --- CPU per operation, and the ceiling it sets ------------------------------------

CPU_CASES = ("create", "dispatch")
STREAMS = {"create": "clients", "dispatch": "processes"}


def cpu_table(rows: list[dict[str, Any]], cores: int) -> list[dict[str, Any]]:
    """Per (case, db, variant, system): the medians of the clients' and the server's CPU
    per operation, and the most operations a second that CPU allows.

    No system does more operations a second than ``cores`` cores can pay for:
    cores / (client + server CPU per operation). A loop that waits for each reply
    (every create client, and the baselines' drain loops) is bounded tighter: one
    stream runs at most at 1 / (client + server), ``n`` streams at min(n, cores)
    times that. Outbox's dispatcher on PostgreSQL overlaps its work (runners send
    while a batch is recorded, and the finish of one batch is written while the next
    is claimed, each on its own server process), so only the cores bound it. On
    SQLite everything runs in the dispatcher's process, one core at a time (its
    threads share the interpreter's lock and the database's one writer; its CPU per
    effect equals its wall time per effect), so a process is one stream. The ceiling
    divided by the baseline's measured rate in the same run is the best ratio this
    CPU per operation allows: a target above it cannot be met without spending less
    CPU per operation, whatever else changes. SQLite runs inside the client: its
    work is in the client's figure.
    """
    groups: dict[tuple[str, str, str, str], list[dict[str, Any]]] = {}
    measured: dict[tuple[str, str, str, str], list[float]] = {}
    for row in rows:
        if row["case"] not in CPU_CASES:
            continue
        key = _key(row["case"], row["db"], variant_of(row), row["system"])
        rate = row.get(METRICS[row["case"]][0][0])
        if isinstance(rate, int | float):
            measured.setdefault(key, []).append(rate)
        if isinstance(row.get("client_cpu_us"), int | float):
            groups.setdefault(key, []).append(row)
    rates = {key: statistics.median(values) for key, values in measured.items()}
    table = []
    for key, members in sorted(groups.items()):
        case, db, variant, system = key
        client = statistics.median(m["client_cpu_us"] for m in members)
        servers = [
            m["server_cpu_us"] for m in members if isinstance(m.get("server_cpu_us"), int | float)
        ]
        server = statistics.median(servers) if servers else None
        preempted = [
            m["preempted_per_op"]
            for m in members
            if isinstance(m.get("preempted_per_op"), int | float)
        ]
        total = client + (server or 0.0)
        overlaps = case == "dispatch" and system == "outbox" and db == "postgres"
        streams = cores if overlaps else min(int(members[0].get(STREAMS[case], 1)), cores)
        ceiling = streams * 1e6 / total if total > 0 else float("nan")
        base = rates.get((case, db, variant, BASELINE[case][0] or ""))
        table.append(
            {
                "case": case,
                "db": db,
                "variant": variant,
                "system": system,
                "client_cpu_us": client,
                "server_cpu_us": server,
                "cpu_us": total,
                "preempted_per_op": statistics.median(preempted) if preempted else None,
                "rate": rates.get(key),
                "ceiling": ceiling,
                "baseline_rate": base,
                "ceiling_ratio": ceiling / base if base else None,
            }
        )
    return table


def render_cpu(table: list[dict[str, Any]]) -> str:
    head = [
        "case",
        "db",
        "variant",
        "system",
        "client µs/op",
        "server µs/op",
        "CPU µs/op",
        "client preempted /op",
        "measured /s",
        "ceiling /s",
        "ceiling / raw's measured",
    ]
    rows = []
    for e in table:
        cells = [
            e["case"],
            e["db"],
            e["variant"] or "-",
            e["system"],
            _fmt(e["client_cpu_us"]),
            _fmt(e["server_cpu_us"]) if e["server_cpu_us"] is not None else "(in client)",
            _fmt(e["cpu_us"]),
            f"{e['preempted_per_op']:.2f}" if e.get("preempted_per_op") is not None else "-",
            _fmt(e["rate"]),
            _fmt(e["ceiling"]),
            f"{e['ceiling_ratio']:.2f}x" if e["ceiling_ratio"] is not None else "-",
        ]
        rows.append(cells)
    return _markdown(head, rows)
