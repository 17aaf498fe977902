"""Settings: one frozen object read from ``OUTBOX_*`` environment variables.

Every value has a default, so with no configuration at all Outbox runs on a
SQLite file at ``var/outbox.db`` below the working directory. Durations accept
``90s``, ``15m``, ``12h``, ``30d``, plain seconds, or ISO 8601 (``P30D``).
``validate()`` names the field and the bound it broke.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Annotated, Any, Literal, get_args, get_origin

import limits
from pydantic import BeforeValidator, Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from outbox import errors

DATABASE_URL_DEFAULT = "sqlite:///var/outbox.db"
RETENTION_DEFAULT = timedelta(days=30)
TOMBSTONE_RETENTION_DEFAULT = timedelta(days=365)
BUSY_TIMEOUT_DEFAULT = timedelta(seconds=5)
LEASE_DURATION_DEFAULT = timedelta(seconds=60)
EFFECT_DEADLINE_DEFAULT = timedelta(minutes=15)
POLL_INTERVAL_DEFAULT = timedelta(seconds=1)
MAX_ATTEMPTS_DEFAULT = 20
RATE_LIMIT_DEFAULT = "100/second"
HEADER_TIMEOUT_DEFAULT = timedelta(seconds=10)
MAX_CONNECTIONS_DEFAULT = 1000

_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")


def parse_duration(value: Any) -> Any:
    """``"15m"`` -> ``timedelta(minutes=15)``; anything else is left to pydantic."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return timedelta(seconds=value)
    if isinstance(value, str):
        match = _DURATION.match(value)
        if match:
            return timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2) or "s"])
    return value


Duration = Annotated[timedelta, BeforeValidator(parse_duration)]

RATE_LIMIT_NONE = "none"


def parse_rate_limit(text: str) -> limits.RateLimitItem | None:
    """``"100/second"`` -> a limit (the ``limits`` notation); ``"none"`` -> None.

    ValueError says what is accepted: one limit with a positive amount.
    """
    cleaned = text.strip().lower()
    if cleaned == RATE_LIMIT_NONE:
        return None
    try:
        items = limits.parse_many(cleaned)
    except ValueError:
        items = []
    if len(items) != 1 or items[0].amount < 1:
        raise ValueError(
            f"rate limit {text!r}: one limit such as '100/second', '10/second' or "
            "'6000/minute', or 'none'"
        )
    return items[0]


class Settings(BaseSettings):
    """Everything a process of Outbox can be told. Read once, then frozen."""

    model_config = SettingsConfigDict(env_prefix="OUTBOX_", frozen=True, extra="ignore")

    # Where the records live. SQLite by default; postgresql://... for several hosts.
    database_url: str = DATABASE_URL_DEFAULT
    # SQLite only: FULL survives power loss; NORMAL (in WAL) survives a crash of the
    # process but may lose the last commits on power loss. Default: FULL.
    sqlite_synchronous: Literal["FULL", "NORMAL"] = "FULL"
    # PostgreSQL behind a connection pooler in transaction mode (PgBouncer
    # pool_mode=transaction): "transaction" turns off server-side prepared
    # statements and session settings, and LISTEN goes to OUTBOX_LISTEN_URL or,
    # without one, dispatchers poll every OUTBOX_POLL_INTERVAL. See docs/failover.md.
    database_pooler: Literal["none", "transaction"] = "none"
    # PostgreSQL: a direct (not pooled) URL for the dispatchers' LISTEN connection.
    listen_url: str | None = None
    # How long a write waits for the database lock before answering Busy.
    busy_timeout: Duration = BUSY_TIMEOUT_DEFAULT
    # Receipts are kept this long, then turned into tombstones (key and digest only).
    retention: Duration = RETENTION_DEFAULT
    # Tombstones are kept this long after that, answering "expired: reconcile".
    tombstone_retention: Duration = TOMBSTONE_RETENTION_DEFAULT

    # Path of the adapters TOML file; unset: one `helpdesk` adapter at 127.0.0.1:9000.
    adapters: str | None = None

    # Dispatcher.
    lease_duration: Duration = LEASE_DURATION_DEFAULT
    lease_renew_interval: Duration = timedelta(seconds=20)
    poll_interval: Duration = POLL_INTERVAL_DEFAULT
    claim_batch_size: int = Field(default=100, ge=1, le=10_000)
    concurrency: int = Field(default=8, ge=1, le=1024)
    effect_deadline: Duration = EFFECT_DEADLINE_DEFAULT
    max_attempts: int = Field(default=MAX_ATTEMPTS_DEFAULT, ge=1, le=1000)
    backoff_initial: Duration = timedelta(seconds=0.5)
    backoff_max: Duration = timedelta(minutes=5)
    # Retries may be at most this fraction of first attempts over the window.
    retry_budget_ratio: float = Field(default=0.5, ge=0.0, le=100.0)
    retry_budget_window: Duration = timedelta(seconds=60)
    retry_budget_min_per_window: int = Field(default=10, ge=0)
    breaker_failure_threshold: int = Field(default=5, ge=1)
    breaker_cooldown: Duration = timedelta(seconds=5)
    breaker_cooldown_max: Duration = timedelta(minutes=2)
    shutdown_grace: Duration = timedelta(seconds=10)
    # A send out longer than this is slow. max(1, concurrency // 4) runners are kept in
    # reserve for adapters with no slow send, and the loop stops waiting for slow sends
    # before it claims again, so one slow provider does not hold up the others'
    # deliveries (docs/dispatcher.md, "A slow provider"). 0 turns this off.
    slow_send_after: Duration = timedelta(seconds=2)
    # PostgreSQL: under a backlog, write a pass's results on a second thread while the
    # next pass claims (docs/dispatcher.md, "Writing behind"). Off: each pass records
    # before the next claims (better for many dispatchers sharing a few cores).
    record_behind: bool = True

    # Reconciler.
    sweep_interval: Duration = timedelta(seconds=5)
    lookup_max_tries: int = Field(default=5, ge=1)
    lookup_backoff: Duration = timedelta(seconds=10)
    retention_interval: Duration = timedelta(minutes=10)

    # Processes.
    # The API's per-tenant rate limit, unless the tenant has its own (`outbox tenants
    # update NAME --rate-limit 10/second`): one limit such as 100/second or 6000/minute,
    # or "none". Counted per API process (moving window).
    rate_limit: str = RATE_LIMIT_DEFAULT
    # `outbox serve`: a connection that has not sent a whole request head within this
    # time is closed (slow or half-open clients), and one process serves at most
    # max_connections connections at once (more are answered 503 and closed).
    header_timeout: Duration = HEADER_TIMEOUT_DEFAULT
    max_connections: int = Field(default=MAX_CONNECTIONS_DEFAULT, ge=1, le=100_000)
    api_host: str = "127.0.0.1"
    api_port: int = Field(default=8000, ge=0, le=65535)
    metrics_host: str = "127.0.0.1"
    # 0: no metrics port for the dispatcher / reconciler.
    dispatcher_metrics_port: int = Field(default=0, ge=0, le=65535)
    reconciler_metrics_port: int = Field(default=0, ge=0, le=65535)
    log_format: Literal["text", "json"] = "text"
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    # Console session cookies: Secure flag (turn on behind HTTPS).
    console_secure_cookies: bool = False

    @model_validator(mode="after")
    def _bounds(self) -> Settings:
        self.validate_bounds()
        return self

    def validate_bounds(self) -> None:
        """Refuse combinations that would break a guarantee; name the field and the bound."""
        if self.lease_renew_interval * 3 > self.lease_duration:
            raise errors.ConfigError(
                f"OUTBOX_LEASE_RENEW_INTERVAL ({self.lease_renew_interval.total_seconds():g}s) "
                "must be at most a third of OUTBOX_LEASE_DURATION "
                f"({self.lease_duration.total_seconds():g}s), so a slow delivery is renewed "
                "before another worker may take it"
            )
        if self.backoff_initial > self.backoff_max:
            raise errors.ConfigError(
                "OUTBOX_BACKOFF_INITIAL cannot be longer than OUTBOX_BACKOFF_MAX "
                f"({self.backoff_max.total_seconds():g}s)"
            )
        if self.tombstone_retention < self.retention:
            raise errors.ConfigError(
                "OUTBOX_TOMBSTONE_RETENTION cannot be shorter than OUTBOX_RETENTION "
                f"({self.retention.total_seconds():g}s): a late retry must meet the tombstone"
            )
        for name in ("busy_timeout", "lease_duration", "poll_interval", "effect_deadline"):
            if getattr(self, name) <= timedelta(0):
                raise errors.ConfigError(f"OUTBOX_{name.upper()} must be positive")
        if self.header_timeout <= timedelta(0):
            raise errors.ConfigError("OUTBOX_HEADER_TIMEOUT must be positive")
        try:
            parse_rate_limit(self.rate_limit)
        except ValueError as exc:
            raise errors.ConfigError(f"OUTBOX_RATE_LIMIT: {exc}") from None
        if self.breaker_cooldown > self.breaker_cooldown_max:
            raise errors.ConfigError(
                "OUTBOX_BREAKER_COOLDOWN cannot be longer than OUTBOX_BREAKER_COOLDOWN_MAX"
            )


DURATION_FORMS = "a duration such as 90s, 15m, 12h, 30d, plain seconds, or ISO 8601 (P30D)"


def load(**overrides: Any) -> Settings:
    """Read the environment (and explicit overrides) into a frozen ``Settings``."""
    try:
        return Settings(**overrides)
    except errors.ConfigError:
        raise
    except ValidationError as exc:  # say which variable to fix and what it may be, in one line
        raise errors.ConfigError(describe(exc)) from exc


def describe(error: ValidationError) -> str:
    """One line per bad variable, joined: its name, the value given, what is allowed."""
    parts: list[str] = []
    for problem in error.errors(include_url=False):
        field = str(problem["loc"][0]) if problem["loc"] else ""
        if field not in Settings.model_fields:
            parts.append(str(problem["msg"]))
            continue
        allowed = _allowed(field, problem)
        value = problem.get("input")
        given = f"={value!r}" if isinstance(value, str | int | float) else ""
        parts.append(f"OUTBOX_{field.upper()}{given} is invalid: expected {allowed}")
    return "; ".join(parts)


def _allowed(field: str, problem: Any) -> str:
    info = Settings.model_fields[field]
    if info.annotation is timedelta:
        return DURATION_FORMS
    choices = get_args(info.annotation) if get_origin(info.annotation) is Literal else ()
    if choices:
        return "one of " + ", ".join(str(c) for c in choices)
    if info.annotation is bool:
        return "true or false"
    kinds: dict[Any, str] = {int: "an integer", float: "a number"}
    kind = kinds.get(info.annotation)
    if kind is not None:
        bounds = [
            f"{word} {getattr(rule, name)}"
            for rule in info.metadata
            for name, word in (("ge", "at least"), ("le", "at most"))
            if getattr(rule, name, None) is not None
        ]
        return kind + (" " + " and ".join(bounds) if bounds else "")
    return str(problem["msg"]).removeprefix("Input should be ")
