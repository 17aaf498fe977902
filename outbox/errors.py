"""The errors Outbox raises. Every one is an ``OutboxError``.

```
* OutboxError
  x RequestError                 the caller must change something; retrying as-is is useless
    · InvalidArguments             422, retry=after_fix, per-field ``errors``
    · InvalidOperationId           400, retry=after_fix
    · UnknownTool                  404, retry=after_fix
    · UnknownTenant                404, retry=after_fix
    · IdempotencyKeyReused         422, retry=never
    · OperationExpired             410, retry=reconcile
  x NotFound                     404 (another tenant's records are "not found" too)
    · OperationNotFound · TaskNotFound · EffectNotFound
  x Busy                         503, retry=same_key: the lock wait ran out
  x Conflict                     409: the state is not the one the action expected
    · StaleTransition · ReviewConflict · ApprovalConflict
  x SchemaError                  run ``outbox db upgrade`` (or upgrade the code)
    · SchemaNotCurrent · SchemaTooNew
  x ConfigError                  a setting is out of bounds; the message names it
```

Errors carry the ids they are about as attributes, not only in the message.
``problem_type``, ``status`` and ``retry`` are what the HTTP layer renders.
"""

from __future__ import annotations

from typing import Any, ClassVar


class OutboxError(Exception):
    """Unexpected outbox error."""

    problem_type: ClassVar[str] = "internal"
    status: ClassVar[int] = 500
    retry: ClassVar[str] = "same_key"
    title: ClassVar[str] = "Internal error"

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())

    @property
    def detail(self) -> str:
        return str(self)


class RequestError(OutboxError):
    """The request cannot succeed as it is."""

    status = 400
    retry = "after_fix"


class InvalidArguments(RequestError):
    """The tool's arguments are invalid; nothing was stored."""

    problem_type = "invalid-arguments"
    title = "Invalid arguments"
    status = 422

    def __init__(self, errors: list[dict[str, Any]], message: str | None = None) -> None:
        self.errors = errors
        fields = ", ".join(f"{e['field']}: {e['message']}" for e in errors)
        super().__init__(message or f"invalid arguments ({fields}); nothing was stored")


class InvalidOperationId(RequestError):
    """The operation id must be 1-255 visible ASCII characters."""

    problem_type = "invalid-operation-id"
    title = "Invalid operation id"
    status = 400


class UnknownTool(RequestError):
    """No tool of that name is registered."""

    problem_type = "unknown-tool"
    title = "Unknown tool"
    status = 404

    def __init__(self, tool: str, known: list[str]) -> None:
        self.tool = tool
        self.known = sorted(known)
        super().__init__(f"no tool named {tool!r}; known tools: {', '.join(sorted(known))}")


class UnknownTenant(RequestError):
    """No tenant of that name exists: create it with `outbox tenants create`."""

    problem_type = "unknown-tenant"
    title = "Unknown tenant"
    status = 404

    def __init__(self, tenant: str) -> None:
        self.tenant = tenant
        super().__init__(f"no tenant {tenant!r}; create it with `outbox tenants create {tenant}`")


class IdempotencyKeyReused(RequestError):
    """Same (tenant, operation_id), different arguments: the key was used for another intent."""

    problem_type = "idempotency-key-reused"
    title = "Idempotency key reused with different arguments"
    status = 422
    retry = "never"

    def __init__(self, tenant: str, operation_id: str) -> None:
        self.tenant = tenant
        self.operation_id = operation_id
        super().__init__(
            f"operation id {operation_id!r} was already used with different arguments; "
            "use a new operation id for a new intent, or resend the original arguments"
        )


class OperationExpired(RequestError):
    """The operation's record expired: look its outcome up, do not retry under a fresh key."""

    problem_type = "operation-expired"
    title = "Operation record expired"
    status = 410
    retry = "reconcile"

    def __init__(self, tenant: str, operation_id: str, *, same_arguments: bool) -> None:
        self.tenant = tenant
        self.operation_id = operation_id
        self.same_arguments = same_arguments
        super().__init__(
            f"operation {operation_id!r} was recorded and has expired past the retention "
            "window; its outcome must be reconciled (GET the task or ask an operator), "
            "not retried under a fresh key"
        )


class NotFound(OutboxError):
    """Not found."""

    problem_type = "not-found"
    title = "Not found"
    status = 404
    retry = "never"


class OperationNotFound(NotFound):
    """No such operation for this tenant."""

    def __init__(self, tenant: str, operation_id: str) -> None:
        self.tenant = tenant
        self.operation_id = operation_id
        super().__init__(f"no operation {operation_id!r}")


class TaskNotFound(NotFound):
    """No such task for this tenant."""

    def __init__(self, tenant: str, task_id: int) -> None:
        self.tenant = tenant
        self.task_id = task_id
        super().__init__(f"no task {task_id}")


class EffectNotFound(NotFound):
    """No such effect."""

    def __init__(self, effect_id: int) -> None:
        self.effect_id = effect_id
        super().__init__(f"no effect {effect_id}")


class Busy(OutboxError):
    """The database stayed locked past the busy timeout: retry with the same key."""

    problem_type = "busy"
    title = "Busy"
    status = 503
    retry = "same_key"
    retry_after_seconds: ClassVar[int] = 1


class Conflict(OutboxError):
    """The record is not in the state the action expected."""

    problem_type = "conflict"
    title = "Conflict"
    status = 409
    retry = "never"


class StaleTransition(Conflict):
    """A guarded update found the row in another state (or under another fence)."""

    def __init__(self, effect_id: int, expected: str, detail: str | None = None) -> None:
        self.effect_id = effect_id
        self.expected = expected
        super().__init__(detail or f"effect {effect_id} is no longer {expected}")


class ReviewConflict(Conflict):
    """The item is no longer in the state the operator saw: someone else acted first."""

    problem_type = "review-conflict"
    title = "Review item changed"

    def __init__(self, effect_id: int, expected: str, actual: str, detail: str | None = None):
        self.effect_id = effect_id
        self.expected = expected
        self.actual = actual
        super().__init__(
            detail
            or f"effect {effect_id} was expected to be {expected} but is {actual}; nothing changed"
        )


class ApprovalConflict(Conflict):
    """The operation's approval was already decided the other way, or it needs none."""

    problem_type = "approval-conflict"
    title = "Approval already decided"

    def __init__(self, tenant: str, operation_id: str, actual: str | None, detail: str) -> None:
        self.tenant = tenant
        self.operation_id = operation_id
        self.actual = actual
        super().__init__(detail)


class SchemaError(OutboxError):
    """The database schema does not match this code."""

    problem_type = "schema"
    title = "Schema not current"
    status = 503
    retry = "after_fix"


class SchemaNotCurrent(SchemaError):
    """The database schema is older than the code: run `outbox db upgrade`."""

    def __init__(self, current: str | None, head: str) -> None:
        self.current = current
        self.head = head
        at = f"at revision {current}" if current else "not migrated"
        super().__init__(
            f"the database is {at}, the code needs {head}: run `outbox db upgrade` first"
        )


class SchemaTooNew(SchemaError):
    """The database schema is newer than this code: upgrade the code."""

    def __init__(self, current: str, head: str) -> None:
        self.current = current
        self.head = head
        super().__init__(
            f"the database is at revision {current}, which this code ({head}) does not know; "
            "install the newer release of outbox-service"
        )


class ConfigError(OutboxError):
    """A setting is invalid."""

    problem_type = "config"
    title = "Invalid configuration"
