"""Fair sharing under a flood, measured: ``make bench-flood`` (a latency ratio, so not in ``make test``)."""
