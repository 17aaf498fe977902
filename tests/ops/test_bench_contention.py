"""The contention probe's accounting (``make bench-contention``).

The probe reads a four-client create's extra CPU as "more work" or "the same work
costing more" from two counts: the calls a create makes and the CPU a fixed canary
takes. Both are tested here on loops of known size; the timings never are.
"""

from __future__ import annotations

import time

import pytest

from bench import contention

CALLS_PER_OP = 4


def _leaf() -> None:
    pass


def _op(i: int) -> None:
    # One call of _op itself, two of _leaf, one C call: four calls an operation.
    _leaf()
    _leaf()
    len(())


def test_calls_are_counted_per_operation_and_the_canary_is_left_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(contention, "MAX_OPS", 64)
    now = time.monotonic()
    # Bounded by MAX_OPS, never by the clock: the end is an hour away.
    report = contention._loop(_op, now, now + 3600, count_calls=True)
    assert report["ops"] == 64
    assert report["calls"] == 64 * CALLS_PER_OP
    assert report["canaries"] == 64 // contention.EVERY
    assert report["canary_ns"] > 0


def test_without_counting_no_calls_are_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(contention, "MAX_OPS", 16)
    now = time.monotonic()
    report = contention._loop(_op, now, now + 3600, count_calls=False)
    assert (report["ops"], report["calls"]) == (16, 0)


def _row(kind: str, system: str, clients: int, cpu: float, canary: float, calls: float):
    return {
        "pass": kind,
        "system": system,
        "clients": clients,
        "ops_per_s": 1000.0 * clients,
        "cpu_us_per_op": cpu,
        "canary_us": canary,
        "preempted_per_op": 0.5,
        "calls_per_op": calls,
    }


def test_the_summary_divides_four_clients_by_one_from_medians() -> None:
    rows = [
        _row("calls", "outbox", 1, 999.0, 999.0, 300.0),
        _row("calls", "outbox", 4, 999.0, 999.0, 300.0),
        # Three repetitions each: the medians are 150/100 and 330/120.
        *(_row("time", "outbox", 1, cpu, 100.0, 0.0) for cpu in (140.0, 150.0, 500.0)),
        *(_row("time", "outbox", 4, cpu, c, 0.0) for cpu, c in ((330.0, 120.0),) * 3),
        _row("calls", "raw", 1, 0.0, 0.0, 144.0),
    ]
    lines = contention.summarise(rows)
    assert any(line.startswith("outbox") and "150.0" in line for line in lines)
    assert "outbox   4 vs 1:  create CPU 2.20x, canary 1.20x, calls 1.00x" in lines
    # raw has no time pass: no row and no ratio, rather than a ratio of nothing.
    assert not any(line.startswith("raw") for line in lines)
