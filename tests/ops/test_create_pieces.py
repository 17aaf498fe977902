"""``python -m bench.perf.create_pieces``: a create's Python, piece by piece.

The timings are never tested; that each piece runs the library's own code for a
create, and that the table's sums add up, is.
"""

from __future__ import annotations

import re

import pytest

from bench.perf import create_pieces
from outbox.creating import create

pytestmark = pytest.mark.postgres

PIECES = [
    "call frame (id, tool, clock, counter, log, result)",
    "arguments validated (the tool's model)",
    "arguments dumped for the digest",
    "digest (canonical JSON, SHA-256)",
    "handler (its context, the task row and its id)",
    "receipt, record and outbox row values",
    "statement parameters",
    "pooled connection out and back, autocommit on and off",
]


def test_every_piece_is_timed_and_the_sums_add_up(postgres_url: str) -> None:
    pieces = create_pieces.measure(30, postgres_url)
    assert list(pieces) == [*PIECES, create_pieces.FLOOR]
    assert all(micros > 0 for micros in pieces.values())
    # The ids drawn ahead for the handler are not left to a later create of the process.
    assert not create._IDS._free

    lines = create_pieces.table(pieces)
    figures = {
        m.group(1).strip(): float(m.group(2))
        for m in (re.match(r"^(.+?)\s+(-?[\d.]+) µs$", line) for line in lines)
        if m
    }
    assert len(figures) == len(lines) == len(PIECES) + 3
    ours = figures["sum: our Python before the driver"]
    assert ours == pytest.approx(sum(pieces[name] for name in PIECES), abs=0.01)
    floors = figures[create_pieces.FLOOR]
    assert figures["what ours adds over the floor"] == pytest.approx(ours - floors, abs=0.02)
