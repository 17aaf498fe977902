"""The console's routes: sign-in, queue, item, resolve (with its confirmation), overview.

Every page re-reads the operator's token (a revoked token stops working at the
next click) and sees only the token's tenant, as ``/v1/review`` does. Every
POST carries the session's CSRF token, checked before anything else is read.

Resolving is two POSTs. The first only validates and shows, on a page of its
own, exactly what will happen; the second (``confirm=yes``) acts. Both carry
the state the operator saw (``expected_status``, ``expected_attempts``) and an
``action_id`` minted when the item page was rendered, so:

- a double click, a reload or a resubmitted confirm page repeats the same
  action id, and ``review.resolve`` replays the recorded result instead of
  acting twice;
- a form that went stale (someone else, or a lookup, settled the item first)
  gets ``ReviewConflict``, and the page shows what happened instead.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Annotated, Any
from urllib.parse import quote, urlencode

from fastapi import APIRouter, Path, Request
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.responses import RedirectResponse, Response

from outbox import errors, states
from outbox import settings as outbox_settings
from outbox.service import Outbox, Principal, hash_token
from reconciler import review
from reconciler.console import pages, queries, session

PREFIX = "/console"
MAX_EFFECT_ID = 2**63 - 1
EffectId = Annotated[int, Path(ge=1, le=MAX_EFFECT_ID)]
Choice = states.ReviewChoice


@dataclass(frozen=True, slots=True)
class Me:
    """The signed-in operator, as the pages show it."""

    tenant: str
    token_id: int
    name: str  # as typed at sign-in: a note in the audit, never the actor
    label: str = ""  # the token's label

    @property
    def actor(self) -> str:
        # The authenticated principal, in the same shape as the HTTP API's actor.
        return Principal(
            tenant=self.tenant, role=states.Role.OPERATOR, token_id=self.token_id, label=self.label
        ).actor


@dataclass(frozen=True, slots=True)
class Resolution:
    """A resolve form as posted, after validation."""

    choice: Choice
    reason: str
    provider_ref: str | None
    action_id: str
    expected_status: str
    expected_attempts: int | None


def _box(request: Request) -> Outbox:
    box: Outbox = request.app.state.outbox
    return box


def _text(form: FormData, name: str) -> str:
    value = form.get(name)
    return value.strip() if isinstance(value, str) else ""


def _safe_next(target: str | None) -> str:
    # Only our own pages: never an open redirect to another site.
    if target and target.startswith(PREFIX + "/") and "\\" not in target and "://" not in target:
        return target
    return f"{PREFIX}/queue"


def _see_other(url: str) -> RedirectResponse:
    return RedirectResponse(url, status_code=303, headers={"Cache-Control": "no-store"})


class Console:
    """The routes, with the per-process signing secret and the template renderer."""

    def __init__(
        self, signer: session.Signer | None = None, renderer: pages.Renderer | None = None
    ) -> None:
        self.signer = signer or session.Signer()
        self.render = renderer or pages.Renderer()

    # --- sessions ------------------------------------------------------------------

    def _signed_in(self, request: Request) -> tuple[session.Session, Me] | None:
        """The session and its operator, or None. Reads the token row (threadpool)."""
        box = _box(request)
        found = self.signer.read(request.cookies.get(session.SESSION_COOKIE), box.clock())
        if found is None:
            return None
        principal = queries.principal_for(box.engine, found.token_sha256, box.clock())
        if principal is None or principal.role != states.Role.OPERATOR:
            return None
        return found, Me(principal.tenant, principal.token_id, found.name, principal.label)

    def _cookie(
        self, response: Response, request: Request, name: str, value: str, age: int
    ) -> None:
        response.set_cookie(
            name,
            value,
            max_age=age,
            path=session.COOKIE_PATH,
            secure=_box(request).settings.console_secure_cookies,
            httponly=True,
            samesite="strict",
        )

    def _forget(self, response: Response, request: Request, name: str) -> None:
        response.delete_cookie(
            name,
            path=session.COOKIE_PATH,
            secure=_box(request).settings.console_secure_cookies,
            httponly=True,
            samesite="strict",
        )

    def _to_sign_in(self, request: Request) -> RedirectResponse:
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return _see_other(f"{PREFIX}/sign-in?next={quote(target, safe='')}")

    def _page(
        self, template: str, sign: tuple[session.Session, Me] | None, status: int = 200, **ctx: Any
    ) -> Response:
        if sign is not None:
            ctx.setdefault("me", sign[1])
            ctx.setdefault("csrf", self.signer.csrf(sign[0]))
        ctx.setdefault("me", None)
        ctx.setdefault("csrf", "")
        ctx.setdefault("nav", "")
        return self.render.page(template, status, **ctx)

    def _refused(self, sign: tuple[session.Session, Me] | None) -> Response:
        return self._page(
            "message.html",
            sign,
            403,
            title="Form refused",
            message=(
                "This form did not carry the session's security token, so it was refused and "
                "nothing changed. Reload the page and submit it again."
            ),
        )

    # --- sign-in ---------------------------------------------------------------

    def sign_in_page(
        self,
        request: Request,
        *,
        status: int = 200,
        error: str = "",
        notice: str = "",
        name: str = "",
    ) -> Response:
        nonce = self.signer.sign_in_nonce()
        response = self._page(
            "sign_in.html",
            None,
            status,
            title="Sign in",
            error=error,
            notice=notice,
            name=name,
            next=_safe_next(request.query_params.get("next")),
            sign_in_csrf=self.signer.sign_in_csrf(nonce),
        )
        age = int(session.SIGN_IN_WINDOW.total_seconds())
        self._cookie(response, request, session.SIGN_IN_COOKIE, nonce, age)
        return response

    def sign_in(self, request: Request, form: FormData) -> Response:
        nonce = request.cookies.get(session.SIGN_IN_COOKIE)
        if not self.signer.check_sign_in_csrf(nonce, form.get("csrf")):
            return self._refused(None)
        box = _box(request)
        token = _text(form, "token")
        name = _text(form, "name")[: session.NAME_MAX]
        principal: Principal | None = box.authenticate(token) if token else None
        if principal is None:
            return self.sign_in_page(
                request, status=401, error="That token is unknown or revoked.", name=name
            )
        if principal.role != states.Role.OPERATOR:
            return self.sign_in_page(
                request,
                status=403,
                error="Agent tokens cannot sign in to the console. Use an operator token.",
                name=name,
            )
        response = _see_other(_safe_next(_text(form, "next")))
        value = self.signer.issue(hash_token(token), name, box.clock())
        self._cookie(
            response,
            request,
            session.SESSION_COOKIE,
            value,
            int(self.signer.duration.total_seconds()),
        )
        self._forget(response, request, session.SIGN_IN_COOKIE)
        return response

    def sign_out(self, request: Request, form: FormData) -> Response:
        sign = self._signed_in(request)
        if sign is not None and not self.signer.check_csrf(sign[0], form.get("csrf")):
            return self._refused(sign)
        response = _see_other(f"{PREFIX}/sign-in?signed_out=1")
        self._forget(response, request, session.SESSION_COOKIE)
        return response

    # --- the queue ---------------------------------------------------------------

    def queue(self, request: Request) -> Response:
        sign = self._signed_in(request)
        if sign is None:
            return self._to_sign_in(request)
        me = sign[1]
        params = request.query_params
        problems: dict[str, str] = {}
        tenant = params.get("tenant") or me.tenant
        if tenant != me.tenant:
            problems["tenant"] = f"This token sees tenant {me.tenant} only."
            tenant = me.tenant
        group: review.Group | None = None
        if params.get("group"):
            try:
                group = review.Group(params["group"])
            except ValueError:
                problems["group"] = "Choose awaiting review, awaiting lookup, or both."
        min_age: timedelta | None = None
        min_age_text = (params.get("min_age") or "").strip()
        if min_age_text:
            parsed = outbox_settings.parse_duration(min_age_text)
            if isinstance(parsed, timedelta):
                min_age = parsed
            else:
                problems["min_age"] = "Write an age like 90s, 15m, 2h or 1d."
        adapter = params.get("adapter") or None
        box = _box(request)
        now = box.clock()
        filters = queries.Filters(tenant=tenant, adapter=adapter, group=group, min_age=min_age)
        found = queries.queue(box.engine, filters, now)
        return self._page(
            "queue.html",
            sign,
            400 if problems else 200,
            title="Review queue",
            nav="queue",
            queue=found,
            filters=filters,
            min_age_text=min_age_text,
            problems=problems,
        )

    # --- one item ----------------------------------------------------------------

    def item(self, request: Request, effect_id: int) -> Response:
        sign = self._signed_in(request)
        if sign is None:
            return self._to_sign_in(request)
        done = request.query_params.get("done")
        return self._item_page(
            _box(request),
            sign,
            effect_id,
            done=done,
            replayed=request.query_params.get("replayed") == "1",
        )

    def _not_found(self, sign: tuple[session.Session, Me], effect_id: int) -> Response:
        return self._page(
            "message.html",
            sign,
            404,
            title="Not found",
            message=f"There is no effect #{effect_id} for tenant {sign[1].tenant}.",
        )

    def _item_page(
        self,
        box: Outbox,
        sign: tuple[session.Session, Me],
        effect_id: int,
        *,
        status: int = 200,
        done: str | None = None,
        replayed: bool = False,
        form: Mapping[str, Any] | None = None,
        problems: Mapping[str, str] | None = None,
    ) -> Response:
        try:
            item = review.show(box.engine, effect_id, tenant=sign[1].tenant)
        except errors.EffectNotFound:
            return self._not_found(sign, effect_id)
        recorded = next((a for a in item["audit"] if a["action_id"] == done), None)
        values = dict(form or {})
        # A fresh action id for every rendering of the form: one decision, one id.
        values.setdefault("action_id", f"console_{uuid.uuid4().hex}")
        return self._page(
            "item.html",
            sign,
            status,
            title=f"Effect #{effect_id}",
            nav="queue",
            item=item,
            recorded=recorded,
            replayed=replayed,
            form=values,
            problems=problems or {},
            can_resolve=item["status"] == states.EffectStatus.OUTCOME_UNKNOWN,
        )

    # --- resolving -----------------------------------------------------------------

    def resolve(self, request: Request, effect_id: int, form: FormData) -> Response:
        sign = self._signed_in(request)
        if sign is None:
            return self._page(
                "message.html",
                None,
                401,
                title="Signed out",
                message="Your session ended, so nothing changed. Sign in and try again.",
            )
        if not self.signer.check_csrf(sign[0], form.get("csrf")):
            return self._refused(sign)
        me = sign[1]
        box = _box(request)
        posted = {k: _text(form, k) for k in ("choice", "provider_ref", "reason", "action_id")}
        resolution, problems = _validate(form)
        if resolution is None:
            return self._item_page(box, sign, effect_id, status=422, form=posted, problems=problems)
        try:
            item = review.show(box.engine, effect_id, tenant=me.tenant)
        except errors.EffectNotFound:
            return self._not_found(sign, effect_id)
        if _text(form, "confirm") != "yes":
            if (
                item["status"] != resolution.expected_status
                or item["attempts"] != resolution.expected_attempts
            ) and not any(a["action_id"] == resolution.action_id for a in item["audit"]):
                return self._conflict(sign, item)
            return self._page(
                "confirm.html",
                sign,
                title=f"Confirm: effect #{effect_id}",
                nav="queue",
                item=item,
                action=resolution,
            )
        try:
            result = review.resolve(
                box.engine,
                effect_id,
                choice=resolution.choice,
                reason=resolution.reason,
                actor=me.actor,
                actor_token_id=me.token_id,
                actor_note=me.name or None,
                action_id=resolution.action_id,
                expected_status=resolution.expected_status,
                expected_attempts=resolution.expected_attempts,
                provider_ref=resolution.provider_ref,
                tenant=me.tenant,
                now=box.clock(),
                effect_deadline=box.settings.effect_deadline,
            )
        except errors.ReviewConflict:
            return self._conflict(sign, review.show(box.engine, effect_id, tenant=me.tenant))
        except errors.InvalidArguments as exc:
            fields = {e["field"]: e["message"] for e in exc.errors}
            return self._item_page(box, sign, effect_id, status=422, form=posted, problems=fields)
        query = {"done": result.action_id}
        if result.replayed:
            query["replayed"] = "1"
        return _see_other(f"{PREFIX}/items/{effect_id}?{urlencode(query)}")

    def _conflict(self, sign: tuple[session.Session, Me], item: dict[str, Any]) -> Response:
        """What happened instead: the last recorded action, else the current state."""
        last = item["audit"][-1] if item["audit"] else None
        lookup = item["lookups"][-1] if item["lookups"] else None
        return self._page(
            "conflict.html",
            sign,
            409,
            title=f"Already resolved: effect #{item['id']}",
            nav="queue",
            item=item,
            last=last,
            lookup=lookup,
        )

    # --- the overview --------------------------------------------------------------

    def overview(self, request: Request) -> Response:
        sign = self._signed_in(request)
        if sign is None:
            return self._to_sign_in(request)
        box = _box(request)
        found = queries.overview(box.engine, sign[1].tenant, box.clock())
        return self._page(
            "overview.html",
            sign,
            title="Overview",
            nav="overview",
            overview=found,
            chart=pages.bar_chart(found.outcomes),
        )

    # --- the router ----------------------------------------------------------------

    def router(self) -> APIRouter:
        router = APIRouter(prefix=PREFIX, include_in_schema=False)

        @router.get("")
        def home() -> Response:
            return _see_other(f"{PREFIX}/queue")

        @router.get("/sign-in")
        def sign_in_page(request: Request) -> Response:
            if self._signed_in(request) is not None:
                return _see_other(_safe_next(request.query_params.get("next")))
            notice = "You are signed out." if request.query_params.get("signed_out") else ""
            return self.sign_in_page(request, notice=notice)

        @router.post("/sign-in")
        async def sign_in(request: Request) -> Response:
            form = await request.form()
            return await run_in_threadpool(self.sign_in, request, form)

        @router.post("/sign-out")
        async def sign_out(request: Request) -> Response:
            form = await request.form()
            return await run_in_threadpool(self.sign_out, request, form)

        @router.get("/queue")
        def queue(request: Request) -> Response:
            return self.queue(request)

        @router.get("/overview")
        def overview(request: Request) -> Response:
            return self.overview(request)

        @router.get("/items/{effect_id}")
        def item(request: Request, effect_id: EffectId) -> Response:
            return self.item(request, effect_id)

        @router.post("/items/{effect_id}/resolve")
        async def resolve(request: Request, effect_id: EffectId) -> Response:
            form = await request.form()
            return await run_in_threadpool(self.resolve, request, effect_id, form)

        @router.get("/static/{name}")
        def static(name: str) -> Response:
            media_type = pages.STATIC_FILES.get(name)
            if media_type is None:
                return Response(status_code=404)
            return Response(
                pages.static_file(name),
                media_type=media_type,
                headers={"Cache-Control": "max-age=300", "X-Content-Type-Options": "nosniff"},
            )

        return router


def _validate(form: FormData) -> tuple[Resolution | None, dict[str, str]]:
    """The resolve form's fields, or a message per bad field. Nothing is read from the database."""
    problems: dict[str, str] = {}
    choice: Choice | None = None
    try:
        choice = Choice(_text(form, "choice"))
    except ValueError:
        problems["choice"] = "Choose what happened."
    reason = _text(form, "reason")
    if not reason:
        problems["reason"] = "Say why: the reason is kept in the audit trail."
    elif len(reason) > review.REASON_MAX:
        problems["reason"] = f"At most {review.REASON_MAX} characters."
    provider_ref: str | None = _text(form, "provider_ref") or None
    if choice is Choice.HAPPENED:
        if provider_ref is None:
            problems["provider_ref"] = "Give the provider's reference for the effect you found."
        elif len(provider_ref) > 500:
            problems["provider_ref"] = "At most 500 characters."
    else:
        provider_ref = None  # only "happened" carries one; a leftover entry is ignored
    action_id = _text(form, "action_id")
    if not action_id or len(action_id) > review.ACTION_ID_MAX or not action_id.isprintable():
        problems["action_id"] = "This form is incomplete; reload the item and try again."
    expected_status = _text(form, "expected_status")
    if expected_status != states.EffectStatus.OUTCOME_UNKNOWN:
        problems["expected_status"] = "This form is incomplete; reload the item and try again."
    expected_attempts: int | None = None
    try:
        expected_attempts = int(_text(form, "expected_attempts"))
    except ValueError:
        problems["expected_attempts"] = "This form is incomplete; reload the item and try again."
    if problems or choice is None or expected_attempts is None:
        return None, problems
    return (
        Resolution(choice, reason, provider_ref, action_id, expected_status, expected_attempts),
        {},
    )
