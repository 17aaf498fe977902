"""``outbox tools list``: the tools of the app this command line serves.

    outbox tools list [--json] [--app package.module:attribute]

One line per tool: its name, payload version and the adapters its effects
use (as the tool declares them), then the app's name and where its adapters
come from.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from outbox import app as apps
from outbox import settings


def register(sub: argparse._SubParsersAction[Any]) -> None:
    p_tools = sub.add_parser("tools", help="the tools of the app (--app / OUTBOX_APP)")
    t_sub = p_tools.add_subparsers(dest="tools_command", metavar="ACTION", required=True)
    p = t_sub.add_parser("list", help="name, payload version and adapters of each tool")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(handler=cmd_tools_list)


def describe(app: apps.App) -> list[dict[str, Any]]:
    rows = []
    for name in app.tools.names():
        tool = app.tools.get(name)
        rows.append(
            {
                "name": tool.name,
                "payload_version": tool.payload_version,
                "adapters": list(tool.adapters),
                "description": tool.description,
            }
        )
    return rows


def cmd_tools_list(args: argparse.Namespace) -> int:
    app = apps.from_args(args)
    rows = describe(app)
    if args.json:
        print(json.dumps({"app": app.name, "tools": rows}, indent=2, sort_keys=True))
        return 0
    table = [("TOOL", "VERSION", "ADAPTERS")] + [
        (r["name"], str(r["payload_version"]), ", ".join(r["adapters"]) or "-") for r in rows
    ]
    widths = [max(len(line[n]) for line in table) for n in range(3)]
    for line in table:
        print("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip())
    override = settings.load().adapters
    source = override or (str(app.adapters_file) if app.adapters_file else None)
    if source is None:
        source = "python" if app.adapters_factory else "built-in default"
    elif app.adapters_factory:
        source += " + python"
    print(f"app {app.name}: {len(rows)} tools; adapters from {source}")
    return 0
