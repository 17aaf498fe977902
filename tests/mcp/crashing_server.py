"""`outbox mcp` that dies (really: ``os._exit``) after a create commits, before it replies.

Run as ``python -m tests.mcp.crashing_server --database-url URL mcp``: the
lost-reply window of a call, as a host sees it when the server is killed.
"""

from __future__ import annotations

import os
import sys

from outbox import cli, faults

if __name__ == "__main__":
    faults.arm("mcp.after_execute", lambda: os._exit(70))
    sys.exit(cli.main(sys.argv[1:]))
