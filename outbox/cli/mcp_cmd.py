"""``outbox mcp``: the command. Light on purpose: the SDK is imported only when it runs.

See ``outbox.mcp_server`` for the tools, the key and the answers.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from outbox import logs, settings

TOKEN_ENV = "OUTBOX_TOKEN"

# --- the command ------------------------------------------------------------------------

HELP = "serve the tools to an MCP host (stdio; HTTP is /mcp on `outbox serve`)"
DESCRIPTION = """\
Serve every tool of the loaded app to an MCP host (Model Context Protocol).

Transports:
  stdio            `outbox mcp`: the host starts this process and speaks MCP on its
                   stdin/stdout. Authenticated by the token in OUTBOX_TOKEN (an agent
                   token from `outbox tokens create --tenant T --role agent`).
  streamable HTTP  `outbox serve` answers MCP at /mcp on the same port as the HTTP API,
                   with `Authorization: Bearer <token>` on every request (none: 401).

Both use the API's tokens, tenant scoping and roles. Each write tool takes a
required operation_id: the agent allocates one per intended action and reuses
it unchanged on every retry, so a retried call acts once. Logs go to stderr.
"""
EPILOG = """\
examples:
  OUTBOX_TOKEN=obx_... outbox mcp
  outbox serve --port 8000      # then point the host at http://127.0.0.1:8000/mcp
"""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "mcp",
        help=HELP,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--token-env",
        default=TOKEN_ENV,
        metavar="NAME",
        help=f"the environment variable holding the token (default: {TOKEN_ENV})",
    )
    parser.set_defaults(handler=cli_run)


def cli_run(args: argparse.Namespace) -> int:
    import anyio

    from outbox.mcp.server import Surface, serve_stdio
    from outbox.service import Outbox

    config = settings.load()
    # stdout is the protocol's: every log line goes to stderr.
    logs.configure(config.log_format, config.log_level)  # stderr
    token = os.environ.get(args.token_env, "").strip()
    if not token:
        sys.stderr.write(
            f"outbox mcp: set {args.token_env} to an agent token "
            "(outbox tokens create --tenant T --role agent)\n"
        )
        return 2
    box = Outbox(getattr(args, "database_url", None), config=config)
    try:
        if box.authenticate(token) is None:
            sys.stderr.write(f"outbox mcp: the token in {args.token_env} is unknown or revoked\n")
            return 2
        Surface(box)  # refuse a registry MCP cannot serve before the host connects
        anyio.run(serve_stdio, box, token)
    finally:
        box.close()
    return 0
