"""The example app (examples/refunds) on sys.path, and apps built for one test."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox import db, settings
from outbox.app import App

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "refunds"
EXAMPLE_APP = "refunds_app.app:app"


@pytest.fixture
def example_path(monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(EXAMPLE))
    return EXAMPLE


@pytest.fixture
def refunds_app(example_path: Path) -> App:
    from refunds_app.app import app

    return app


@pytest.fixture
def app_db_url(db_url: str, refunds_app: App) -> Iterator[str]:
    """A database with Outbox's tables and the example app's."""
    engine = db.create_engine(settings.load(), url=db_url)
    try:
        refunds_app.upgrade(engine)
    finally:
        engine.dispose()
    yield db_url


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a stock process: this repository's example on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(EXAMPLE), os.environ.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env
