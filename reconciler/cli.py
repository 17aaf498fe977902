"""``outbox reconciler`` and ``outbox review``: registered into the ``outbox`` command.

    outbox reconciler [--once] [--worker-id ID]
    outbox review list [--tenant T] [--adapter A] [--group G] [--json]
    outbox review show ID
    outbox review resolve ID --happened --provider-ref R --reason TEXT [--actor NAME]
    outbox review resolve ID --not-happened (--requeue | --abandon) --reason TEXT [--actor NAME]

``resolve`` exits 0 when the action is recorded (or was already, under the
same ``--action-id``), 3 when the item changed since it was looked at (nothing
was written), 2 for invalid input.
"""

from __future__ import annotations

import argparse
import getpass
import json
import logging
import threading
import uuid
from typing import Any

import adapters
from outbox import errors, logs, metrics, settings
from outbox.service import Outbox
from reconciler import review, scheduler, sweeps


def register(sub: argparse._SubParsersAction[Any]) -> None:
    p = sub.add_parser(
        "reconciler",
        help="resolve expired leases, deadlines and unknown outcomes; apply retention",
        description="Run the reconciler's sweeps on a schedule until SIGTERM.",
    )
    p.add_argument("--once", action="store_true", help="run every sweep once, print, exit")
    p.add_argument(
        "--worker-id", default=None, help="recorded with each lookup (default: host and pid)"
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve /metrics, /healthz, /readyz here; 0: none "
        "(default OUTBOX_RECONCILER_METRICS_PORT, 0)",
    )
    p.add_argument(
        "--log-format",
        choices=["text", "json"],
        default=None,
        help="log lines as text or one JSON object each (default OUTBOX_LOG_FORMAT, text)",
    )
    p.set_defaults(handler=cmd_reconciler)

    p_review = sub.add_parser("review", help="the operator review queue: unknown outcomes")
    r_sub = p_review.add_subparsers(dest="review_command", metavar="ACTION", required=True)

    p = r_sub.add_parser("list", help="effects whose outcome is unknown")
    p.add_argument("--tenant")
    p.add_argument("--adapter")
    p.add_argument("--group", choices=[g.value for g in review.Group])
    p.add_argument("--limit", type=int, default=review.LIST_LIMIT_DEFAULT)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(handler=cmd_review_list)

    p = r_sub.add_parser("show", help="one effect with its evidence and audit trail")
    p.add_argument("effect_id", type=int)
    p.set_defaults(handler=cmd_review_show)

    p = r_sub.add_parser(
        "resolve",
        help="say whether an unknown effect happened",
        description="Record an audited answer. Safe to repeat with the same --action-id.",
    )
    p.add_argument("effect_id", type=int)
    happened = p.add_mutually_exclusive_group(required=True)
    happened.add_argument("--happened", action="store_true", help="it happened: succeeded")
    happened.add_argument("--not-happened", action="store_true", help="it did not happen")
    then = p.add_mutually_exclusive_group()
    then.add_argument("--requeue", action="store_true", help="deliver it again, same key")
    then.add_argument("--abandon", action="store_true", help="do not deliver it: failed")
    p.add_argument("--provider-ref", help="the provider's reference (required with --happened)")
    p.add_argument("--reason", required=True, help="why: kept in the audit trail")
    p.add_argument(
        "--actor",
        default=None,
        help="a note on who is acting; the audit's actor is always the OS account (os:LOGIN)",
    )
    p.add_argument(
        "--action-id", default=None, help="repeat with the same id to retry safely (default: new)"
    )
    p.add_argument(
        "--expect-attempts",
        type=int,
        default=None,
        help="refuse if the effect has had more attempts since you looked",
    )
    p.set_defaults(handler=cmd_review_resolve)


def _box(args: argparse.Namespace) -> Outbox:
    return Outbox(getattr(args, "database_url", None))


def _registry(config: settings.Settings) -> adapters.Registry:
    try:
        return adapters.load_registry(config.adapters)
    except adapters.ConfigError as exc:
        raise errors.ConfigError(f"adapters: {exc}") from exc


# --- reconciler -------------------------------------------------------------------


def cmd_reconciler(args: argparse.Namespace) -> int:
    overrides: dict[str, Any] = {}
    if args.metrics_port is not None:
        overrides["reconciler_metrics_port"] = args.metrics_port
    if args.log_format is not None:
        overrides["log_format"] = args.log_format
    config = settings.load(**overrides)
    box = Outbox(args.database_url, config=config)
    registry = _registry(config)
    try:
        worker = args.worker_id or scheduler.default_worker_id()
        all_sweeps = sweeps.build(box.engine, registry, config, worker=worker, clock=box.clock)
        if args.once:
            for sweep in all_sweeps:
                print(f"{sweep.name}: {sweep.run_once()}")
            return 0
        logs.configure(config.log_format, config.log_level)
        server = None
        if config.reconciler_metrics_port:
            server = metrics.serve(box.engine, config.metrics_host, config.reconciler_metrics_port)
            logging.getLogger("reconciler").info(
                "metrics on http://%s:%d/metrics",
                config.metrics_host,
                config.reconciler_metrics_port,
            )
        stop = threading.Event()
        scheduler.stop_on_signals(stop)
        try:
            scheduler.Reconciler(scheduler.jobs_for(all_sweeps, config)).run(stop)
        finally:
            if server is not None:
                server.shutdown()
        return 0
    finally:
        registry.close()
        box.close()


# --- review -----------------------------------------------------------------------


def cmd_review_list(args: argparse.Namespace) -> int:
    with _box(args) as box:
        items = review.list_items(
            box.engine,
            tenant=args.tenant,
            adapter=args.adapter,
            group=args.group,
            limit=args.limit,
        )
    if args.json:
        print(json.dumps(items, indent=2, sort_keys=True))
        return 0
    if not items:
        print("nothing awaits review")
        return 0
    columns = ("id", "group", "tenant", "adapter", "effect", "attempts", "reason", "since")
    rows = [
        (
            str(i["id"]),
            i["group"],
            i["tenant"],
            i["adapter"],
            i["effect"],
            str(i["attempts"]),
            i["reason"],
            i["review_since"] or i["updated_at"],
        )
        for i in items
    ]
    widths = [max(len(c), *(len(r[n]) for r in rows)) for n, c in enumerate(columns)]
    for line in (columns, *rows):
        print("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip())
    return 0


def cmd_review_show(args: argparse.Namespace) -> int:
    with _box(args) as box:
        print(json.dumps(review.show(box.engine, args.effect_id), indent=2, sort_keys=True))
    return 0


def cmd_review_resolve(args: argparse.Namespace) -> int:
    if args.happened:
        if args.requeue or args.abandon:
            raise errors.InvalidArguments(
                [{"field": "--requeue/--abandon", "message": "only with --not-happened"}]
            )
        choice = review.Choice.HAPPENED
    elif args.requeue:
        choice = review.Choice.NOT_HAPPENED_REQUEUE
    elif args.abandon:
        choice = review.Choice.NOT_HAPPENED_ABANDON
    else:
        raise errors.InvalidArguments(
            [
                {
                    "field": "--requeue/--abandon",
                    "message": "with --not-happened, say --requeue (deliver again, same key) "
                    "or --abandon (do not deliver)",
                }
            ]
        )
    with _box(args) as box:
        result = review.resolve(
            box.engine,
            args.effect_id,
            choice=choice,
            reason=args.reason,
            # The command line authenticates no token: whoever can reach the database
            # acts, so the actor is the OS account; --actor is kept as a note.
            actor=f"os:{_login()}",
            actor_note=args.actor,
            action_id=args.action_id or f"act_{uuid.uuid4().hex}",
            expected_attempts=args.expect_attempts,
            provider_ref=args.provider_ref,
            now=box.clock(),
            effect_deadline=box.settings.effect_deadline,
        )
    print(json.dumps(result.to_dict(), indent=2, sort_keys=True))
    return 0


def _login() -> str:
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # no login name in a bare container
        return "cli"
