"""The drain case as a test (``make bench-drain`` runs it; it is not part of ``make test``)."""

from __future__ import annotations

from pathlib import Path

from bench.drain.__main__ import TARGET_S, run


def test_seventy_lost_replies_drain_within_thirty_seconds(tmp_path: Path) -> None:
    result = run("refund", 70, 120.0, tmp_path)
    print(result.line())
    assert result.drained_s is not None and result.drained_s <= TARGET_S
    assert result.duplicates == 0 and result.tickets == 70
