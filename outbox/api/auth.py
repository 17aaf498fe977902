"""Who is calling: bearer tokens to a ``Principal`` (tenant and role), as FastAPI dependencies.

Authentication runs before anything else a route does, on every request,
replays included: an idempotency key is not a credential, and the tenant comes
only from the token, never from the request.

    @router.post("/v1/review/{effect_id}/resolve")
    def resolve(principal: Principal = Depends(auth.require_operator), box = Depends(auth.get_box)):
        ...
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from outbox import states
from outbox.api import problems, ratelimit
from outbox.service import Outbox, Principal

_bearer = HTTPBearer(
    auto_error=False,
    scheme_name="bearer",
    description="An API token from `outbox tokens create`; it names the tenant and the role.",
)


def get_box(request: Request) -> Outbox:
    """The ``Outbox`` the app was created with."""
    box: Outbox = request.app.state.outbox
    return box


def require_principal(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    box: Annotated[Outbox, Depends(get_box)],
) -> Principal:
    """401 unless the bearer token is known and not revoked. Runs in the threadpool (DB read)."""
    if credentials is None:
        raise problems.Unauthenticated("send Authorization: Bearer <token>")
    # Only the token's SHA-256 is looked up (Outbox.authenticate compares in constant time).
    # One message for unknown and revoked, so the answer tells nothing about other tokens.
    principal = box.authenticate(credentials.credentials)
    if principal is None:
        raise problems.Unauthenticated("the token is unknown, revoked or expired")
    request.state.principal = principal
    limiter: ratelimit.Limiter | None = getattr(request.app.state, "rate_limiter", None)
    if limiter is not None:
        # Per tenant, after authentication (an unknown token cannot spend a tenant's quota).
        ratelimit.count_authenticated(
            request.scope.setdefault("state", {}),
            limiter,
            credentials.credentials,
            principal.tenant,
            principal.rate_limit,
        )
    return principal


def require_operator(
    principal: Annotated[Principal, Depends(require_principal)],
) -> Principal:
    """403 for agent tokens: operator routes act on other callers' effects."""
    if principal.role != states.Role.OPERATOR:
        raise problems.Forbidden()
    return principal
