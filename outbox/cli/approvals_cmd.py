"""``outbox approvals list|show|approve|reject``: an operator's decisions, from a shell.

Each command names the tenant (``--tenant``) and calls the same service as the
HTTP API and the console (``outbox.approvals``). A decision is recorded with
the actor ``--actor`` (default: ``cli:$USER``); repeating the decision that was
made changes nothing and exits 0; the opposite decision exits 3 (conflict).
"""

from __future__ import annotations

import argparse
import getpass
from typing import Any

from outbox import cli, states


def _actor(args: argparse.Namespace) -> str:
    if args.actor:
        return str(args.actor)
    try:
        user = getpass.getuser()
    except (OSError, KeyError):  # no user name in this environment
        user = "unknown"
    return f"cli:{user}"


def cmd_list(args: argparse.Namespace) -> int:
    status = None if args.status == "all" else args.status
    with cli._box(args) as box:
        cli.print_json(box.list_approvals(args.tenant, status=status, limit=args.limit))
    return cli.EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    with cli._box(args) as box:
        cli.print_json(box.show_approval(args.tenant, args.operation_id))
    return cli.EXIT_OK


def _decide(args: argparse.Namespace, decision: states.ApprovalDecision) -> int:
    with cli._box(args) as box:
        result = box.decide_approval(
            args.tenant,
            args.operation_id,
            decision,
            actor=_actor(args),
            reason=args.reason or "",
        )
    cli.print_json(result.to_dict())
    return cli.EXIT_OK


def cmd_approve(args: argparse.Namespace) -> int:
    return _decide(args, states.ApprovalDecision.APPROVE)


def cmd_reject(args: argparse.Namespace) -> int:
    return _decide(args, states.ApprovalDecision.REJECT)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "approvals",
        help="operations waiting for an operator's approval",
        description="List, approve or reject the operations of tools that require approval. "
        "Approval releases the held effects to the dispatcher; rejection is final and "
        "nothing is sent. Both are recorded (who, when, why) and safe to repeat.",
    )
    sub = parser.add_subparsers(dest="approvals_command", metavar="ACTION", required=True)

    p = sub.add_parser("list", help="operations awaiting approval (oldest first)")
    p.add_argument("--tenant", required=True)
    p.add_argument(
        "--status",
        choices=[*(s.value for s in states.ApprovalStatus), "all"],
        default=states.ApprovalStatus.AWAITING_APPROVAL.value,
    )
    p.add_argument("--limit", type=int, default=100)
    p.set_defaults(handler=cmd_list)

    p = sub.add_parser("show", help="one operation: its state, decision and effects' payloads")
    p.add_argument("--tenant", required=True)
    p.add_argument("operation_id")
    p.set_defaults(handler=cmd_show)

    for name, handler, text in (
        ("approve", cmd_approve, "release its held effects to the dispatcher"),
        ("reject", cmd_reject, "fail its held effects; nothing is sent (final)"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("--tenant", required=True)
        p.add_argument("operation_id")
        p.add_argument(
            "--reason",
            required=name == "reject",
            default="",
            help="why (required to reject); kept in the audit",
        )
        p.add_argument("--actor", default=None, help="who is deciding (default: cli:$USER)")
        p.set_defaults(handler=handler)
