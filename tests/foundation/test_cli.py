"""The CLI: the same create path, with exit codes a script can act on."""

from __future__ import annotations

import json

import pytest

from outbox import cli


@pytest.fixture
def run(db_url, capsys):
    def invoke(*argv: str) -> tuple[int, str, str]:
        code = cli.main(["--database-url", db_url, *argv])
        out, err = capsys.readouterr()
        return code, out, err

    return invoke


def test_create_replay_conflict_invalid_and_show(run):
    assert run("tenants", "create", "acme")[0] == 0
    code, out, _ = run(
        "tasks", "create", "--tenant", "acme", "--operation-id", "k1", "--subject", "Late"
    )
    assert code == cli.EXIT_OK
    receipt = json.loads(out)
    assert receipt == {"operation_id": "k1", "status": "created", "task_id": 1}

    code, out2, err = run(
        "tasks", "create", "--tenant", "acme", "--operation-id", "k1", "--subject", "Late"
    )
    assert code == cli.EXIT_OK and out2 == out and "replayed" in err

    code, _, err = run(
        "tasks", "create", "--tenant", "acme", "--operation-id", "k1", "--subject", "Other"
    )
    assert code == cli.EXIT_CONFLICT and json.loads(err)["retry"] == "never"

    code, _, err = run(
        "tasks", "create", "--tenant", "acme", "--operation-id", "k2", "--subject", ""
    )
    assert code == cli.EXIT_INVALID and json.loads(err)["errors"][0]["field"] == "subject"

    code, out, _ = run("operations", "show", "--tenant", "acme", "k1")
    assert code == 0 and json.loads(out)["effects"][0]["status"] == "pending"
    code, out, _ = run("tasks", "show", "--tenant", "acme", "1")
    assert code == 0 and json.loads(out)["subject"] == "Late"


def test_tokens_are_printed_once_and_hashed(run, db_url):
    run("tenants", "create", "acme")
    code, out, err = run("tokens", "create", "--tenant", "acme", "--role", "agent")
    token = out.strip()
    assert code == 0 and token.startswith("obx_") and "only its SHA-256" in err
    from outbox import Outbox

    with Outbox(db_url) as box:
        principal = box.authenticate(token)
        assert principal is not None and principal.tenant == "acme"
        assert box.authenticate(token + "x") is None
    assert run("tokens", "revoke", token)[0] == 0
    with Outbox(db_url) as box:
        assert box.authenticate(token) is None
    assert run("tokens", "create", "--tenant", "nobody", "--role", "agent")[0] == cli.EXIT_INVALID


def test_expired_and_busy_exit_codes():
    from outbox import errors

    assert cli.exit_code(errors.OperationExpired("t", "k", same_arguments=True)) == 4
    assert cli.exit_code(errors.Busy()) == 5


def test_commands_refuse_an_unmigrated_database(tmp_path, capsys):
    code = cli.main(["--database-url", f"sqlite:///{tmp_path / 'x.db'}", "tenants", "create", "a"])
    assert code == cli.EXIT_ERROR
    assert "outbox db upgrade" in capsys.readouterr().err


def test_db_upgrade_twice(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'x.db'}"
    assert cli.main(["--database-url", url, "db", "upgrade"]) == 0
    assert "upgraded empty -> " in capsys.readouterr().out
    assert cli.main(["--database-url", url, "db", "upgrade"]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert cli.main(["--database-url", url, "db", "current"]) == 0


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    for command in ("db", "tenants", "tokens", "tasks", "operations", "serve", "dispatcher"):
        assert command in out
