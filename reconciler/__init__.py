"""The reconciler: sweeps that settle what the dispatcher cannot (expired leases,
deadlines, unknown outcomes, retention) and the operator review queue.

    from reconciler import review, sweeps

``sweeps.build(...)`` gives every sweep (each ``run_once(now) -> int``);
``review.list_items``, ``review.show`` and ``review.resolve`` are the queue.
"""

from __future__ import annotations
