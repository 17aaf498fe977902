"""``outbox reconciler`` and ``outbox review``: registered into the ``outbox`` command."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: argparse._SubParsersAction[Any]) -> None:  # filled in by the reconciler
    del sub
