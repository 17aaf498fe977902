"""``python -m bench.perf``: throughput and latency as ratios to same-run baselines.

Every case measures Outbox next to a baseline (and, where the issue names them,
the peers pgqueuer and procrastinate) in the same run, interleaved, because the
machines we run on move by up to 40% between runs. Absolute figures are printed
for the record; the claims are the ratios.
"""

from __future__ import annotations
