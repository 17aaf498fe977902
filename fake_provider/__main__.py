"""``fake-provider serve ...``: run the fake helpdesk on uvicorn until SIGTERM or SIGINT.

Also reachable as ``python -m fake_provider serve ...``. Every flag maps to one
field of :class:`fake_provider.config.ProviderConfig`; the fault flags build
the start-up :class:`fake_provider.faults.FaultSpec` (``POST /_admin/faults``
changes it at run time).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence

import uvicorn

from fake_provider import app as app_
from fake_provider import config, faults, webhooks

HOST_DEFAULT = "127.0.0.1"
PORT_DEFAULT = 9000
# Bounded, so a held reply (drop "hold", timeout_before_commit) cannot keep a
# SIGTERM waiting for the full hold.
GRACEFUL_SHUTDOWN_SECONDS = 5


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Shows a flag's default only where it says something: never for on/off
    switches (argparse's own formatter shows ``--no-lookup``'s stored True as its
    default), nor for unset values or a help text that already explains it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            not action.option_strings
            or "default" in text
            or action.nargs == 0  # store_true / store_false / count: a switch
            or action.default in (None, "", [], argparse.SUPPRESS)
        ):
            return text
        return text + " (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fake-provider",
        description=(
            "A fake helpdesk provider over HTTP: honours or ignores idempotency keys, "
            "keeps a ledger of every ticket, and injects reproducible faults."
        ),
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="serve the provider until SIGTERM/SIGINT",
        description="Serve the provider until SIGTERM/SIGINT.",
        formatter_class=DefaultsHelpFormatter,
    )
    serve.add_argument("--host", default=HOST_DEFAULT, help="address to bind")
    serve.add_argument("--port", type=int, default=PORT_DEFAULT, help="port to bind")
    serve.add_argument(
        "--mode",
        choices=[mode.value for mode in config.Mode],
        default=config.Mode.HONOUR.value,
        help="honour: deduplicate by Idempotency-Key; ignore: every POST creates a ticket",
    )
    serve.add_argument(
        "--no-lookup",
        dest="lookup_enabled",
        action="store_false",
        help="lookups (GET /v1/tickets?client_reference=...|idempotency_key=...) answer 501; "
        "without it they are answered",
    )
    serve.add_argument(
        "--lookup-lag-ms",
        type=int,
        default=config.LOOKUP_LAG_MS_DEFAULT,
        help="a new ticket is invisible to lookups for this long",
    )
    serve.add_argument(
        "--key-retention-seconds",
        type=float,
        default=config.KEY_RETENTION_SECONDS_DEFAULT,
        help="how long honour mode remembers an idempotency key",
    )
    serve.add_argument(
        "--db", default=None, metavar="PATH", help="SQLite file (default: in memory)"
    )
    serve.add_argument(
        "--seed", type=int, default=None, help="fault RNG seed (default: random, reported)"
    )
    serve.add_argument(
        "--rate",
        action="append",
        default=[],
        metavar="OUTCOME=P",
        help="probability of an outcome per POST /v1/tickets; repeatable "
        f"(outcomes: {', '.join(o.value for o in faults.Outcome if o is not faults.Outcome.OK)})",
    )
    serve.add_argument(
        "--script",
        default="",
        metavar="O1,O2,...",
        help="outcomes for the next POSTs, in order, before the rates apply",
    )
    serve.add_argument(
        "--latency-ms",
        default="0",
        metavar="MIN[:MAX]",
        help="latency added to each POST /v1/tickets, uniform in [MIN, MAX]",
    )
    serve.add_argument(
        "--drop-mode",
        choices=[mode.value for mode in config.DropMode],
        default=config.DropMode.ABORT.value,
        help="drop_after_commit: abort the connection, or hold the reply for --hold-seconds",
    )
    serve.add_argument(
        "--hold-seconds",
        type=float,
        default=config.HOLD_SECONDS_DEFAULT,
        help="how long a held reply (drop hold, timeout_before_commit) waits",
    )
    serve.add_argument(
        "--retry-after",
        type=int,
        default=config.RETRY_AFTER_SECONDS_DEFAULT,
        metavar="SECONDS",
        help="Retry-After sent with 429 and 503",
    )
    serve.add_argument(
        "--retry-after-format",
        choices=[fmt.value for fmt in config.RetryAfterFormat],
        default=config.RetryAfterFormat.SECONDS.value,
        help="spell Retry-After as delay-seconds or as an HTTP-date",
    )
    hooks = serve.add_argument_group(
        "webhooks", "signed ticket.created events, with faults (off without --webhook-url)"
    )
    hooks.add_argument("--webhook-url", default=None, help="POST each event here")
    hooks.add_argument(
        "--webhook-secret",
        default=os.environ.get("FAKE_PROVIDER_WEBHOOK_SECRET"),
        help="shared secret (default: $FAKE_PROVIDER_WEBHOOK_SECRET); standard: whsec_<base64>",
    )
    hooks.add_argument(
        "--webhook-format",
        choices=[f.value for f in webhooks.WebhookFormat],
        default=webhooks.WebhookFormat.STANDARD.value,
        help="standard: Standard Webhooks headers; stripe: Stripe-Signature t=...,v1=...",
    )
    hooks.add_argument("--webhook-delay-ms", type=int, default=0, help="wait before each send")
    for fault, what in (
        ("duplicate", "sent twice"),
        ("reorder", "sent after the next event"),
        ("drop", "never sent"),
        ("bad-signature", "first try signed with a wrong secret"),
    ):
        hooks.add_argument(
            f"--webhook-{fault}-rate",
            type=float,
            default=0.0,
            metavar="P",
            help=f"probability that an event is {what}",
        )
    serve.add_argument(
        "--log-level",
        choices=["critical", "error", "warning", "info", "debug"],
        default="info",
        help="uvicorn log level",
    )
    return parser


def parse_fault_spec(rates: Sequence[str], script: str, latency: str) -> faults.FaultSpec:
    """Build the start-up fault plan from ``--rate``, ``--script`` and ``--latency-ms``."""
    parsed_rates: dict[str, float] = {}
    for item in rates:
        name, sep, value = item.partition("=")
        if not sep:
            raise faults.FaultSpecError(f"--rate {item!r}: expected OUTCOME=P")
        try:
            parsed_rates[name.strip()] = float(value)
        except ValueError:
            raise faults.FaultSpecError(f"--rate {item!r}: {value!r} is not a number") from None
    names = [name.strip() for name in script.split(",") if name.strip()]
    low_text, _, high_text = latency.partition(":")
    try:
        low = int(low_text)
        high = int(high_text) if high_text else low
    except ValueError:
        raise faults.FaultSpecError(f"--latency-ms {latency!r}: expected MIN[:MAX]") from None
    return faults.FaultSpec.from_json(
        {"rates": parsed_rates, "script": names, "latency_ms": {"min": low, "max": high}}
    )


class _QuietDrops(logging.Filter):
    """Log an injected dropped connection as one line, not as a crash traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, app_.ConnectionDropped):
            record.msg = "%s (injected drop_after_commit)"
            record.args = (exc,)
            record.exc_info = None
            record.exc_text = None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


class _Server(uvicorn.Server):
    """uvicorn, except that a stop signal ends in a normal return.

    uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown, which kills
    the process before the store is closed (SIGTERM) or ends it with a
    KeyboardInterrupt traceback (SIGINT). A supervisor asking us to stop
    should see a clean exit 0 once everything is released.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        stop_signals = (signal.SIGINT, signal.SIGTERM)
        previous = {signum: signal.signal(signum, self.handle_exit) for signum in stop_signals}
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def serve(args: argparse.Namespace) -> int:
    try:
        spec = parse_fault_spec(args.rate, args.script, args.latency_ms)
        cfg = config.ProviderConfig(
            mode=config.Mode(args.mode),
            lookup_enabled=args.lookup_enabled,
            lookup_lag_ms=args.lookup_lag_ms,
            key_retention_seconds=args.key_retention_seconds,
            db_path=args.db,
            seed=args.seed,
            faults=spec,
            drop_mode=config.DropMode(args.drop_mode),
            hold_seconds=args.hold_seconds,
            retry_after_seconds=args.retry_after,
            retry_after_format=config.RetryAfterFormat(args.retry_after_format),
            webhooks=webhooks.WebhookConfig(
                url=args.webhook_url,
                secret=args.webhook_secret,
                format=webhooks.WebhookFormat(args.webhook_format),
                delay_ms=args.webhook_delay_ms,
                duplicate_rate=args.webhook_duplicate_rate,
                reorder_rate=args.webhook_reorder_rate,
                drop_rate=args.webhook_drop_rate,
                bad_signature_rate=args.webhook_bad_signature_rate,
            ),
        )
        app = app_.create_app(cfg)
    except (faults.FaultSpecError, config.ConfigError) as exc:
        print(f"fake-provider: {exc}", file=sys.stderr)
        return 2
    print(
        f"fake-provider: mode={cfg.mode.value} lookup={'on' if cfg.lookup_enabled else 'off'} "
        f"db={cfg.db_path or ':memory:'} seed={app.state.faults.seed} "
        f"on http://{args.host}:{args.port}",
        file=sys.stderr,
        flush=True,
    )
    server = _Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            lifespan="off",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
        )
    )
    logging.getLogger("uvicorn.error").addFilter(_QuietDrops())
    try:
        # On SIGTERM/SIGINT uvicorn stops accepting, lets requests in flight
        # finish (bounded above), then returns here.
        server.run()
    finally:
        app.state.webhooks.close()
        app.state.ledger.close()
    return 0 if server.started else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fake-provider`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
