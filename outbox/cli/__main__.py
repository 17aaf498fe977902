"""``python -m outbox.cli``: the same as the ``outbox`` command."""

from __future__ import annotations

import sys

from outbox.cli import main

sys.exit(main())
