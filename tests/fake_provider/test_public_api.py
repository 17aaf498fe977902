"""The names other packages' tests may rely on, and the promise to import nothing of ours."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import fake_provider

PACKAGE = Path(fake_provider.__file__).parent


def test_exported_members() -> None:
    assert sorted(fake_provider.__all__) == [
        "ConfigError",
        "ConnectionDropped",
        "DropMode",
        "FaultPlan",
        "FaultSpec",
        "FaultSpecError",
        "Ledger",
        "Mode",
        "Outcome",
        "ProviderConfig",
        "RetryAfterFormat",
        "create_app",
    ]
    for name in fake_provider.__all__:
        assert getattr(fake_provider, name) is not None


def test_app_state_exposes_the_ledger_and_the_plan() -> None:
    app = fake_provider.create_app(fake_provider.ProviderConfig(seed=1))
    try:
        assert isinstance(app.state.ledger, fake_provider.Ledger)
        assert isinstance(app.state.faults, fake_provider.FaultPlan)
        assert isinstance(app.state.config, fake_provider.ProviderConfig)
        assert app.state.faults.seed == 1
    finally:
        app.state.ledger.close()


def test_imports_nothing_of_ours() -> None:
    ours = {"outbox", "adapters", "reconciler", "tests"}
    for path in PACKAGE.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] not in ours, f"{path.name} imports {name}"


def test_plain_strings_become_the_enum_members():
    from fake_provider import ConfigError, Mode, ProviderConfig

    assert ProviderConfig(mode="honour").mode is Mode.HONOUR  # type: ignore[arg-type]
    assert ProviderConfig(mode="ignore").mode is Mode.IGNORE  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="mode must be one of"):
        ProviderConfig(mode="maybe")  # type: ignore[arg-type]
