"""The chaos run: real processes killed at random, providers that lose replies,
a database that drops connections, under load; then invariants that prove the
guarantees of DESIGN.md, or print the rows that break them.

``python -m bench.chaos`` (``make chaos``); see ``docs/chaos.md``. The checks
(``bench.chaos.invariants``) are the same code the reduced run in the test
suite calls.
"""

from __future__ import annotations
