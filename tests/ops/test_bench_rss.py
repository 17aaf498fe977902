"""``make bench-rss``: a dispatcher's memory over a long drain.

The figure itself is a measurement and is never tested; how growth is read off
the samples, and that the run drains its whole backlog through the stock loop and
says so, are.
"""

from __future__ import annotations

import json

import pytest

from bench.perf import rss


def test_growth_is_read_from_a_tenth_of_the_drain_to_its_end() -> None:
    # (monotonic time, delivered so far, RSS in KiB): start-up first, then flat, then a leak.
    samples = [(0.0, 0, 50_000), (1.0, 50, 80_000), (2.0, 100, 100_000), (3.0, 1_000, 110_000)]
    assert rss.growth(samples, 1_000) == (100_000, 110_000, pytest.approx(10.0))
    # Start-up's growth (50 to 100 MiB before a tenth is delivered) is not counted.
    assert rss.growth([*samples[:3], (3.0, 1_000, 100_000)], 1_000)[2] == pytest.approx(0.0)


def test_a_short_drain_delivers_every_effect_and_prints_its_verdict(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert rss.main(["--db", "sqlite", "--effects", "400", "--limit", "300"]) == 0
    out = capsys.readouterr().out
    figures = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert figures["delivered"] == figures["effects"] == 400
    assert figures["rss_early_mib"] > 0 and figures["rss_end_mib"] > 0
    assert out.rstrip().endswith("target <= 10%: PASS")
