"""The console's routes: sign-in, queue, item, resolve (with its confirmation), overview,
search and the operation page.

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

Every item has a link that survives a restart and can be pasted: an effect is
``/console/items/<id>``, an operation ``/console/operations/<operation id>``
(escaped). Signed out, the link goes through sign-in and back. A page that
fails says so first, in an alert that takes the focus, with the real cause:
which field, which token, which database error.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Annotated, Any
from urllib.parse import quote, urlencode

from fastapi import APIRouter, Path, Request
from sqlalchemy import exc as sa_exc
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.responses import RedirectResponse, Response

from outbox import errors, states
from outbox import settings as outbox_settings
from outbox.delivery import ordering
from outbox.service import Outbox, Principal, hash_token
from reconciler import bulk, review
from reconciler.console import pages, plots, queries, session

PREFIX = "/console"
BLOCKED_LABELS = {
    ordering.BlockedBy.REVIEW.value: "its outcome is unknown and waits for a person",
    ordering.BlockedBy.OUTCOME_UNKNOWN.value: "its outcome is unknown; a lookup or webhook may settle it",
    ordering.BlockedBy.RETRY.value: "it waits for its next retry",
    ordering.BlockedBy.IN_FLIGHT.value: "it is being delivered",
    ordering.BlockedBy.QUEUED.value: "it is queued for its first attempt",
}
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


def _effect_id(text: str) -> int | None:
    """An effect id from a pasted URL, or None when it cannot be one."""
    if not text.isascii() or not text.isdigit() or len(text) > 19:
        return None
    value = int(text)
    return value if 1 <= value <= MAX_EFFECT_ID else None


def _database_cause(exc: sa_exc.DBAPIError) -> str:
    """The driver's own words, first line only: no SQL, no parameters."""
    orig = exc.orig if exc.orig is not None else exc
    kind = type(orig)
    first = (str(orig).strip().splitlines() or [""])[0]
    return f"{kind.__module__}.{kind.__qualname__}: {first}"


FIELD_ANCHORS = {
    "choice": "choice-happened",
    "provider_ref": "provider_ref",
    "reason": "reason",
    "tenant": "f-tenant",
    "group": "f-group",
    "min_age": "f-min-age",
    "q": "search-q",
}


def _problems_alert(summary: str, problems: Mapping[str, str]) -> pages.Alert:
    return pages.Alert(
        summary, tuple((message, FIELD_ANCHORS.get(f)) for f, message in problems.items())
    )


class Console:
    """The routes, with the per-process signing secret and the template renderer."""

    def __init__(
        self, signer: session.Signer | None = None, renderer: pages.Renderer | None = None
    ) -> None:
        self.signer = signer or session.Signer()
        self.render = renderer or pages.Renderer()

    # --- sessions ------------------------------------------------------------------

    def _signed_in(self, request: Request) -> tuple[session.Session, Me] | None:
        """The session and its operator, or None. Reads the token row (threadpool).

        Why there is none is kept on the request, for the page that says so.
        """
        box = _box(request)
        found, ended = self.signer.check(request.cookies.get(session.SESSION_COOKIE), box.clock())
        request.state.console_ended = ended
        if found is None:
            return None
        principal = queries.principal_for(box.engine, found.token_sha256, box.clock())
        if principal is None or principal.role != states.Role.OPERATOR:
            request.state.console_ended = session.Ended.REVOKED
            return None
        return found, Me(principal.tenant, principal.token_id, found.name, principal.label)

    def _ended(self, request: Request) -> session.Ended | None:
        ended: session.Ended | None = getattr(request.state, "console_ended", None)
        return ended

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
        query = {"next": target}
        ended = self._ended(request)
        if ended is not None and ended is not session.Ended.MISSING:
            query["ended"] = ended.value
        return _see_other(f"{PREFIX}/sign-in?{urlencode(query, quote_via=quote)}")

    def _page(
        self, template: str, sign: tuple[session.Session, Me] | None, status: int = 200, **ctx: Any
    ) -> Response:
        if sign is not None:
            ctx.setdefault("me", sign[1])
            ctx.setdefault("csrf", self.signer.csrf(sign[0]))
        ctx.setdefault("me", None)
        ctx.setdefault("csrf", "")
        ctx.setdefault("nav", "")
        ctx.setdefault("alert", None)
        ctx.setdefault("q", "")
        return self.render.page(template, status, **ctx)

    def _message(
        self,
        sign: tuple[session.Session, Me] | None,
        status: int,
        title: str,
        alert: pages.Alert,
    ) -> Response:
        return self._page("message.html", sign, status, title=title, alert=alert)

    def _refused(self, sign: tuple[session.Session, Me] | None, token: object = None) -> Response:
        if isinstance(token, str) and token:
            cause = (
                "The form's security token belongs to another session: you signed in again, "
                "or the console restarted, after this page was loaded."
            )
        else:
            cause = "The form carried no security token (csrf field)."
        return self._message(
            sign,
            403,
            "Form refused",
            pages.Alert.of(
                "Nothing changed: the security check on this form failed.",
                cause,
                "Reload the page and submit it again.",
            ),
        )

    def _database_error(self, exc: sa_exc.DBAPIError) -> Response:
        return self._message(
            None,
            503,
            "Database unavailable",
            pages.Alert.of(
                "The database did not answer, so this page could not be read and nothing changed.",
                _database_cause(exc),
            ),
        )

    def guarded(self, handler: Any, *args: Any) -> Response:
        """Run one page; a database failure becomes a page that names it."""
        try:
            response: Response = handler(*args)
        except sa_exc.DBAPIError as exc:
            return self._database_error(exc)
        return response

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
        alert = None
        if error:
            alert = pages.Alert.of("You are not signed in.", error)
        else:
            try:
                ended = session.Ended(request.query_params.get("ended", ""))
            except ValueError:
                ended = None
            if ended in session.ENDED_MESSAGES:
                alert = pages.Alert.of(
                    "You were signed out.", session.ENDED_MESSAGES[ended], tone="warn"
                )
        response = self._page(
            "sign_in.html",
            None,
            status,
            title="Sign in",
            alert=alert,
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
            if form.get("csrf") and not nonce:
                return self.sign_in_page(
                    request,
                    status=403,
                    error=(
                        "The sign-in form expired or its cookie was not sent (cookies blocked, "
                        "or the page is older than an hour). This fresh form will work."
                    ),
                )
            return self._refused(None, form.get("csrf"))
        box = _box(request)
        token = _text(form, "token")
        name = _text(form, "name")[: session.NAME_MAX]
        principal: Principal | None = box.authenticate(token) if token else None
        if principal is None:
            return self.sign_in_page(
                request, status=401, error=self._why_refused(box, token), name=name
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

    def _why_refused(self, box: Outbox, token: str) -> str:
        """The real reason a token cannot sign in: never typed, revoked, or unknown here."""
        if not token:
            return "No token was given: paste an operator token."
        revoked = queries.revoked_at(box.engine, hash_token(token))
        if revoked is not None:
            return f"That token was revoked at {pages.when(revoked)}: ask for a new operator token."
        return (
            "That token is unknown to this deployment: no token with that value exists in its "
            "database. Check that you copied all of it (it starts with obx_) and that this is "
            "the right console."
        )

    def sign_out(self, request: Request, form: FormData) -> Response:
        sign = self._signed_in(request)
        if sign is not None and not self.signer.check_csrf(sign[0], form.get("csrf")):
            return self._refused(sign, form.get("csrf"))
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
            alert=_problems_alert("The filters were not applied as given:", problems)
            if problems
            else None,
            title="Review queue",
            nav="queue",
            queue=found,
            filters=filters,
            min_age_text=min_age_text,
            problems=problems,
        )

    # --- one item ----------------------------------------------------------------

    def item(self, request: Request, effect_id_text: str) -> Response:
        sign = self._signed_in(request)
        if sign is None:
            return self._to_sign_in(request)
        effect_id = _effect_id(effect_id_text)
        if effect_id is None:
            return self._bad_effect_id(sign, effect_id_text)
        done = request.query_params.get("done")
        return self._item_page(
            _box(request),
            sign,
            effect_id,
            done=done,
            replayed=request.query_params.get("replayed") == "1",
        )

    def _not_found(self, sign: tuple[session.Session, Me], effect_id: int) -> Response:
        # The same answer for another tenant's effect: a link is not a credential.
        return self._message(
            sign,
            404,
            "Not found",
            pages.Alert.of(f"There is no effect #{effect_id} for tenant {sign[1].tenant}."),
        )

    def _bad_effect_id(self, sign: tuple[session.Session, Me], text: str) -> Response:
        shown = text if len(text) <= 40 else text[:40] + "..."
        return self._message(
            sign,
            404,
            "Not found",
            pages.Alert.of(
                f"There is no effect {shown!r}.",
                "Effect links end in the effect's number, like /console/items/42. To find an "
                "effect by its key, operation id or provider reference, use the search.",
            ),
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
            alert=_problems_alert("Nothing changed. Fix this first:", problems)
            if problems
            else None,
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

    def _resolve_text(self, request: Request, effect_id_text: str, form: FormData) -> Response:
        effect_id = _effect_id(effect_id_text)
        if effect_id is None:
            sign = self._signed_in(request)
            if sign is None:
                return self._signed_out(request)
            return self._bad_effect_id(sign, effect_id_text)
        return self.resolve(request, effect_id, form)

    def _signed_out(self, request: Request) -> Response:
        """A POST without a session: nothing changed, and why the session is gone."""
        ended = self._ended(request)
        cause = session.ENDED_MESSAGES.get(
            ended or session.Ended.MISSING,
            "This browser has no session here: you signed out, or never signed in.",
        )
        return self._message(
            None, 401, "Signed out", pages.Alert.of("Nothing changed: you are signed out.", cause)
        )

    def resolve(self, request: Request, effect_id: int, form: FormData) -> Response:
        sign = self._signed_in(request)
        if sign is None:
            return self._signed_out(request)
        if not self.signer.check_csrf(sign[0], form.get("csrf")):
            return self._refused(sign, form.get("csrf"))
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
        now = box.clock()
        found = queries.overview(box.engine, sign[1].tenant, now)
        return self._page(
            "overview.html",
            sign,
            title="Overview",
            nav="overview",
            overview=found,
            chart=pages.bar_chart(found.outcomes),
            panels=plots.panels(box.engine, sign[1].tenant, now),
            windows=plots.WINDOWS,
        )

    # --- search and the operation page -----------------------------------------------

    def search(self, request: Request) -> Response:
        sign = self._signed_in(request)
        if sign is None:
            return self._to_sign_in(request)
        text = (request.query_params.get("q") or "").strip()
        tenant = sign[1].tenant
        context: dict[str, Any] = {"title": "Search", "q": text, "hits": None}
        if len(text) > queries.SEARCH_MAX:
            alert = _problems_alert(
                "Nothing was searched:",
                {
                    "q": f"The search text is {len(text)} characters long; operation ids, effect "
                    f"keys and provider references are at most {queries.SEARCH_MAX}."
                },
            )
            return self._page("search.html", sign, 400, alert=alert, **context)
        if text:
            context["hits"] = queries.search(_box(request).engine, tenant, text)
        return self._page("search.html", sign, **context)

    def operation(self, request: Request, operation_id: str) -> Response:
        sign = self._signed_in(request)
        if sign is None:
            return self._to_sign_in(request)
        box = _box(request)
        tenant = sign[1].tenant
        try:
            found = box.get_operation(tenant, operation_id)
        except errors.OperationExpired:
            return self._message(
                sign,
                410,
                "Operation expired",
                pages.Alert.of(
                    f"Operation {operation_id!r} expired in tenant {tenant}.",
                    "Its record passed the retention window: only its key and its arguments' "
                    "digest are kept, so a late retry is told to reconcile instead of creating "
                    "a second task.",
                    tone="warn",
                ),
            )
        except errors.OperationNotFound:
            # The same answer for another tenant's operation: a link is not a credential.
            return self._message(
                sign,
                404,
                "Not found",
                pages.Alert.of(f"There is no operation {operation_id!r} for tenant {tenant}."),
            )
        task = None
        if found["task_id"] is not None:
            try:
                task = box.get_task(tenant, found["task_id"])
            except errors.TaskNotFound:
                task = None
        return self._page(
            "operation.html",
            sign,
            title=f"Operation {operation_id}",
            nav="queue",
            operation=found,
            task=task,
        )

    # --- approvals -------------------------------------------------------------------

    def approvals(
        self, request: Request, *, status: int = 200, notice: str = "", problem: str = ""
    ) -> Response:
        sign = self._signed_in(request)
        if sign is None:
            return self._to_sign_in(request)
        try:
            chosen = states.ApprovalStatus(request.query_params.get("status", "awaiting_approval"))
        except ValueError:
            chosen = states.ApprovalStatus.AWAITING_APPROVAL
        items = _box(request).list_approvals(sign[1].tenant, status=chosen)
        return self._page(
            "approvals.html",
            sign,
            status,
            title="Approvals",
            nav="approvals",
            items=items,
            shown=chosen.value,
            notice=notice,
            problem=problem,
        )

    def decide(self, request: Request, form: FormData) -> Response:
        """One POST acts: a decision is a compare-and-set and safe to repeat."""
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
        operation_id = _text(form, "operation_id")
        try:
            decision = states.ApprovalDecision(_text(form, "decision"))
            result = _box(request).decide_approval(
                sign[1].tenant,
                operation_id,
                decision,
                # The token is the actor; the name typed at sign-in is only a note.
                actor=f"{sign[1].actor}; note: {sign[1].name}" if sign[1].name else sign[1].actor,
                reason=_text(form, "reason"),
            )
        except ValueError:
            return self.approvals(request, status=422, problem="Choose approve or reject.")
        except errors.InvalidArguments as exc:
            detail = "; ".join(e["message"] for e in exc.errors)
            return self.approvals(request, status=422, problem=f"{operation_id}: {detail}.")
        except (errors.ApprovalConflict, errors.NotFound) as exc:
            return self.approvals(request, status=exc.status, problem=str(exc))
        verb = "approved" if decision is states.ApprovalDecision.APPROVE else "rejected"
        notice = (
            f"{operation_id} {verb}." if result.changed else f"{operation_id} was already {verb}."
        )
        return _see_other(f"{PREFIX}/approvals?{urlencode({'notice': notice})}")

    # --- ordering groups -------------------------------------------------------------

    def groups(self, request: Request) -> Response:
        sign = self._signed_in(request)
        if sign is None:
            return self._to_sign_in(request)
        box = _box(request)
        return self._page(
            "groups.html",
            sign,
            title="Ordering groups",
            nav="groups",
            groups=ordering.blocked_groups(box.engine, tenant=sign[1].tenant),
            blocked_labels=BLOCKED_LABELS,
        )

    # --- bulk actions ----------------------------------------------------------------

    def bulk_page(self, request: Request, form: FormData | None = None) -> Response:
        sign = self._signed_in(request)
        if sign is None:
            if form is None:
                return self._to_sign_in(request)
            return self._page(
                "message.html",
                None,
                401,
                title="Signed out",
                message="Your session ended, so nothing changed. Sign in and try again.",
            )
        me = sign[1]
        box = _box(request)
        values = {
            k: (_text(form, k) if form is not None else request.query_params.get(k, "")).strip()
            for k in (
                "adapter",
                "problem",
                "older_than",
                "action",
                "resolution",
                "reason",
                "bulk_id",
                "step",
            )
        }
        ctx: dict[str, Any] = {
            "form": values,
            "problems": {},
            "preview": None,
            "result": None,
            "actions": [a.value for a in bulk.Action],
            "resolutions": [r.value for r in bulk.Resolution],
        }
        if form is None:
            return self._page("bulk.html", sign, title="Bulk action", nav="bulk", **ctx)
        if not self.signer.check_csrf(sign[0], form.get("csrf")):
            return self._refused(sign)
        older_than = None
        if values["older_than"]:
            parsed = outbox_settings.parse_duration(values["older_than"])
            if isinstance(parsed, timedelta):
                older_than = parsed
            else:
                ctx["problems"]["older_than"] = "Write an age like 90s, 15m, 2h or 1d."
        if values["action"] not in ctx["actions"]:
            ctx["problems"]["action"] = "Choose resolve, retry-lookup or abandon."
        if ctx["problems"]:
            return self._page("bulk.html", sign, 422, title="Bulk action", nav="bulk", **ctx)
        where = bulk.Filter(
            me.tenant,
            adapter=values["adapter"] or None,
            problem=values["problem"] or None,
            older_than=older_than,
        )
        apply = values["step"] == "apply"
        try:
            result = bulk.run(
                box.engine,
                where,
                action=values["action"],
                resolution=values["resolution"] or None,
                reason=values["reason"] or ("dry run" if not apply else ""),
                actor=me.actor,
                bulk_id=values["bulk_id"] or f"bulk_{uuid.uuid4().hex[:16]}",
                dry_run=not apply,
                now=box.clock(),
                effect_deadline=box.settings.effect_deadline,
            )
        except errors.InvalidArguments as exc:
            ctx["problems"] = {e["field"]: e["message"] for e in exc.errors}
            return self._page("bulk.html", sign, 422, title="Bulk action", nav="bulk", **ctx)
        except errors.ReviewConflict as exc:
            ctx["problems"] = {"bulk_id": exc.detail}
            return self._page("bulk.html", sign, 409, title="Bulk action", nav="bulk", **ctx)
        if apply:
            ctx["result"] = result
        else:
            # The id the apply step will use: a double submit repeats, never doubles.
            values["bulk_id"] = values["bulk_id"] or f"bulk_{uuid.uuid4().hex[:16]}"
            ctx["preview"] = result
        return self._page("bulk.html", sign, title="Bulk action", nav="bulk", **ctx)

    # --- the router ----------------------------------------------------------------

    def router(self) -> APIRouter:
        router = APIRouter(prefix=PREFIX, include_in_schema=False)

        @router.get("")
        @router.get("/")
        def home(request: Request) -> Response:
            # The landing page is the review queue; signed out, sign-in leads there.
            return _see_other(f"{PREFIX}/queue")

        @router.get("/sign-in")
        def sign_in_page(request: Request) -> Response:
            def page() -> Response:
                if self._signed_in(request) is not None:
                    return _see_other(_safe_next(request.query_params.get("next")))
                notice = "You are signed out." if request.query_params.get("signed_out") else ""
                return self.sign_in_page(request, notice=notice)

            return self.guarded(page)

        @router.post("/sign-in")
        async def sign_in(request: Request) -> Response:
            form = await request.form()
            return await run_in_threadpool(self.guarded, self.sign_in, request, form)

        @router.post("/sign-out")
        async def sign_out(request: Request) -> Response:
            form = await request.form()
            return await run_in_threadpool(self.guarded, self.sign_out, request, form)

        @router.get("/queue")
        def queue(request: Request) -> Response:
            return self.guarded(self.queue, request)

        @router.get("/overview")
        def overview(request: Request) -> Response:
            return self.guarded(self.overview, request)

        @router.get("/search")
        def search(request: Request) -> Response:
            return self.guarded(self.search, request)

        @router.get("/operations")
        def operation_by_query(request: Request) -> Response:
            # For the ids a browser would rewrite in a path ("." and "..").
            return self.guarded(self.operation, request, request.query_params.get("id", ""))

        @router.get("/operations/{operation_id:path}")
        def operation(request: Request, operation_id: str) -> Response:
            return self.guarded(self.operation, request, operation_id)

        @router.get("/groups")
        def groups(request: Request) -> Response:
            return self.groups(request)

        @router.get("/bulk")
        def bulk_page(request: Request) -> Response:
            return self.bulk_page(request)

        @router.post("/bulk")
        async def bulk_post(request: Request) -> Response:
            form = await request.form()
            return await run_in_threadpool(self.bulk_page, request, form)

        @router.get("/items/{effect_id}")
        def item(request: Request, effect_id: str) -> Response:
            return self.guarded(self.item, request, effect_id)

        @router.post("/items/{effect_id}/resolve")
        async def resolve(request: Request, effect_id: str) -> Response:
            form = await request.form()
            return await run_in_threadpool(
                self.guarded, self._resolve_text, request, effect_id, form
            )

        @router.get("/approvals")
        def approvals(request: Request) -> Response:
            return self.approvals(request, notice=request.query_params.get("notice", "")[:300])

        @router.post("/approvals/decide")
        async def decide(request: Request) -> Response:
            form = await request.form()
            return await run_in_threadpool(self.decide, request, form)

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
