"""``Outbox``: the one entry object of the Python API.

    from outbox import Outbox
    box = Outbox("sqlite:///var/outbox.db")      # or Outbox() to read OUTBOX_* settings
    box = Outbox(url, app=load_app("my_app.app:app"))   # a deployment's own tools (outbox.app)
    result = box.execute("acme", "op-123", "create_support_task", {"subject": "Late parcel"})
    result.created, result.status_code, result.receipt

It refuses to run on a schema that is not current (``outbox db upgrade``),
Outbox's own or the app's.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Self

import sqlalchemy as sa
from sqlalchemy import exc
from sqlalchemy.engine import Engine

from outbox import app as apps
from outbox import db, errors, metrics, schema, settings, states, tools
from outbox.creating import approvals, create, retention
from outbox.creating.create import ExecuteResult

logger = logging.getLogger("outbox.create")

TENANT_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
TOKEN_PREFIX = "obx_"
# A token's last_used_at moves at most this often: one small write a minute per
# token in use, not one per request.
TOKEN_LAST_USED_RESOLUTION = timedelta(minutes=1)

Clock = Callable[[], datetime]


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the tenant a token belongs to, and its role."""

    tenant: str
    role: states.Role
    token_id: int
    label: str = ""  # the token's label, as `outbox tokens create --label` set it
    rate_limit: str | None = None  # the tenant's own API rate limit (None: the default)

    @property
    def actor(self) -> str:
        """The authenticated actor as audit records name it: ``token:12 (label)``."""
        return f"token:{self.token_id} ({self.label})" if self.label else f"token:{self.token_id}"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


class Outbox:
    def __init__(
        self,
        database_url: str | None = None,
        *,
        config: settings.Settings | None = None,
        engine: Engine | None = None,
        registry: tools.Registry | None = None,
        clock: Clock | None = None,
        check_schema: bool = True,
        app: apps.App | None = None,
    ) -> None:
        self.settings = config or settings.load()
        # The app's tools are what this object serves; ``registry`` alone (tests,
        # embedding) stands for an app with those tools and the default adapters.
        if app is None:
            app = apps.default_app() if registry is None else apps.App("custom", tools=registry)
        self.app = app
        self.tools = registry or app.tools
        self.engine = engine or db.create_engine(self.settings, url=database_url)
        self.clock: Clock = clock or schema.utcnow
        if check_schema:
            db.check_schema(self.engine)
            app.check_schema(self.engine)

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # --- the write path ------------------------------------------------------

    def execute(self, tenant: str, operation_id: str, tool: str, arguments: Any) -> ExecuteResult:
        """Create once, replay after: see ``outbox.create`` for the contract."""
        # A label per registered tool only: a caller's typo must not mint a time series.
        label = tool if tool in self.tools else "unknown"
        context: dict[str, Any] = {"tenant": tenant, "operation_id": operation_id}
        try:
            result = self._execute(tenant, operation_id, tool, arguments)
        except errors.OutboxError as error:
            outcome = metrics.create_result(error)
            metrics.labelled(metrics.OPERATIONS, label, outcome).inc()
            # Ids and the kind of refusal only: the arguments may hold a customer's text.
            logger.info("create refused: %s", outcome, extra={**context, "outcome": outcome})
            raise
        outcome = "created" if result.created else "replayed"
        metrics.labelled(metrics.OPERATIONS, label, outcome).inc()
        logger.info("operation %s", outcome, extra={**context, "outcome": outcome})
        return result

    def _execute(self, tenant: str, operation_id: str, tool: str, arguments: Any) -> ExecuteResult:
        return create.execute(
            self.engine,
            self.tools,
            tenant=tenant,
            operation_id=operation_id,
            tool=tool,
            arguments=arguments,
            now=self.clock(),
            retention=self.settings.retention,
            effect_deadline=self.settings.effect_deadline,
        )

    # --- reads ---------------------------------------------------------------

    def get_operation(self, tenant: str, operation_id: str) -> dict[str, Any]:
        """The receipt (what happened to the request) and each effect's current state."""
        ops, out = schema.operations, schema.outbox
        with db.read(self.engine) as conn:
            op = conn.execute(
                sa.select(ops).where(ops.c.tenant == tenant, ops.c.operation_id == operation_id)
            ).first()
            if op is None:
                tomb = conn.execute(
                    sa.select(schema.tombstones.c.expired_at).where(
                        schema.tombstones.c.tenant == tenant,
                        schema.tombstones.c.operation_id == operation_id,
                    )
                ).first()
                if tomb is not None:
                    raise errors.OperationExpired(tenant, operation_id, same_arguments=True)
                raise errors.OperationNotFound(tenant, operation_id)
            approval = approvals.approval_view(conn, tenant, operation_id)
            effects = conn.execute(
                sa.select(out)
                .where(out.c.tenant == tenant, out.c.operation_id == operation_id)
                .order_by(out.c.id)
            ).all()
        return {
            "operation_id": op.operation_id,
            "tool": op.tool,
            "payload_version": op.payload_version,
            "status_code": op.status_code,
            "receipt": json.loads(op.receipt),
            "task_id": op.task_id,
            "created_at": op.created_at.isoformat(),
            "expires_at": op.expires_at.isoformat(),
            # None unless the tool requires approval: then its status and decision.
            "approval": approval,
            "effects": [effect_view(e) for e in effects],
        }

    def get_task(self, tenant: str, task_id: int) -> dict[str, Any]:
        t = schema.tasks
        with db.read(self.engine) as conn:
            row = conn.execute(sa.select(t).where(t.c.tenant == tenant, t.c.id == task_id)).first()
        if row is None:
            raise errors.TaskNotFound(tenant, task_id)
        return {
            "id": row.id,
            "subject": row.subject,
            "body": row.body,
            "priority": row.priority,
            "status": row.status,
            "operation_id": row.operation_id,
            "created_at": row.created_at.isoformat(),
            "updated_at": row.updated_at.isoformat(),
        }

    # --- approvals (operator actions; see outbox.creating.approvals) -------------------

    def list_approvals(
        self,
        tenant: str,
        status: states.ApprovalStatus | str | None = states.ApprovalStatus.AWAITING_APPROVAL,
        limit: int = approvals.LIST_LIMIT_DEFAULT,
    ) -> list[dict[str, Any]]:
        return approvals.list_approvals(self.engine, tenant=tenant, status=status, limit=limit)

    def show_approval(self, tenant: str, operation_id: str) -> dict[str, Any]:
        return approvals.show(self.engine, tenant=tenant, operation_id=operation_id)

    def decide_approval(
        self,
        tenant: str,
        operation_id: str,
        decision: states.ApprovalDecision | str,
        *,
        actor: str,
        reason: str = "",
    ) -> approvals.Decided:
        """Approve (release the held effects) or reject (fail them): once, audited."""
        return approvals.decide(
            self.engine,
            tenant=tenant,
            operation_id=operation_id,
            decision=decision,
            actor=actor,
            reason=reason,
            now=self.clock(),
        )

    # --- tenants and tokens --------------------------------------------------

    def create_tenant(self, name: str, *, rate_limit: str | None = None) -> str:
        """Create a tenant (safe to repeat); ``rate_limit`` (``10/second``) sets its own limit."""
        if rate_limit is not None:
            rate_limit = _rate_limit(rate_limit)
        if not TENANT_NAME.match(name):
            raise errors.InvalidArguments(
                [
                    {
                        "field": "name",
                        "message": "1-64 characters: lowercase letters, digits, '_', '.', '-', "
                        "starting with a letter or digit",
                    }
                ]
            )
        try:
            with db.write(self.engine) as conn:
                conn.execute(
                    sa.insert(schema.tenants),
                    {"id": name, "created_at": self.clock(), "rate_limit": rate_limit},
                )
        except exc.IntegrityError:
            # Already there: creating a tenant is safe to repeat; a limit given now applies.
            if rate_limit is not None:
                self.update_tenant(name, rate_limit=rate_limit)
        return name

    def update_tenant(self, name: str, *, rate_limit: str | None) -> dict[str, Any]:
        """Set the tenant's own rate limit (``None``: back to ``OUTBOX_RATE_LIMIT``)."""
        if rate_limit is not None:
            rate_limit = _rate_limit(rate_limit)
        t = schema.tenants
        with db.write(self.engine) as conn:
            changed = conn.execute(
                sa.update(t).where(t.c.id == name).values(rate_limit=rate_limit)
            ).rowcount
        if not changed:
            raise errors.UnknownTenant(name)
        return self.get_tenant(name)

    def get_tenant(self, name: str) -> dict[str, Any]:
        t = schema.tenants
        with db.read(self.engine) as conn:
            row = conn.execute(sa.select(t).where(t.c.id == name)).first()
        if row is None:
            raise errors.UnknownTenant(name)
        return {
            "name": row.id,
            "created_at": row.created_at.isoformat(),
            "rate_limit": row.rate_limit,
            "effective_rate_limit": row.rate_limit or self.settings.rate_limit,
        }

    def tenant_exists(self, name: str) -> bool:
        with db.read(self.engine) as conn:
            return (
                conn.execute(
                    sa.select(schema.tenants.c.id).where(schema.tenants.c.id == name)
                ).first()
                is not None
            )

    def create_token(
        self,
        tenant: str,
        role: states.Role | str,
        label: str = "",
        *,
        expires_in: timedelta | None = None,
    ) -> str:
        """Mint a token; only its SHA-256 is stored, so this is the one time it is seen.

        ``expires_in``: after that long it authenticates nothing (default: never).
        """
        role = states.Role(role)
        if expires_in is not None and expires_in <= timedelta(0):
            raise errors.InvalidArguments(
                [{"field": "expires_in", "message": "must be positive, e.g. 30d or 12h"}]
            )
        now = self.clock()
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        try:
            with db.write(self.engine) as conn:
                conn.execute(
                    sa.insert(schema.api_tokens),
                    {
                        "token_sha256": hash_token(token),
                        "tenant": tenant,
                        "role": role,
                        "label": label,
                        "created_at": now,
                        "expires_at": None if expires_in is None else now + expires_in,
                    },
                )
        except exc.IntegrityError as error:
            raise errors.UnknownTenant(tenant) from error
        return token

    def revoke_token(self, token: str) -> bool:
        """Revoke by the token itself (its hash); False if unknown or revoked already."""
        t = schema.api_tokens
        return self._revoke(t.c.token_sha256 == hash_token(token))

    def revoke_token_id(self, token_id: int) -> bool:
        """Revoke by the id ``outbox tokens list`` shows; False if unknown or revoked already."""
        return self._revoke(schema.api_tokens.c.id == token_id)

    def _revoke(self, which: sa.ColumnElement[bool]) -> bool:
        t = schema.api_tokens
        with db.write(self.engine) as conn:
            result = conn.execute(
                sa.update(t).where(which, t.c.revoked_at.is_(None)).values(revoked_at=self.clock())
            )
        return result.rowcount > 0

    def list_tokens(self, tenant: str | None = None) -> list[dict[str, Any]]:
        """Every token (never its hash), oldest first: who it is for and when it was used."""
        t = schema.api_tokens
        query = sa.select(
            t.c.id,
            t.c.tenant,
            t.c.role,
            t.c.label,
            t.c.created_at,
            t.c.last_used_at,
            t.c.revoked_at,
        ).order_by(t.c.id)
        if tenant is not None:
            query = query.where(t.c.tenant == tenant)
        with db.read(self.engine) as conn:
            rows = conn.execute(query).all()
        return [
            {
                "id": row.id,
                "tenant": row.tenant,
                "role": str(states.Role(row.role)),
                "label": row.label,
                "created_at": row.created_at.isoformat(),
                "last_used_at": row.last_used_at.isoformat() if row.last_used_at else None,
                "revoked_at": row.revoked_at.isoformat() if row.revoked_at else None,
            }
            for row in rows
        ]

    def authenticate(self, token: str | None) -> Principal | None:
        """The token's tenant and role, or None if missing, unknown, revoked or expired."""
        if not token:
            return None
        digest = hash_token(token)
        t, tenants = schema.api_tokens, schema.tenants
        with db.read(self.engine) as conn:
            row = conn.execute(
                sa.select(
                    t.c.id,
                    t.c.token_sha256,
                    t.c.tenant,
                    t.c.role,
                    t.c.label,
                    t.c.revoked_at,
                    t.c.expires_at,
                    t.c.last_used_at,
                    tenants.c.rate_limit,
                )
                .join(tenants, tenants.c.id == t.c.tenant)
                .where(t.c.token_sha256 == digest)
            ).first()
        if row is None or not hmac.compare_digest(row.token_sha256, digest):
            return None
        if row.revoked_at is not None:
            return None
        now = self.clock()
        if row.expires_at is not None and row.expires_at <= now:
            return None
        if row.last_used_at is None or row.last_used_at <= now - TOKEN_LAST_USED_RESOLUTION:
            self._touch_token(row.id, now)
        return Principal(
            tenant=row.tenant,
            role=states.Role(row.role),
            token_id=row.id,
            label=row.label or "",
            rate_limit=row.rate_limit,
        )

    def _touch_token(self, token_id: int, now: datetime) -> None:
        """Record the use; a guarded UPDATE, so concurrent requests write it once.

        Best effort: a busy database must not turn a valid token away, and a
        missed minute only makes ``last_used_at`` a little older than it is.
        """
        t = schema.api_tokens
        stale = now - TOKEN_LAST_USED_RESOLUTION
        try:
            with db.write(self.engine) as conn:
                conn.execute(
                    sa.update(t)
                    .where(
                        t.c.id == token_id,
                        sa.or_(t.c.last_used_at.is_(None), t.c.last_used_at <= stale),
                    )
                    .values(last_used_at=now)
                )
        except (errors.OutboxError, exc.SQLAlchemyError) as error:
            logger.warning(
                "token last_used_at not recorded: %s", error, extra={"token_id": token_id}
            )

    # --- retention -----------------------------------------------------------

    def prune(self, now: datetime | None = None) -> retention.PruneResult:
        return retention.prune(
            self.engine,
            now=now or self.clock(),
            tombstone_retention=self.settings.tombstone_retention,
        )


def _rate_limit(text: str) -> str:
    try:
        settings.parse_rate_limit(text)
    except ValueError as exc:
        raise errors.InvalidArguments([{"field": "rate_limit", "message": str(exc)}]) from None
    return text.strip().lower()


def effect_view(row: Any) -> dict[str, Any]:
    """One effect as callers see it (no payload, no lease internals)."""
    return {
        "id": row.id,
        "effect": row.effect,
        "adapter": row.adapter,
        "status": row.status,
        "reason": row.reason,
        "attempts": row.attempts,
        "provider_ref": row.provider_ref,
        "last_error": row.last_error,
        "awaiting_review": bool(row.needs_review),
        "next_attempt_at": row.next_attempt_at.isoformat() if row.next_attempt_at else None,
        "deadline_at": row.deadline_at.isoformat(),
        "finished_at": row.finished_at.isoformat() if row.finished_at else None,
    }
