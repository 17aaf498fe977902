"""``python -m bench.perf.create_pieces``: a create's Python, piece by piece.

The timings are never tested; that each piece runs the library's own code for a
create, and that the table's sums add up, is.
"""

from __future__ import annotations

import re

import pytest

from bench.perf import create_pieces
from outbox.creating import create
from tests.conftest import POSTGRES_URL

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


def test_every_piece_is_timed_and_the_sums_add_up(
    postgres_template: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert create_pieces.main(["--calls", "30", "--pg", POSTGRES_URL]) == 0
    out = capsys.readouterr().out
    figures = {
        m.group(1).strip(): float(m.group(2))
        for m in re.finditer(r"^(.+?)\s+(-?[\d.]+) µs$", out, re.MULTILINE)
    }
    assert [name for name in figures if name in PIECES] == PIECES
    assert all(figures[name] > 0 for name in PIECES)
    ours = figures["sum: our Python before the driver"]
    assert ours == pytest.approx(sum(figures[name] for name in PIECES), abs=0.05)
    floors = figures[create_pieces.FLOOR]
    assert figures["what ours adds over the floor"] == pytest.approx(ours - floors, abs=0.05)
    # The ids drawn ahead for the handler are not left to a later create of the process.
    assert not create._IDS._free
