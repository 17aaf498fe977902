"""``outbox adapters check|presets``, and every process refusing a broken adapters file."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fake_provider import ProviderConfig, create_app
from outbox import cli
from tests.support.servers import serve_in_thread

SECRET = "sk_test_never_print_me_123"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("OUTBOX_"):
            monkeypatch.delenv(name)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "adapters.toml"
    path.write_text(text, encoding="utf-8")
    return path


def _detail(err: str) -> str:
    """A configuration error is one plain line on stderr: ``outbox: <detail>``."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("outbox: "), err
    return lines[0].removeprefix("outbox: ")


def test_presets_lists_the_six(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "adapters", "presets")
    assert code == 0
    listed = [line.split()[0] for line in out.splitlines() if line and not line.startswith(" ")]
    assert listed == ["stripe", "github", "slack", "sendgrid", "zendesk", "twilio"]


def test_check_helpdesk_prints_the_request_it_would_send(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(capsys, "adapters", "check", "helpdesk")
    assert (code, err) == (0, "")
    assert "POST http://127.0.0.1:9000/v1/tickets" in out
    assert "idempotency-key: sample-effect-key" in out
    body = json.loads(out.rstrip().splitlines()[-1])
    assert body["client_reference"] == "sample-effect-key"


def test_check_with_a_payload_file_and_secrets_redacted(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STRIPE_API_KEY", SECRET)
    path = write(tmp_path, '[adapters.payments]\npreset = "stripe"\n')
    payload = tmp_path / "payload.json"
    payload.write_text(json.dumps({"amount": 4200, "currency": "eur"}), encoding="utf-8")
    code, out, err = run(
        capsys, "adapters", "check", "payments", "--adapters", str(path), "--payload", str(payload)
    )
    assert (code, err) == (0, "")
    assert "POST https://api.stripe.com/v1/payment_intents" in out
    assert "authorization: Bearer ***" in out
    assert "amount=4200&currency=eur&metadata%5Boutbox_key%5D=sample-effect-key" in out
    assert "key retention: 1d" in out
    assert SECRET not in out + err


def test_a_misspelt_key_exits_non_zero_with_did_you_mean(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = write(
        tmp_path,
        '[adapters.crm]\nkind = "http"\nurl = "https://crm.test/v1"\n'
        'honours_idempotency_keys = false\nrefernce_field = "id"\n',
    )
    code, out, err = run(capsys, "adapters", "check", "crm", "--adapters", str(path))
    assert code != 0 and out == ""
    assert len(err.strip().splitlines()) == 1
    detail = _detail(err)
    assert "crm.refernce_field" in detail and "did you mean 'reference_field'" in detail


def test_a_missing_secret_is_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '[adapters.crm]\nkind = "http"\nurl = "https://crm.test/v1"\n'
        'honours_idempotency_keys = false\nauth = { type = "bearer", token = "${MISSING}" }\n',
    )
    code, _, err = run(capsys, "adapters", "check", "crm", "--adapters", str(path))
    assert code != 0
    detail = _detail(err)
    assert "crm.auth.token" in detail and "${MISSING}" in detail


def test_a_template_naming_a_field_the_sample_lacks(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = write(
        tmp_path,
        '[adapters.crm]\nkind = "http"\nurl = "https://crm.test/v1"\n'
        'honours_idempotency_keys = false\nbody = { title = "{{ payload.subject }}" }\n',
    )
    payload = tmp_path / "p.json"
    payload.write_text('{"topic": "x"}', encoding="utf-8")
    code, _, err = run(
        capsys, "adapters", "check", "crm", "--adapters", str(path), "--payload", str(payload)
    )
    assert code != 0
    detail = _detail(err)
    assert "crm.body.title" in detail and "payload.subject" in detail


def test_an_unknown_adapter_name_gets_did_you_mean(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = write(tmp_path, '[adapters.helpdesk]\nkind = "helpdesk"\n')
    code, _, err = run(capsys, "adapters", "check", "helpdsk", "--adapters", str(path))
    assert code != 0 and "did you mean 'helpdesk'" in _detail(err)


def test_live_sends_one_lookup_for_a_key_that_cannot_exist(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    app = create_app(ProviderConfig())
    with serve_in_thread(app) as base_url:
        path = write(tmp_path, f'[adapters.helpdesk]\nkind = "helpdesk"\nbase_url = "{base_url}"\n')
        code, out, _ = run(
            capsys, "adapters", "check", "helpdesk", "--adapters", str(path), "--live"
        )
    assert code == 0
    assert "not found, as expected" in out
    assert app.state.ledger.stats()["tickets"] == 0


# --- every process refuses the file at start-up, before touching the database -------------


def _env(database: Path, adapters_file: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update(
        {
            "OUTBOX_DATABASE_URL": f"sqlite:///{database}",
            "OUTBOX_ADAPTERS": str(adapters_file),
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.e2e
@pytest.mark.parametrize(
    "command",
    [["dispatcher", "--once"], ["reconciler", "--once"], ["serve", "--port", "0"]],
    ids=["dispatcher", "reconciler", "serve"],
)
def test_each_process_stops_at_start_up_on_a_broken_adapters_file(
    tmp_path: Path, command: list[str]
) -> None:
    database = tmp_path / "outbox.db"
    broken = write(
        tmp_path,
        '[adapters.helpdesk]\nkind = "helpdesk"\n'
        'auth = { type = "basic", username = "${DESK_USER}" }\n',
    )
    env = _env(database, broken)
    subprocess.run(
        [sys.executable, "-m", "outbox.cli", "db", "upgrade"],
        env=env,
        check=True,
        timeout=60,
        capture_output=True,
    )
    before = _digest(database)
    done = subprocess.run(
        [sys.executable, "-m", "outbox.cli", *command],
        env={**env, "DESK_USER": "desk"},
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "helpdesk.auth.password" in lines[0]
    assert _digest(database) == before


def test_a_broken_toml_file_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = write(tmp_path, "[adapters.crm\nkind = 'http'\n")
    code, out, err = run(capsys, "adapters", "check", "crm", "--adapters", str(path))
    assert code != 0 and out == ""
    assert len(err.strip().splitlines()) == 1
    assert "not valid TOML" in _detail(err)
