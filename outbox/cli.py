"""``outbox ...``: the command line. Thin: parse, call, print, exit with a meaningful code.

Exit codes of commands that write on a caller's behalf (``tasks create``):
0 created or replayed, 2 invalid input, 3 conflict (key reused), 4 expired
(reconcile), 5 busy (retry with the same key), 1 anything else.

Commands owned by packages above ``outbox`` (the reconciler, the review queue)
plug in through the ``outbox.commands`` entry point group.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from datetime import timedelta
from importlib import metadata
from typing import Any

from outbox import errors, settings

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_INVALID = 2
EXIT_CONFLICT = 3
EXIT_EXPIRED = 4
EXIT_BUSY = 5

Handler = Callable[[argparse.Namespace], int]


def exit_code(error: BaseException) -> int:
    if isinstance(error, errors.IdempotencyKeyReused | errors.Conflict):
        return EXIT_CONFLICT
    if isinstance(error, errors.OperationExpired):
        return EXIT_EXPIRED
    if isinstance(error, errors.Busy):
        return EXIT_BUSY
    if isinstance(error, errors.RequestError | errors.NotFound | errors.ConfigError):
        return EXIT_INVALID
    return EXIT_ERROR


def error_document(error: errors.OutboxError) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "error": error.problem_type,
        "detail": error.detail,
        "retry": error.retry,
    }
    if isinstance(error, errors.InvalidArguments):
        doc["errors"] = error.errors
    return doc


def _box(args: argparse.Namespace) -> Any:
    from outbox.service import Outbox

    return Outbox(args.database_url)


def print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=True, default=str))


# --- db ---------------------------------------------------------------------


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    from outbox import db

    config = settings.load()
    engine = db.create_engine(config, url=args.database_url)
    try:
        before, after = db.upgrade(engine)
    finally:
        engine.dispose()
    label = db.normalise_url(args.database_url or config.database_url).render_as_string(
        hide_password=True
    )
    if before == after:
        print(f"{label}: already at {after}; nothing to do")
    else:
        print(f"{label}: upgraded {before or 'empty'} -> {after}")
    return EXIT_OK


def cmd_db_current(args: argparse.Namespace) -> int:
    from outbox import db

    engine = db.create_engine(settings.load(), url=args.database_url)
    try:
        current, head = db.current_revision(engine), db.head_revision()
    finally:
        engine.dispose()
    print(f"current: {current or 'not migrated'}; code: {head}")
    return EXIT_OK if current == head else EXIT_INVALID


# --- tenants, tokens ----------------------------------------------------------


def cmd_tenants_create(args: argparse.Namespace) -> int:
    with _box(args) as box:
        print(box.create_tenant(args.name, rate_limit=args.rate_limit))
    return EXIT_OK


def cmd_tenants_update(args: argparse.Namespace) -> int:
    # --rate-limit default: back to OUTBOX_RATE_LIMIT; the API processes apply a new
    # limit from the tenant's next request on.
    rate_limit = None if args.rate_limit == "default" else args.rate_limit
    with _box(args) as box:
        print_json(box.update_tenant(args.name, rate_limit=rate_limit))
    return EXIT_OK


def cmd_tokens_create(args: argparse.Namespace) -> int:
    with _box(args) as box:
        if not box.tenant_exists(args.tenant):
            raise errors.UnknownTenant(args.tenant)
        expires_in = None
        if args.expires_in is not None:
            expires_in = settings.parse_duration(args.expires_in)
            if not isinstance(expires_in, timedelta):
                raise errors.InvalidArguments(
                    [{"field": "--expires-in", "message": "a duration such as 30d, 12h or 90m"}]
                )
        token = box.create_token(args.tenant, args.role, args.label, expires_in=expires_in)
    print(token)
    print(
        "Keep this token now: only its SHA-256 is stored, it cannot be shown again.",
        file=sys.stderr,
    )
    return EXIT_OK


def cmd_tokens_revoke(args: argparse.Namespace) -> int:
    with _box(args) as box:
        revoked = box.revoke_token(args.token)
    print("revoked" if revoked else "no such active token")
    return EXIT_OK if revoked else EXIT_INVALID


# --- tasks, operations ---------------------------------------------------------


def cmd_tasks_create(args: argparse.Namespace) -> int:
    arguments: dict[str, Any] = {"subject": args.subject}
    if args.body is not None:
        arguments["body"] = args.body
    if args.priority is not None:
        arguments["priority"] = args.priority
    if args.no_helpdesk:
        arguments["helpdesk"] = False
    with _box(args) as box:
        result = box.execute(args.tenant, args.operation_id, "create_support_task", arguments)
    print(result.receipt_json)
    print("replayed" if result.replayed else "created", file=sys.stderr)
    return EXIT_OK


def cmd_tasks_show(args: argparse.Namespace) -> int:
    with _box(args) as box:
        print_json(box.get_task(args.tenant, args.task_id))
    return EXIT_OK


def cmd_operations_show(args: argparse.Namespace) -> int:
    with _box(args) as box:
        print_json(box.get_operation(args.tenant, args.operation_id))
    return EXIT_OK


def cmd_prune(args: argparse.Namespace) -> int:
    with _box(args) as box:
        result = box.prune()
    print(f"tombstoned {result.tombstoned}, forgotten {result.forgotten}")
    return EXIT_OK


# --- processes (their modules are imported only when run) -------------------------


def _lazy(module: str, function: str) -> Handler:
    def run(args: argparse.Namespace) -> int:
        import importlib

        handler: Handler = getattr(importlib.import_module(module), function)
        return handler(args)

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="outbox",
        description="Writes to the outside world that are safe to retry.",
    )
    parser.add_argument(
        "--database-url",
        default=None,
        help="overrides OUTBOX_DATABASE_URL (default sqlite:///var/outbox.db)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p_db = sub.add_parser("db", help="schema migrations")
    db_sub = p_db.add_subparsers(dest="db_command", metavar="ACTION", required=True)
    db_sub.add_parser("upgrade", help="apply migrations (safe to run twice)").set_defaults(
        handler=cmd_db_upgrade
    )
    db_sub.add_parser("current", help="show the schema revision").set_defaults(
        handler=cmd_db_current
    )

    p_tenants = sub.add_parser("tenants", help="tenants")
    t_sub = p_tenants.add_subparsers(dest="tenants_command", metavar="ACTION", required=True)
    p = t_sub.add_parser("create", help="create a tenant (safe to repeat)")
    p.add_argument("name")
    p.add_argument(
        "--rate-limit",
        default=None,
        help="its own API rate limit, e.g. 10/second or 6000/minute, or none "
        "(default: OUTBOX_RATE_LIMIT)",
    )
    p.set_defaults(handler=cmd_tenants_create)
    p = t_sub.add_parser("update", help="change a tenant's settings")
    p.add_argument("name")
    p.add_argument(
        "--rate-limit",
        required=True,
        help="its own API rate limit (10/second, none), or 'default' for OUTBOX_RATE_LIMIT",
    )
    p.set_defaults(handler=cmd_tenants_update)

    p_tokens = sub.add_parser("tokens", help="API tokens")
    k_sub = p_tokens.add_subparsers(dest="tokens_command", metavar="ACTION", required=True)
    p = k_sub.add_parser("create", help="mint a token; printed once, only its hash is kept")
    p.add_argument("--tenant", required=True)
    p.add_argument("--role", required=True, choices=["agent", "operator"])
    p.add_argument("--label", default="")
    p.add_argument(
        "--expires-in",
        default=None,
        metavar="DURATION",
        help="the token stops working after this long, e.g. 30d, 12h (default: never)",
    )
    p.set_defaults(handler=cmd_tokens_create)
    p = k_sub.add_parser("revoke", help="revoke a token")
    p.add_argument("token")
    p.set_defaults(handler=cmd_tokens_revoke)

    p_tasks = sub.add_parser("tasks", help="support tasks")
    s_sub = p_tasks.add_subparsers(dest="tasks_command", metavar="ACTION", required=True)
    p = s_sub.add_parser("create", help="create a support task (idempotent on --operation-id)")
    p.add_argument("--tenant", required=True)
    p.add_argument("--operation-id", required=True)
    p.add_argument("--subject", required=True)
    p.add_argument("--body")
    p.add_argument("--priority", choices=["low", "normal", "high"])
    p.add_argument("--no-helpdesk", action="store_true", help="do not open a helpdesk ticket")
    p.set_defaults(handler=cmd_tasks_create)
    p = s_sub.add_parser("show", help="show a task as it is now")
    p.add_argument("--tenant", required=True)
    p.add_argument("task_id", type=int)
    p.set_defaults(handler=cmd_tasks_show)

    p_ops = sub.add_parser("operations", help="operation records (receipts)")
    o_sub = p_ops.add_subparsers(dest="operations_command", metavar="ACTION", required=True)
    p = o_sub.add_parser("show", help="the receipt and each effect's current state")
    p.add_argument("--tenant", required=True)
    p.add_argument("operation_id")
    p.set_defaults(handler=cmd_operations_show)

    p = sub.add_parser("prune", help="apply retention once (the reconciler does it on schedule)")
    p.set_defaults(handler=cmd_prune)

    for name, (module, function, register_name) in PROCESS_COMMANDS.items():
        p = sub.add_parser(name, help=PROCESS_HELP[name])
        _register_process(module, register_name, p)
        p.set_defaults(handler=_lazy(module, function))

    for entry in metadata.entry_points(group="outbox.commands"):
        register: Callable[[Any], None] = entry.load()
        register(sub)
    return parser


# name: (module, run function, options function); the module is imported lazily
# when the command runs, its options function when the parser is built.
PROCESS_COMMANDS: dict[str, tuple[str, str, str]] = {
    "serve": ("outbox.api", "cli_serve", "cli_options"),
    "dispatcher": ("outbox.dispatcher", "cli_run", "cli_options"),
    "dev": ("outbox.dev", "cli_run", "cli_options"),
}
PROCESS_HELP = {
    "serve": "run the HTTP API and the operator console",
    "dispatcher": "deliver outbox rows through their adapters",
    "dev": "run API, dispatcher, reconciler and a fake provider on this machine",
}


def _register_process(module: str, function: str, parser: argparse.ArgumentParser) -> None:
    import importlib

    try:
        options: Callable[[argparse.ArgumentParser], None] = getattr(
            importlib.import_module(module), function
        )
    except (ImportError, AttributeError):
        return
    options(parser)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except errors.OutboxError as error:
        print(json.dumps(error_document(error), sort_keys=True), file=sys.stderr)
        return exit_code(error)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
