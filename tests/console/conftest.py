"""Fixtures of the console's browser tests: a real Chromium, a real dropped reply.

``browser`` is one headless Chromium per session (Debian's ``chromium``, driven
by Playwright). When it is missing the tests skip, except in CI (``CI=true``),
where a missing browser is a failure.

``console`` builds, per test, what an operator meets on call: a fresh SQLite
database, a fake helpdesk that ignores idempotency keys and has no lookup, and
three tasks sent through the real dispatcher, one request at a time. The
provider commits the first and the third ticket and then drops the connection
(``drop_after_commit``); the second goes through. One pass of the reconciler's
sweeps finds that the adapter cannot look the two lost replies up and puts
them in the review queue. No SQL is written by hand. Then the API, with the
console mounted from its entry point, is served on a loopback port.

Screenshots go to the test's ``tmp_path``. With ``OUTBOX_SCREENSHOTS=<dir>``
the docs' images are also copied there (``make``-free:
``OUTBOX_SCREENSHOTS=docs/images .venv/bin/pytest tests/console``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from adapters import load_registry
from fake_provider import FaultSpec, Mode, ProviderConfig
from fake_provider import create_app as create_provider
from fake_provider.faults import Outcome as Fault
from outbox import Outbox, db, schema, settings
from outbox.api import create_app
from outbox.delivery.dispatcher import Dispatcher
from reconciler import sweeps
from tests.conftest import IN_CI
from tests.support.servers import serve_in_thread

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
LAPTOP = {"width": 1280, "height": 860}
PHONE = {"width": 390, "height": 844}
TENANT = "acme"
SCREENSHOTS_ENV = "OUTBOX_SCREENSHOTS"


@pytest.fixture(scope="package")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        message = f"{CHROMIUM} is missing: install Debian's chromium package"
        if IN_CI:
            pytest.fail(f"CI=true: the browser tests must run, but {message}")
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@dataclass
class Console:
    """One running console with its evidence, and the tokens to sign in with."""

    url: str
    box: Outbox
    provider_url: str
    alice: str  # operator
    bob: str  # operator
    agent: str
    unknown_ids: list[int]
    shots: Path
    readme_shots: Path | None = None
    contexts: list[Any] = field(default_factory=list)

    def new_page(self, browser: Any, viewport: dict[str, int] = LAPTOP) -> Any:
        context = browser.new_context(viewport=viewport, base_url=self.url)
        context.set_default_timeout(10_000)
        self.contexts.append(context)
        return context.new_page()

    def sign_in(self, page: Any, token: str, name: str) -> None:
        page.goto("/console/sign-in")
        page.get_by_label("Operator token").fill(token)
        page.get_by_label("Your name").fill(name)
        page.get_by_role("button", name="Sign in").click()
        page.wait_for_url("**/console/queue")

    def screenshot(self, page: Any, name: str, *, readme: bool = False, full: bool = True) -> Path:
        path = self.shots / f"{name}.png"
        page.screenshot(path=str(path), full_page=full)
        if readme and self.readme_shots is not None:
            self.readme_shots.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, self.readme_shots / f"{name}.png")
        return path

    def ticket_for(self, effect_key: str) -> str:
        """What an operator does on call: find the effect at the provider by its key."""
        effects = httpx.get(f"{self.provider_url}/_admin/effects", timeout=5).json()["effects"]
        (ticket,) = [e for e in effects if e["client_reference"] == effect_key]
        ticket_id: str = ticket["id"]
        return ticket_id

    def effect(self, effect_id: int) -> Any:
        with db.read(self.box.engine) as conn:
            return conn.execute(
                sa.select(schema.outbox).where(schema.outbox.c.id == effect_id)
            ).one()

    def actions(self, effect_id: int) -> list[Any]:
        ra = schema.review_actions
        with db.read(self.box.engine) as conn:
            return list(conn.execute(sa.select(ra).where(ra.c.effect_id == effect_id)).all())


def _adapters_toml(path: Path, provider_url: str) -> Path:
    path.write_text(
        "[adapters.helpdesk]\n"
        'kind = "helpdesk"\n'
        f'base_url = "{provider_url}"\n'
        "honours_idempotency_keys = false\n"
        "supports_lookup = false\n"
        "lookup_settle_seconds = 0\n"
    )
    return path


@pytest.fixture
def console(sqlite_url: str, tmp_path: Path, browser: Any) -> Iterator[Console]:
    # One request at a time, so the fault script meets the tasks in order.
    config = settings.load(database_url=sqlite_url, concurrency=1)
    provider = create_provider(
        ProviderConfig(
            mode=Mode.IGNORE,
            lookup_enabled=False,
            seed=0,
            faults=FaultSpec(script=(Fault.DROP_AFTER_COMMIT, Fault.OK, Fault.DROP_AFTER_COMMIT)),
        )
    )
    with (
        serve_in_thread(provider) as provider_url,
        Outbox(sqlite_url, config=config) as box,
        load_registry(_adapters_toml(tmp_path / "adapters.toml", provider_url), env={}) as registry,
    ):
        box.create_tenant(TENANT)
        subjects = ["Parcel 4417 arrived damaged", "Refund for order 8812", "Courier never came"]
        for n, subject in enumerate(subjects, start=1):
            result = box.execute(
                TENANT, f"op-{1000 + n}", "create_support_task", {"subject": subject}
            )
            assert result.created
        dispatcher = Dispatcher(box.engine, registry, config, worker_id="dispatcher-a")
        try:
            assert dispatcher.run_once() == 3
        finally:
            dispatcher.close()
        passes = sweeps.run_all_once(
            sweeps.build(box.engine, registry, config, worker="reconciler-a")
        )
        assert passes["run_lookups"] == 2, passes

        out = schema.outbox
        with db.read(box.engine) as conn:
            unknown_ids = list(
                conn.execute(
                    sa.select(out.c.id)
                    .where(out.c.status == "outcome_unknown", out.c.needs_review.is_(True))
                    .order_by(out.c.id)
                ).scalars()
            )
        assert len(unknown_ids) == 2

        readme = os.environ.get(SCREENSHOTS_ENV)
        shots = tmp_path / "screenshots"
        shots.mkdir()
        console = Console(
            url="",
            box=box,
            provider_url=provider_url,
            alice=box.create_token(TENANT, "operator", "alice"),
            bob=box.create_token(TENANT, "operator", "bob"),
            agent=box.create_token(TENANT, "agent", "an agent"),
            unknown_ids=unknown_ids,
            shots=shots,
            readme_shots=Path(readme) if readme else None,
        )
        with serve_in_thread(create_app(box)) as url:
            console.url = url
            try:
                yield console
            finally:
                for context in console.contexts:
                    context.close()
        provider.state.ledger.close()
