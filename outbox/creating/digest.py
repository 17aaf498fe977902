"""The argument digest: SHA-256 over canonical JSON of ``{tool, payload_version, arguments}``.

What is normalised, and what is not:

- the arguments are first validated by the tool's model, so defaults are filled
  in and declared transformations applied (``subject`` is stripped) before
  hashing: ``{"subject": " x "}`` and ``{"subject": "x", "priority": "normal"}``
  have the same digest;
- object keys are sorted, and there is no insignificant whitespace (separators
  ``,`` and ``:``); the text is UTF-8, non-ASCII characters written as
  themselves, not as ``\\u`` escapes;
- nothing else: strings are not Unicode-normalised (NFC and NFD spellings
  differ), case is kept, numbers keep their JSON form, and list order matters.

The digest detects changed intent under an existing key. It never replaces the
key: two calls with identical arguments and different keys are two operations.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any


def canonical_json(value: Any) -> bytes:
    return canonical_text(value).encode("utf-8")


def canonical_text(value: Any) -> str:
    """``canonical_json`` as text (how an outbox row stores its payload)."""
    return _CANONICAL.encode(value)


# One encoder for every call: ``json.dumps`` with options builds a new one each time.
_CANONICAL = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
)


def args_digest(tool: str, payload_version: int, arguments: Mapping[str, Any]) -> str:
    document = {"tool": tool, "payload_version": payload_version, "arguments": dict(arguments)}
    return hashlib.sha256(canonical_json(document)).hexdigest()
