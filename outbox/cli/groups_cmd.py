"""``outbox groups blocked``: ordering groups held back, and the effect holding each.

outbox groups blocked [--tenant T] [--adapter A] [--all] [--json]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

LIMIT_DEFAULT = 100


def register(sub: argparse._SubParsersAction[Any]) -> None:
    p_groups = sub.add_parser("groups", help="ordering groups: which are held back, and why")
    g_sub = p_groups.add_subparsers(dest="groups_command", metavar="ACTION", required=True)
    p = g_sub.add_parser(
        "blocked",
        help="groups with effects waiting behind an open one",
        description="Each group whose later effects wait for its head: a retry, an unknown "
        "outcome or a review item. Other groups are not held back.",
    )
    p.add_argument("--tenant")
    p.add_argument("--adapter")
    p.add_argument("--all", action="store_true", help="also groups whose head is merely queued")
    p.add_argument("--limit", type=int, default=LIMIT_DEFAULT)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(handler=cmd_groups_blocked)


def cmd_groups_blocked(args: argparse.Namespace) -> int:
    # Imported here: building the parser stays light for every other command.
    from outbox.delivery import ordering
    from outbox.service import Outbox

    with Outbox(getattr(args, "database_url", None)) as box:
        groups = ordering.blocked_groups(
            box.engine,
            tenant=args.tenant,
            adapter=args.adapter,
            include_queued=args.all,
            limit=args.limit,
        )
    if args.json:
        print(json.dumps(groups, indent=2, sort_keys=True))
        return 0
    if not groups:
        print("no ordering group is held back")
        return 0
    columns = ("tenant", "adapter", "ordering_key", "waiting", "blocked_by", "head", "status")
    rows = [
        (
            g["tenant"],
            g["adapter"],
            g["ordering_key"],
            str(g["waiting"]),
            g["blocked_by"],
            f"#{g['head']['id']}",
            f"{g['head']['status']} ({g['head']['reason']})",
        )
        for g in groups
    ]
    widths = [max(len(c), *(len(r[n]) for r in rows)) for n, c in enumerate(columns)]
    for line in (columns, *rows):
        print("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip())
    return 0
