"""``outbox ...``: the command line. Thin: parse, call, print, exit with a meaningful code.

Exit codes of commands that write on a caller's behalf (``tasks create``):
0 created or replayed, 2 invalid input, 3 conflict (key reused), 4 expired
(reconcile), 5 busy (retry with the same key), 1 anything else.

Commands owned by packages above ``outbox`` (the reconciler, the review queue)
plug in through the ``outbox.commands`` entry point group.

Every command serves one app (``outbox.app``): ``--app package.module:attribute``
or ``OUTBOX_APP``, else the bundled demo. It is loaded and checked before the
command runs, so a broken app is one line on stderr and exit 2, with nothing
written. ``--app`` and ``--database-url`` go before or after the command.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from datetime import timedelta
from importlib import metadata
from typing import Any

from outbox import app as apps
from outbox import errors, settings
from outbox.cli import groups_cmd as groups_cli

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

    return Outbox(args.database_url, app=apps.from_args(args))


def print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=True, default=str))


# --- db ---------------------------------------------------------------------


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    from outbox import db

    config = settings.load()
    app = apps.from_args(args)
    engine = db.create_engine(config, url=args.database_url)
    try:
        before, after = db.upgrade(engine)
        # The app's tables after Outbox's: its migrations may refer to ours.
        app_before, app_after = app.upgrade(engine)
    finally:
        engine.dispose()
    label = db.normalise_url(args.database_url or config.database_url).render_as_string(
        hide_password=True
    )
    if before == after:
        print(f"{label}: already at {after}; nothing to do")
    else:
        print(f"{label}: upgraded {before or 'empty'} -> {after}")
    if app.migrations is not None:
        if app_before == app_after:
            print(f"app {app.name}: already at {app_after}; nothing to do")
        else:
            print(f"app {app.name}: upgraded {app_before or 'empty'} -> {app_after}")
    return EXIT_OK


def cmd_db_current(args: argparse.Namespace) -> int:
    from outbox import db

    app = apps.from_args(args)
    engine = db.create_engine(settings.load(), url=args.database_url)
    try:
        current, head = db.current_revision(engine), db.head_revision()
        app_head = app.head_revision()
        app_current = app.current_revision(engine) if app_head is not None else None
    finally:
        engine.dispose()
    print(f"current: {current or 'not migrated'}; code: {head}")
    if app_head is not None:
        print(f"app {app.name}: current: {app_current or 'not migrated'}; code: {app_head}")
    return EXIT_OK if current == head and app_current == app_head else EXIT_INVALID


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
        "Keep this token now: only its SHA-256 is stored, it cannot be shown again.\n"
        f"Use it as 'Authorization: Bearer <token>' for tenant {args.tenant!r}; the CLI names "
        f"the tenant itself, e.g. outbox tasks create --tenant {args.tenant} "
        "--operation-id op-1 --subject 'First task'.\n"
        "See it with 'outbox tokens list'; revoke it with 'outbox tokens revoke <id>'.",
        file=sys.stderr,
    )
    return EXIT_OK


def cmd_tokens_list(args: argparse.Namespace) -> int:
    with _box(args) as box:
        tokens = box.list_tokens(args.tenant)
    if args.json:
        print_json(tokens)
        return EXIT_OK
    columns = ("id", "tenant", "role", "label", "created_at", "last_used_at", "revoked_at")
    rows = [[str(t["id"]), *(t[c] or "-" for c in columns[1:])] for t in tokens]
    if not rows:
        print("no tokens" + (f" for tenant {args.tenant!r}" if args.tenant else ""))
        return EXIT_OK
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
    for line in [list(columns), *rows]:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        )
    return EXIT_OK


def cmd_tokens_revoke(args: argparse.Namespace) -> int:
    from outbox.service import TOKEN_PREFIX

    with _box(args) as box:
        if args.token.isdigit():
            revoked = box.revoke_token_id(int(args.token))
        elif args.token.startswith(TOKEN_PREFIX):
            revoked = box.revoke_token(args.token)
        else:
            raise errors.RequestError(
                f"{args.token!r} is neither a token id (see 'outbox tokens list') "
                f"nor a token ({TOKEN_PREFIX}...)"
            )
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
    _common_options(parser, default=None)
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
    p = k_sub.add_parser("list", help="every token: id, tenant, role, label, created, last used")
    p.add_argument("--tenant", help="only this tenant's tokens")
    p.add_argument("--json", action="store_true", help="one JSON array instead of a table")
    p.set_defaults(handler=cmd_tokens_list)
    p = k_sub.add_parser("revoke", help="revoke a token by its id (tokens list) or by the token")
    p.add_argument("token", metavar="ID_OR_TOKEN")
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

    from outbox.cli import tools_cmd as app_cli

    app_cli.register(sub)

    from outbox.cli import adapters_cmd as adapters_cli

    adapters_cli.register(sub)

    from outbox.cli import approvals_cmd as approvals_cli
    from outbox.cli import mcp_cmd as mcp_command

    approvals_cli.register(sub)
    mcp_command.register(sub)

    groups_cli.register(sub)

    for name, (module, function, register_name) in PROCESS_COMMANDS.items():
        p = sub.add_parser(name, help=PROCESS_HELP[name])
        _register_process(module, register_name, p)
        p.set_defaults(handler=_lazy(module, function))

    for entry in metadata.entry_points(group="outbox.commands"):
        register: Callable[[Any], None] = entry.load()
        register(sub)
    _add_common_options_below(parser, set())
    return parser


def _common_options(parser: argparse.ArgumentParser, default: Any) -> None:
    parser.add_argument(
        "--database-url",
        default=default,
        help="overrides OUTBOX_DATABASE_URL (default sqlite:///var/outbox.db)",
    )
    parser.add_argument(
        "--app",
        default=default,
        metavar="MODULE:ATTR",
        help="the app to serve: package.module:attribute "
        "(default OUTBOX_APP, else the bundled demo)",
    )


def _add_common_options_below(parser: argparse.ArgumentParser, seen: set[int]) -> None:
    """``--app`` and ``--database-url`` after any command too (``outbox db upgrade --app X``).

    Below the top level they default to SUPPRESS: an option not given after the
    command leaves the one given before it (or the top level's default) alone.
    """
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        for child in action.choices.values():
            if id(child) in seen:
                continue
            seen.add(id(child))
            taken = {opt for a in child._actions for opt in a.option_strings}
            if "--app" not in taken and "--database-url" not in taken:
                _common_options(child, default=argparse.SUPPRESS)
            _add_common_options_below(child, seen)


# name: (module, run function, options function); the module is imported lazily
# when the command runs, its options function when the parser is built.
PROCESS_COMMANDS: dict[str, tuple[str, str, str]] = {
    "serve": ("outbox.api", "cli_serve", "cli_options"),
    "dispatcher": ("outbox.delivery.dispatcher", "cli_run", "cli_options"),
    "dev": ("outbox.cli.dev", "cli_run", "cli_options"),
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
        # Loaded and checked before anything runs: a broken app writes nothing.
        apps.from_args(args)
        return handler(args)
    except errors.ConfigError as error:
        # Configuration is the operator's to fix: one plain line, no document, no traceback.
        print(f"outbox: {error.detail}", file=sys.stderr)
        return exit_code(error)
    except errors.OutboxError as error:
        print(json.dumps(error_document(error), sort_keys=True), file=sys.stderr)
        return exit_code(error)
    except KeyboardInterrupt:
        return 130
    except Exception as error:
        line = database_problem(error, args.database_url)
        if line is None:
            raise  # a bug: its traceback is the report
        print(f"outbox: {line}", file=sys.stderr)
        return EXIT_ERROR


def database_problem(error: BaseException, url: str | None) -> str | None:
    """One line for a database we cannot use (wrong URL, refused, no such driver),
    or None when the error is not about reaching the database."""
    sa_exc = sys.modules.get("sqlalchemy.exc")
    if sa_exc is None:
        return None
    where = _url_label(url)
    if isinstance(error, sa_exc.ArgumentError | sa_exc.NoSuchModuleError):
        return f"the database URL {where} is not usable: {_first_line(error)}"
    if isinstance(error, sa_exc.OperationalError | sa_exc.InterfaceError):
        cause = _first_line(error.orig if error.orig is not None else error)
        return f"cannot use the database at {where}: {cause}"
    return None


def _url_label(url: str | None) -> str:
    raw = url or settings.Settings.model_fields["database_url"].default
    try:
        from outbox import db

        return str(db.normalise_url(raw).render_as_string(hide_password=True))
    except Exception:  # noqa: BLE001 - an unparseable URL is shown as given, password and all cut
        return raw.split("@")[-1] if "@" in raw else raw


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


if __name__ == "__main__":
    sys.exit(main())
