"""The frictions of a first hour with Outbox: each one a newcomer or an operator met.

Tokens can be listed and revoked by id; the hint after ``tokens create`` says
how to use the token, ``--tenant`` included; a database that cannot be reached
and a setting that cannot be read each print one line naming what to fix, with
no traceback; ``fake-provider serve --help`` shows only true defaults.
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from fake_provider.__main__ import main as fake_provider_main
from outbox import Outbox, cli, service, settings

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def run(db_url, capsys):
    def invoke(*argv: str) -> tuple[int, str, str]:
        code = cli.main(["--database-url", db_url, *argv])
        out, err = capsys.readouterr()
        return code, out, err

    return invoke


# --- tokens ------------------------------------------------------------------------------


def test_tokens_list_shows_every_token_and_revoke_takes_its_id(run, db_url) -> None:
    run("tenants", "create", "acme")
    run("tenants", "create", "globex")
    code, out, err = run(
        "tokens", "create", "--tenant", "acme", "--role", "agent", "--label", "bot"
    )
    agent = out.strip()
    assert code == 0
    # The hint names the tenant the CLI needs: the token alone does not carry it there.
    assert "--tenant acme" in err and "outbox tokens list" in err
    run("tokens", "create", "--tenant", "globex", "--role", "operator", "--label", "alice")

    code, out, _ = run("tokens", "list")
    assert code == 0
    header, *lines = out.splitlines()
    assert header.split() == [
        "id",
        "tenant",
        "role",
        "label",
        "created_at",
        "last_used_at",
        "revoked_at",
    ]
    assert [line.split()[:4] for line in lines] == [
        ["1", "acme", "agent", "bot"],
        ["2", "globex", "operator", "alice"],
    ]
    assert agent not in out and service.hash_token(agent) not in out  # never the secret

    code, out, _ = run("tokens", "list", "--tenant", "globex", "--json")
    (only,) = __import__("json").loads(out)
    assert (only["id"], only["role"], only["last_used_at"], only["revoked_at"]) == (
        2,
        "operator",
        None,
        None,
    )

    assert run("tokens", "revoke", "1")[:2] == (0, "revoked\n")
    with Outbox(db_url) as box:
        assert box.authenticate(agent) is None
        (listed,) = box.list_tokens("acme")
        assert listed["revoked_at"] is not None
    # Twice, or an id nobody has: nothing to revoke, and the exit code says so.
    assert run("tokens", "revoke", "1")[0] == cli.EXIT_INVALID
    assert run("tokens", "revoke", "99")[0] == cli.EXIT_INVALID
    code, _, err = run("tokens", "revoke", "not-a-token")
    assert code == cli.EXIT_INVALID and "tokens list" in err


def test_a_token_records_its_last_use_at_most_once_a_minute(db_url, clock) -> None:
    with Outbox(db_url, clock=clock) as box:
        box.create_tenant("acme")
        token = box.create_token("acme", "agent")
        assert box.list_tokens()[0]["last_used_at"] is None
        assert box.authenticate(token) is not None
        first = box.list_tokens()[0]["last_used_at"]
        assert first == clock().isoformat()

        clock.advance(timedelta(seconds=30))
        assert box.authenticate(token) is not None
        assert box.list_tokens()[0]["last_used_at"] == first  # no write within the minute

        clock.advance(timedelta(seconds=31))
        assert box.authenticate(token) is not None
        assert box.list_tokens()[0]["last_used_at"] == clock().isoformat()


# --- one-line errors ---------------------------------------------------------------------


def _outbox(
    *argv: str, env: dict[str, str] | None = None, cwd: Path
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    return subprocess.run(
        [sys.executable, "-m", "outbox.cli", *argv],
        capture_output=True,
        text=True,
        env=base | (env or {}),
        cwd=cwd,
        timeout=120,
        check=False,
    )


def test_a_database_that_cannot_be_reached_is_one_line(tmp_path: Path) -> None:
    proc = _outbox(
        "--database-url", "postgresql+psycopg://nobody@127.0.0.1:1/x", "db", "upgrade", cwd=tmp_path
    )
    assert proc.returncode != 0
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("outbox: cannot use the database at postgresql+psycopg://nobody@")
    assert "Traceback" not in proc.stderr


def test_an_unreadable_database_url_is_one_line(capsys) -> None:
    assert cli.main(["--database-url", "not a url", "db", "upgrade"]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not usable" in err


def test_an_invalid_setting_is_one_line_naming_the_variable(tmp_path: Path) -> None:
    proc = _outbox("db", "upgrade", env={"OUTBOX_LEASE_DURATION": "abc"}, cwd=tmp_path)
    assert proc.returncode == cli.EXIT_INVALID
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("outbox: OUTBOX_LEASE_DURATION='abc' is invalid: expected")
    assert "90s" in proc.stderr and "pydantic" not in proc.stderr
    assert not (tmp_path / "var").exists()  # it stopped before touching anything


@pytest.mark.parametrize(
    ("variable", "value", "allowed"),
    [
        ("OUTBOX_CONCURRENCY", "0", "an integer at least 1 and at most 1024"),
        ("OUTBOX_SQLITE_SYNCHRONOUS", "OFF", "one of FULL, NORMAL"),
        ("OUTBOX_LOG_FORMAT", "xml", "one of text, json"),
        ("OUTBOX_CONSOLE_SECURE_COOKIES", "maybe", "true or false"),
        ("OUTBOX_RETRY_BUDGET_RATIO", "lots", "a number at least 0.0 and at most 100.0"),
    ],
)
def test_each_kind_of_setting_says_what_it_allows(monkeypatch, variable, value, allowed) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(settings.errors.ConfigError) as info:
        settings.load()
    assert str(info.value.detail) == f"{variable}={value!r} is invalid: expected {allowed}"


# --- fake-provider --help ------------------------------------------------------------------


def test_fake_provider_help_shows_only_true_defaults(capsys) -> None:
    with pytest.raises(SystemExit):
        fake_provider_main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: True)" not in text and "(default: False)" not in text
    assert "(default: None)" not in text and "(default: [])" not in text
    assert "(default: 9000)" in text and "(default: honour)" in text
    # --no-lookup is a switch: its help says what happens without it.
    no_lookup = text.split("--no-lookup", 2)[2].split("--lookup-lag-ms")[0]
    assert "answer 501" in no_lookup and "default" not in no_lookup
