"""The app the stock processes serve: ``OUTBOX_APP=refunds_app.app:app``."""

from __future__ import annotations

from outbox.app import App
from refunds_app import tables, tools

app = App(
    "refunds",
    tools=[tools.ISSUE_REFUND, tools.NOTIFY_CUSTOMER],
    adapters_file="adapters.toml",  # next to this module
    metadata=tables.metadata,
    migrations="migrations",  # the alembic versions folder of the refunds table
)
