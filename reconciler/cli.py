"""``outbox reconciler`` and ``outbox review``: registered into the ``outbox`` command.

    outbox reconciler [--once] [--worker-id ID]
    outbox review list [--tenant T] [--adapter A] [--group G] [--json]
    outbox review show ID
    outbox review resolve ID --happened --provider-ref R --reason TEXT [--actor NAME]
    outbox review resolve ID --not-happened (--requeue | --abandon) --reason TEXT [--actor NAME]
    outbox review bulk --tenant T [--adapter A] [--problem TYPE] [--older-than DURATION]
        --action resolve|retry-lookup|abandon [--as happened|requeue] --reason TEXT
        [--dry-run] [--bulk-id ID]
    outbox review conflicts [--tenant T]

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
from datetime import timedelta
from typing import Any

import adapters
from outbox import app as apps
from outbox import errors, logs, metrics, settings
from outbox.service import Outbox
from outbox.settling import webhooks
from reconciler import bulk, review, scheduler, sweeps


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

    p = r_sub.add_parser(
        "bulk",
        help="one action for every review item a filter selects",
        description="Select outcome_unknown effects by filter and resolve, retry the lookup of, "
        "or abandon all of them. Each item is compare-and-set and audited. Try --dry-run "
        "first; repeat with the same --bulk-id to retry safely (a finished action is answered "
        "as recorded, an interrupted one resumes).",
    )
    p.add_argument("--tenant", required=True)
    p.add_argument("--adapter")
    p.add_argument(
        "--problem", help="the items' reason, e.g. review_no_lookup or review_lookup_exhausted"
    )
    p.add_argument(
        "--older-than", metavar="DURATION", help="in review for at least: 90s, 15m, 2h, 1d"
    )
    p.add_argument("--action", required=True, choices=[a.value for a in bulk.Action])
    p.add_argument(
        "--as",
        dest="resolution",
        choices=[r.value for r in bulk.Resolution],
        help="with --action resolve: happened (succeeded) or requeue (deliver again, same key)",
    )
    p.add_argument("--reason", default=None, help="why: kept in every item's audit")
    p.add_argument("--actor", default=None, help="who is acting (default: the login name)")
    p.add_argument(
        "--dry-run", action="store_true", help="count what the filter selects; change nothing"
    )
    p.add_argument(
        "--bulk-id", default=None, help="repeat with the same id to retry safely (default: new)"
    )
    p.set_defaults(handler=cmd_review_bulk)

    p = r_sub.add_parser(
        "conflicts", help="provider events that contradict a finished effect (nothing was changed)"
    )
    p.add_argument("--tenant")
    p.add_argument("--limit", type=int, default=review.LIST_LIMIT_DEFAULT)
    p.set_defaults(handler=cmd_review_conflicts)


def _box(args: argparse.Namespace) -> Outbox:
    return Outbox(getattr(args, "database_url", None), app=apps.from_args(args))


def _registry(app: apps.App, config: settings.Settings) -> adapters.Registry:
    # The app's adapters (OUTBOX_ADAPTERS, when set, replaces the app's file).
    return app.build_adapters(config.adapters)


# --- reconciler -------------------------------------------------------------------


def cmd_reconciler(args: argparse.Namespace) -> int:
    overrides: dict[str, Any] = {}
    if args.metrics_port is not None:
        overrides["reconciler_metrics_port"] = args.metrics_port
    if args.log_format is not None:
        overrides["log_format"] = args.log_format
    config = settings.load(**overrides)
    # Before anything can log: a --once pass logs what it settles like the long-lived
    # process does, in the format asked for.
    logs.configure(config.log_format, config.log_level)
    app = apps.from_args(args)
    # The adapters first: a broken file stops us before the database is touched.
    registry = _registry(app, config)
    try:
        box = Outbox(args.database_url, config=config, app=app)
    except BaseException:
        registry.close()
        raise
    try:
        worker = args.worker_id or scheduler.default_worker_id()
        all_sweeps = sweeps.build(box.engine, registry, config, worker=worker, clock=box.clock)
        if args.once:
            for sweep in all_sweeps:
                print(f"{sweep.name}: {sweep.run_once()}")
            return 0
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


def _duration(text: str | None) -> timedelta | None:
    if text is None:
        return None
    value = settings.parse_duration(text)
    if not isinstance(value, timedelta) or value < timedelta(0):
        raise errors.InvalidArguments(
            [{"field": "--older-than", "message": "a duration like 90s, 15m, 2h or 1d"}]
        )
    return value


def cmd_review_bulk(args: argparse.Namespace) -> int:
    where = bulk.Filter(
        tenant=args.tenant,
        adapter=args.adapter,
        problem=args.problem,
        older_than=_duration(args.older_than),
    )
    if not args.dry_run and not args.reason:
        raise errors.InvalidArguments(
            [{"field": "--reason", "message": "say why: it is kept in every item's audit"}]
        )
    with _box(args) as box:
        result = bulk.run(
            box.engine,
            where,
            action=args.action,
            resolution=args.resolution,
            reason=args.reason or "dry run",
            actor=args.actor or _login(),
            bulk_id=args.bulk_id or f"bulk_{uuid.uuid4().hex[:16]}",
            dry_run=args.dry_run,
            now=box.clock(),
            effect_deadline=box.settings.effect_deadline,
        )
    print(json.dumps(result.to_dict(), indent=2, sort_keys=True))
    return 0


def cmd_review_conflicts(args: argparse.Namespace) -> int:
    with _box(args) as box:
        found = webhooks.conflicts(box.engine, tenant=args.tenant, limit=args.limit)
    print(json.dumps(found, indent=2, sort_keys=True))
    return 0


def _login() -> str:
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # no login name in a bare container
        return "cli"
