"""Logging for every process: readable text by default, one JSON object a line with ``json``.

Context travels as ``extra=`` fields with fixed names, so one operation can be
followed across the API, the dispatcher and the reconciler by grepping its id:
``tenant``, ``operation_id``, ``effect_id``, ``attempt``, ``outcome``, ``adapter``,
``worker``. Tokens and request bodies are never logged at info level: only ids.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

CONTEXT_FIELDS = (
    "tenant",
    "operation_id",
    "effect_id",
    "attempt",
    "outcome",
    "adapter",
    "worker",
    "status_code",
    "count",
    "sweep",
)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, Any] = {
            "at": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in CONTEXT_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                document[name] = value
        if record.exc_info:
            document["error"] = self.formatException(record.exc_info)
        return json.dumps(document, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        context = " ".join(
            f"{name}={getattr(record, name)}"
            for name in CONTEXT_FIELDS
            if getattr(record, name, None) is not None
        )
        return f"{line} [{context}]" if context else line


# Libraries ``configure`` holds at warnings: httpx logs every request line with
# its URL at info (too chatty for a dispatcher), apscheduler every run, and
# alembic the schema check on start-up (and on every /readyz), which is not news.
QUIETED = ("httpx", "apscheduler", "alembic")


def configure(log_format: str = "text", level: str = "INFO") -> None:
    """Install one handler on the root logger (stderr). Safe to call twice."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
    root.addHandler(handler)
    root.setLevel(level)
    for name in QUIETED:
        logging.getLogger(name).setLevel(logging.WARNING)
