"""Lost replies that drain in seconds: ``python -m bench.drain`` (``make bench-drain``)."""
