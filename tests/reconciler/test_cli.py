"""``outbox review ...`` and ``outbox reconciler``: the same queue and sweeps from a shell,
with exit codes a script can act on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import pytest

from outbox import Outbox, cli, errors, schema, states
from tests.conftest import Clock
from tests.reconciler.support import create_effect, put_unknown, row, rows, snapshot, update
from tests.support.patience import PATIENCE_S

S = states.EffectStatus


@pytest.fixture
def run(db_url: str, capsys: pytest.CaptureFixture[str]) -> Any:
    def invoke(*argv: str) -> tuple[int, str, str]:
        code = cli.main(["--database-url", db_url, *argv])
        out, err = capsys.readouterr()
        return code, out, err

    # `reconciler` configures the root logger, as a process does: the autouse
    # fixture in tests/conftest.py puts pytest's back.
    return invoke


@pytest.fixture
def effect(box: Outbox, clock: Clock) -> int:
    e = create_effect(box)
    put_unknown(box.engine, e, at=clock(), needs_review=True)
    return e


def test_review_list_show_and_resolve(run: Any, box: Outbox, effect: int) -> None:
    code, out, _ = run("review", "list")
    assert code == 0
    header, line = out.splitlines()
    assert header.split()[:3] == ["id", "group", "tenant"]
    assert line.split()[:4] == [str(effect), "awaiting_review", "acme", "helpdesk"]

    code, out, _ = run("review", "list", "--json", "--tenant", "globex")
    assert (code, json.loads(out)) == (0, [])

    code, out, _ = run("review", "show", str(effect))
    assert code == 0
    shown = json.loads(out)
    assert shown["effect_key"] == row(box.engine, effect).effect_key
    assert shown["attempts_detail"][0]["worker"] == "dispatcher-1"

    argv = ["review", "resolve", str(effect), "--happened", "--provider-ref", "T-5"]
    argv += ["--reason", "seen in the helpdesk", "--actor", "alice", "--action-id", "a-1"]
    code, out, _ = run(*argv)
    assert code == 0
    result = json.loads(out)
    # No token on the command line: the actor is the OS account, --actor only a note.
    assert (result["status_after"], result["actor_note"], result["replayed"]) == (
        "succeeded",
        "alice",
        False,
    )
    assert result["actor"].startswith("os:")
    after = snapshot(box.engine, effect)
    # The same command again (a shell retry) is a replay, not a second action.
    code, out, _ = run(*argv)
    assert (code, json.loads(out)["replayed"]) == (0, True)
    assert snapshot(box.engine, effect) == after

    code, out, _ = run("review", "list")
    assert (code, out.strip()) == (0, "nothing awaits review")


def test_resolve_not_happened_requeue_and_abandon(
    run: Any, box: Outbox, clock: Clock, effect: int
) -> None:
    key = row(box.engine, effect).effect_key
    code, _, _ = run(
        "review", "resolve", str(effect), "--not-happened", "--requeue", "--reason", "not there"
    )
    assert code == 0
    r = row(box.engine, effect)
    assert (r.status, r.effect_key) == (S.PENDING, key)
    [audit] = rows(box.engine, schema.review_actions, effect)
    assert audit.actor  # the login name (or "cli") when --actor is not given

    second = create_effect(box, "op-2")
    put_unknown(box.engine, second, at=clock())
    code, _, _ = run(
        "review", "resolve", str(second), "--not-happened", "--abandon", "--reason", "withdrawn"
    )
    assert (code, row(box.engine, second).status) == (0, S.FAILED)


def test_resolve_exit_codes_for_stale_and_invalid_actions(
    run: Any, box: Outbox, effect: int
) -> None:
    base = ("review", "resolve", str(effect))
    code, _, _ = run(*base, "--not-happened", "--abandon", "--reason", "first")
    assert code == 0
    before = snapshot(box.engine, effect)

    code, _, err = run(*base, "--not-happened", "--requeue", "--reason", "second")
    assert code == cli.EXIT_CONFLICT
    assert json.loads(err)["error"] == "review-conflict"

    code, _, err = run(*base, "--not-happened", "--reason", "which one?")
    assert code == cli.EXIT_INVALID
    code, _, err = run(*base, "--happened", "--reason", "no reference")
    assert code == cli.EXIT_INVALID
    assert json.loads(err)["errors"][0]["field"] == "provider_ref"
    code, _, err = run("review", "show", "999999")
    assert code == cli.EXIT_INVALID
    assert snapshot(box.engine, effect) == before


def test_reconciler_once_runs_every_sweep_and_says_what_it_did(
    run: Any, box: Outbox, clock: Clock
) -> None:
    late = create_effect(box)
    update(box.engine, late, deadline_at=clock() - timedelta(seconds=1))
    # The CLI runs on the real clock, long past this record's retention window:
    # once the deadline sweep has failed the effect, retention may tombstone it.
    code, out, _ = run("reconciler", "--once")
    assert code == 0
    assert out.splitlines() == [
        "expire_leases: 0",
        "enforce_deadlines: 1",
        "run_lookups: 0",
        "match_webhooks: 0",
        "apply_retention: 1",
    ]
    with pytest.raises(errors.OperationExpired):
        box.get_operation("acme", "op-1")
    code, out, _ = run("reconciler", "--once")
    assert out.split() == [
        "expire_leases:",
        "0",
        "enforce_deadlines:",
        "0",
        "run_lookups:",
        "0",
        "match_webhooks:",
        "0",
        "apply_retention:",
        "0",
    ]


def test_reconciler_once_logs_json_lines_that_carry_the_operation_id(
    db_url: str, box: Outbox, clock: Clock
) -> None:
    late = create_effect(box, operation_id="op-late")
    update(box.engine, late, deadline_at=clock() - timedelta(seconds=1))
    # A process of its own, as it runs: every line it writes must be JSON, and no
    # thread left over from another test in this interpreter can write among them.
    argv = [sys.executable, "-m", "outbox.cli", "--database-url", db_url]
    argv += ["reconciler", "--once", "--log-format", "json"]
    done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=PATIENCE_S)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stderr.splitlines() if line.strip()]
    (deadline,) = [d for d in lines if "past its deadline" in d["message"]]
    assert deadline["operation_id"] == "op-late"
    assert (deadline["tenant"], deadline["effect_id"]) == ("acme", late)
    assert deadline["sweep"] == "enforce_deadlines"


def test_reconciler_stops_cleanly_on_sigterm(sqlite_url: str) -> None:
    env = os.environ | {"OUTBOX_SWEEP_INTERVAL": "0.1", "OUTBOX_LOG_LEVEL": "INFO"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "outbox.cli", "--database-url", sqlite_url, "reconciler"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + PATIENCE_S
        seen = []
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            seen.append(line)
            if "reconciler started" in line:
                break
        assert any("reconciler started" in line for line in seen), seen
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert "reconciler stopped" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_review_bulk_dry_run_then_act_then_repeat(run: Any, box: Outbox, clock: Clock) -> None:
    ids = [create_effect(box, f"op-{i}") for i in range(3)]
    for effect_id in ids:
        put_unknown(box.engine, effect_id, at=clock(), needs_review=True)
    base = ["review", "bulk", "--tenant", "acme", "--adapter", "helpdesk", "--action", "abandon"]
    code, out, _ = run(*base, "--dry-run")
    assert code == 0 and json.loads(out)["selected"] == 3
    assert [row(box.engine, i).status for i in ids] == [S.OUTCOME_UNKNOWN] * 3
    code, out, _ = run(*base, "--reason", "never happened", "--bulk-id", "b-1")
    assert code == 0
    assert json.loads(out) | {"sample": []} == {
        "bulk_id": "b-1",
        "action": "abandon",
        "dry_run": False,
        "selected": 3,
        "applied": 3,
        "skipped": 0,
        "replayed": False,
        "sample": [],
    }
    code, out, _ = run(*base, "--reason", "never happened", "--bulk-id", "b-1")
    assert code == 0 and json.loads(out)["replayed"] is True
    assert [row(box.engine, i).status for i in ids] == [S.FAILED] * 3
    code, _, err = run(*base, "--bulk-id", "b-2")  # no reason: refused
    assert code == 2 and "reason" in err
    code, _, err = run(*base, "--older-than", "soon", "--dry-run")
    assert code == 2 and "older-than" in err


def test_groups_blocked_says_nothing_is_held_back(run: Any, box: Outbox) -> None:
    code, out, _ = run("groups", "blocked", "--tenant", "acme")
    assert (code, out.strip()) == (0, "no ordering group is held back")
    code, out, _ = run("groups", "blocked", "--json")
    assert (code, json.loads(out)) == (0, [])
