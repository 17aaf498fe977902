"""Loading the app: from --app or OUTBOX_APP, checked before anything runs.

Every broken app is one line on stderr naming what failed and why, exit 2,
no traceback, and nothing written (not even the database file).
"""

from __future__ import annotations

import json
import textwrap
import uuid
from pathlib import Path

import pytest

from outbox import Outbox, cli, tools
from outbox.app import App, AppError, default_app, load_app
from tests.app.conftest import EXAMPLE_APP


def write_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str) -> str:
    """A module of its own in a folder on sys.path; returns its (unique) name."""
    name = f"app_{uuid.uuid4().hex[:10]}"
    package = tmp_path / name
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent(source), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


GOOD_TOOL = """
    from pydantic import BaseModel
    from outbox.app import App
    from outbox.tools import Tool, ToolOutput

    class Args(BaseModel):
        text: str

    def handler(ctx, args):
        return ToolOutput({"ok": True})

    TOOL = Tool("note", 1, Args, handler, adapters=("helpdesk",))
"""


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_without_an_app_the_demo_is_served(monkeypatch):
    monkeypatch.delenv("OUTBOX_APP", raising=False)
    app = load_app()
    assert app.name == "demo"
    assert app.tools.names() == ["create_support_task"]
    assert app.tools.get("create_support_task").adapters == ("helpdesk",)


def test_the_example_app_loads_from_the_environment(example_path, monkeypatch):
    monkeypatch.setenv("OUTBOX_APP", EXAMPLE_APP)
    monkeypatch.delenv("OUTBOX_ADAPTERS", raising=False)
    app = load_app()
    assert app.name == "refunds"
    assert app.tools.names() == ["issue_refund", "notify_customer"]
    # Relative paths are the module's folder's, wherever the process runs.
    assert app.adapters_file == example_path / "refunds_app" / "adapters.toml"
    assert app.migrations is not None and app.migrations.is_dir()
    assert app.version_table == "alembic_version_refunds"
    registry = app.build_adapters()
    try:
        assert registry.names() == ("chat", "payments")
        assert registry.get("payments").capabilities.honours_idempotency_keys
        assert not registry.get("chat").capabilities.honours_idempotency_keys
    finally:
        registry.close()


def test_a_factory_function_may_stand_for_the_app(tmp_path, monkeypatch):
    name = write_module(
        tmp_path,
        monkeypatch,
        GOOD_TOOL + "\n    def make():\n        return App('mine', tools=[TOOL])\n",
    )
    assert load_app(f"{name}:make").tools.names() == ["note"]


def test_tools_list_shows_each_tool_with_its_version_and_adapters(example_path, capsys):
    code, out, _ = run_cli(capsys, "tools", "list", "--app", EXAMPLE_APP)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["TOOL", "VERSION", "ADAPTERS"]
    assert lines[1].split() == ["issue_refund", "1", "payments"]
    assert lines[2].split() == ["notify_customer", "1", "chat"]
    assert lines[3].startswith("app refunds: 2 tools; adapters from ")
    code, out, _ = run_cli(capsys, "--app", EXAMPLE_APP, "tools", "list", "--json")
    assert code == 0
    assert [t["name"] for t in json.loads(out)["tools"]] == ["issue_refund", "notify_customer"]


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ([], ["--database-url", "URL", "--app", "APP"]),
        (["--database-url", "URL", "--app", "APP"], []),
    ],
    ids=["after", "before"],
)
def test_app_and_database_url_go_before_or_after_the_command(
    before, after, example_path, tmp_path, capsys
):
    url = f"sqlite:///{tmp_path / 'x.db'}"

    def fill(argv):
        return [url if a == "URL" else EXAMPLE_APP if a == "APP" else a for a in argv]

    code, out, err = run_cli(capsys, *fill(before), "db", "upgrade", *fill(after))
    assert code == 0, err
    assert "app refunds: upgraded empty -> refunds_0001" in out
    assert (tmp_path / "x.db").exists()
    code, out, _ = run_cli(capsys, *fill(before), "review", "list", *fill(after))
    assert code == 0 and "nothing awaits review" in out


def test_an_option_after_the_command_wins_over_the_one_before(tmp_path, example_path, capsys):
    url = f"sqlite:///{tmp_path / 'after.db'}"
    code, _, err = run_cli(
        capsys, "--app", "no_such_pkg.app:app", "db", "upgrade", "--app", EXAMPLE_APP,
        "--database-url", url,
    )  # fmt: skip
    assert code == 0, err
    assert (tmp_path / "after.db").exists()


BROKEN = {
    "no module": ("no_such_package_xyz.app:app", "no module named 'no_such_package_xyz'"),
    "no colon": ("no_such_package_xyz.app", "expected package.module:attribute"),
    "no attribute": ("outbox.tools:no_such_app", "has no attribute 'no_such_app'"),
    "not an app": ("outbox.tools:SUPPORT_TASK", "'SUPPORT_TASK' is a Tool, not an outbox App"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_app_path_is_one_line_and_nothing_is_written(case, tmp_path, capsys):
    spec, says = BROKEN[case]
    url = f"sqlite:///{tmp_path / 'never.db'}"
    code, out, err = run_cli(capsys, "db", "upgrade", "--app", spec, "--database-url", url)
    assert code == cli.EXIT_INVALID
    assert out == ""
    assert err.count("\n") == 1 and err.startswith(f"outbox: --app={spec!r}: ")
    assert says in err and "Traceback" not in err
    assert not (tmp_path / "never.db").exists()


def test_a_module_that_fails_to_import_is_named_with_its_error(tmp_path, monkeypatch, capsys):
    name = write_module(tmp_path, monkeypatch, "raise RuntimeError('REFUNDS_KEY is not set')\n")
    monkeypatch.setenv("OUTBOX_APP", f"{name}:app")
    code, _, err = run_cli(capsys, "tools", "list")
    assert code == cli.EXIT_INVALID
    assert err == (
        f"outbox: OUTBOX_APP='{name}:app': importing '{name}' failed: "
        "RuntimeError: REFUNDS_KEY is not set\n"
    )


def test_a_tool_whose_arguments_have_no_json_schema_is_refused_at_start_up(
    tmp_path, monkeypatch, capsys
):
    source = """
        from collections.abc import Callable
        from pydantic import BaseModel
        from outbox.app import App
        from outbox.tools import Tool, ToolOutput

        class Args(BaseModel):
            callback: Callable[[], None]

        app = App("broken", tools=[Tool("hook", 1, Args, lambda ctx, a: ToolOutput({}))])
    """
    name = write_module(tmp_path, monkeypatch, source)
    url = f"sqlite:///{tmp_path / 'never.db'}"
    code, _, err = run_cli(capsys, "db", "upgrade", "--app", f"{name}:app", "--database-url", url)
    assert code == cli.EXIT_INVALID and err.count("\n") == 1
    assert "tool 'hook': its arguments model Args cannot be turned into a JSON schema" in err
    assert not (tmp_path / "never.db").exists()


def test_a_missing_migrations_folder_is_refused_at_start_up(tmp_path, monkeypatch, capsys):
    source = (
        GOOD_TOOL
        + """
    import sqlalchemy as sa
    app = App("mine", tools=[TOOL], metadata=sa.MetaData(), migrations="no_such_folder")
    """
    )
    name = write_module(tmp_path, monkeypatch, source)
    url = f"sqlite:///{tmp_path / 'never.db'}"
    code, _, err = run_cli(capsys, "db", "upgrade", "--app", f"{name}:app", "--database-url", url)
    assert code == cli.EXIT_INVALID and err.count("\n") == 1
    folder = tmp_path / name / "no_such_folder"
    assert f"app 'mine': the migrations folder '{folder}' does not exist" in err
    assert not (tmp_path / "never.db").exists()


@pytest.mark.parametrize(
    ("toml", "says"),
    [
        ("[adapters.helpdesk\n", "is not valid TOML"),
        ('[adapters.helpdesk]\nkind = "smtp"\n', "'smtp' is not one of"),
        ('[adapters.other]\nkind = "noop"\n', "tool 'note' uses adapter 'helpdesk', which is not"),
    ],
    ids=["syntax", "bad kind", "undeclared adapter"],
)
def test_a_broken_adapters_file_is_refused_at_start_up(tmp_path, monkeypatch, capsys, toml, says):
    source = GOOD_TOOL + "\n    app = App('mine', tools=[TOOL], adapters_file='adapters.toml')\n"
    name = write_module(tmp_path, monkeypatch, source)
    (tmp_path / name / "adapters.toml").write_text(toml, encoding="utf-8")
    monkeypatch.delenv("OUTBOX_ADAPTERS", raising=False)
    url = f"sqlite:///{tmp_path / 'never.db'}"
    # A process that delivers refuses it before touching the database...
    code, _, err = run_cli(
        capsys, "reconciler", "--once", "--app", f"{name}:app", "--database-url", url
    )
    assert code == cli.EXIT_INVALID and err.count("\n") == 1, err
    assert says in err
    assert not (tmp_path / "never.db").exists()
    # ...while a migration, which reaches no provider, needs none of its adapters.
    assert run_cli(capsys, "db", "upgrade", "--app", f"{name}:app", "--database-url", url)[0] == 0


def test_adapters_from_a_file_and_from_python_are_merged(tmp_path, monkeypatch):
    import adapters
    from adapters.testing import NoopAdapter

    (tmp_path / "a.toml").write_text('[adapters.helpdesk]\nkind = "noop"\n', encoding="utf-8")
    app = App(
        "mine",
        tools=tools.default_registry(),
        adapters_file="a.toml",
        adapters_factory=lambda: adapters.Registry([NoopAdapter(name="crm")]),
        root=tmp_path,
    )
    monkeypatch.delenv("OUTBOX_ADAPTERS", raising=False)
    app.check()
    with app.build_adapters() as registry:
        assert registry.names() == ("crm", "helpdesk")
    twice = App(
        "mine",
        tools=tools.default_registry(),
        adapters_file="a.toml",
        adapters_factory=lambda: adapters.Registry([NoopAdapter(name="helpdesk")]),
        root=tmp_path,
    )
    with pytest.raises(AppError, match="configured twice"):
        twice.check()


def test_an_app_name_must_fit_a_table_name():
    with pytest.raises(AppError, match="app name 'My App'"):
        App("My App", tools=[])


def test_outbox_serves_the_app_it_is_given(db_url, refunds_app):
    with Outbox(db_url, app=default_app()) as box:
        assert box.app.name == "demo" and box.tools is box.app.tools
    registry = tools.default_registry()
    with Outbox(db_url, registry=registry, check_schema=False) as box:
        assert box.tools is registry
