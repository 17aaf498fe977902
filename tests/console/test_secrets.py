"""A known secret, configured the way a user would, shows up nowhere.

The adapter authenticates with a bearer token and an API-key header read from
``${ENV}``; a badly behaved provider echoes the request's credentials back in
its error bodies. A dispatcher delivers, the reconciler puts the unknown
outcomes in the review queue, an operator browses the console and the API,
and the CLI prints what it knows. The secret values are in no log line, no
console page, no CLI output, no error body and no database column.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from starlette.requests import Request
from starlette.responses import JSONResponse

from adapters import load_registry
from fake_provider import Mode, ProviderConfig
from fake_provider import create_app as create_provider
from outbox import Outbox, cli, db, schema, settings
from outbox.api import create_app
from outbox.delivery.dispatcher import Dispatcher
from reconciler import sweeps
from tests.support.servers import serve_in_thread

TOKEN = "tok_live_5ecr3t_value_0123456789"
API_KEY = "key_live_an0ther_5ecr3t_9876"
SECRETS = (TOKEN, API_KEY)
TENANT = "acme"


def leaky(provider: Any) -> Any:
    """The fake provider behind a front that echoes credentials in its errors, twice."""
    echoes = {"left": 2}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] == "/v1/tickets"
            and echoes["left"] > 0
        ):
            echoes["left"] -= 1
            request = Request(scope, receive)
            response = JSONResponse(
                {
                    "error": "upstream timeout",
                    "seen_authorization": request.headers.get("authorization"),
                    "seen_key": request.headers.get("x-api-key"),
                },
                status_code=502,
            )
            await response(scope, receive, send)
            return
        await provider(scope, receive, send)

    return app


@pytest.fixture
def adapters_file(tmp_path: Path) -> Iterator[tuple[Path, Any]]:
    provider = create_provider(ProviderConfig(mode=Mode.IGNORE, lookup_enabled=False, seed=0))
    with serve_in_thread(leaky(provider)) as url:
        path = tmp_path / "adapters.toml"
        path.write_text(
            "[adapters.helpdesk]\n"
            'kind = "helpdesk"\n'
            f'base_url = "{url}"\n'
            "honours_idempotency_keys = false\n"
            "supports_lookup = false\n"
            "lookup_settle_seconds = 0\n"
            'auth = { type = "bearer", token = "${HELPDESK_TOKEN}" }\n'
            'headers = { "X-Api-Key" = "${HELPDESK_KEY}" }\n',
            encoding="utf-8",
        )
        yield path, provider
    provider.state.ledger.close()


def assert_clean(where: str, text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"{where} shows a secret"


def test_a_known_secret_appears_in_no_log_page_output_or_error(
    sqlite_url: str,
    adapters_file: tuple[Path, Any],
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path, provider = adapters_file
    env = {"HELPDESK_TOKEN": TOKEN, "HELPDESK_KEY": API_KEY}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("OUTBOX_ADAPTERS", str(path))
    monkeypatch.setenv("OUTBOX_DATABASE_URL", sqlite_url)
    caplog.set_level(logging.DEBUG)
    config = settings.load(database_url=sqlite_url, concurrency=1, console_secure_cookies=False)

    with Outbox(sqlite_url, config=config) as box, load_registry(path, env=env) as registry:
        box.create_tenant(TENANT)
        for n in range(3):
            assert box.execute(TENANT, f"op-{n}", "create_support_task", {"subject": f"s{n}"})
        dispatcher = Dispatcher(box.engine, registry, config, worker_id="d1")
        try:
            assert dispatcher.run_once() == 3
        finally:
            dispatcher.close()
        sweeps.run_all_once(sweeps.build(box.engine, registry, config, worker="r1"))

        # The provider saw the real credentials: the test would prove nothing otherwise.
        assert provider.state.ledger.stats()["tickets"] == 1
        out = schema.outbox
        with db.read(box.engine) as conn:
            errors = [
                *conn.execute(sa.select(out.c.last_error)).scalars(),
                *conn.execute(sa.select(schema.attempts.c.error)).scalars(),
            ]
            review = list(
                conn.execute(sa.select(out.c.id).where(out.c.needs_review.is_(True))).scalars()
            )
        assert len(review) == 2
        assert any(e and "seen_authorization" in e for e in errors)
        for error in errors:
            assert_clean("a stored error", error or "")

        operator = box.create_token(TENANT, "operator", "alice")
        pages: list[str] = []
        with (
            serve_in_thread(create_app(box)) as api_url,
            httpx.Client(base_url=api_url, timeout=10) as client,
        ):
            sign_in = client.get("/console/sign-in")
            csrf = re.search(r'name="csrf" value="([^"]+)"', sign_in.text)
            assert csrf is not None
            signed = client.post(
                "/console/sign-in",
                data={"csrf": csrf.group(1), "token": operator, "name": "alice", "next": ""},
                follow_redirects=True,
            )
            pages.append(signed.text)
            for url in ["/console/queue", "/console/overview"] + [
                f"/console/effects/{i}" for i in review
            ]:
                page = client.get(url)
                pages.append(page.text)
            auth = {"Authorization": f"Bearer {operator}"}
            for url in [
                "/v1/review",
                *(f"/v1/review/{i}" for i in review),
                "/v1/operations/op-0",
                "/v1/operations/op-2",
            ]:
                pages.append(client.get(url, headers=auth).text)
        assert any("seen_authorization" in p for p in pages), "the echoed error was not shown"
        for page in pages:
            assert_clean("a console page or API body", page)

    for argv in (
        ["review", "list", "--json"],
        *(["review", "show", str(i)] for i in review),
        ["adapters", "check", "helpdesk", "--live"],
        ["adapters", "check", "helpdesk", "--adapters", str(path)],
    ):
        cli.main(argv)
        out_text, err_text = capsys.readouterr()
        assert_clean(f"outbox {' '.join(argv)}", out_text + err_text)

    logged = "\n".join(
        [r.getMessage() + json.dumps(r.__dict__, default=str) for r in caplog.records]
    )
    assert "dispatcher" in logged or caplog.records
    assert_clean("a log line", logged)
