"""`make demo` tells the whole story from real runs; its figures must stay true."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
def test_demo_story_runs_and_its_invariants_hold():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    for line in (
        "Committed, but response was lost",
        "After timeout: tasks=1 operations=1 outbox=1",
        "After retry: tasks=1 operations=1 outbox=1",
        "Conflict: operation id 'op-lost-reply' was already used with different arguments",
        "After the dispatcher: status=outcome_unknown reason=ambiguous_no_key_support",
        "After the lookup: status=succeeded reason=lookup_found",
        "group=awaiting_review",
        "After the decision: status=succeeded reason=operator_happened",
        "Keys minted for retries: 0",
    ):
        assert line in out, f"missing {line!r} in:\n{out}"
    assert out.count("tickets=1 status=succeeded ok") == 3
    # It ends by saying where to go next: the API, the console and who signs in, the queue.
    next_steps = out.split("== What to open next ==", 1)[1]
    for pointer in ("make run", "/v1", "/console/sign-in", "operator token", "/console/queue"):
        assert pointer in next_steps, f"missing {pointer!r} in the closing lines:\n{next_steps}"


def test_make_demo_says_what_it_installs_and_does() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    demo = makefile.split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    # The demo needs the service only, not the development tools.
    assert "$(STAMP_BASE)" in demo and "@echo" in demo
    install = makefile.split("\n$(STAMP_BASE):", 1)[1].split("\n\n", 1)[0]
    assert "about a minute" in install and "-q" not in install.replace("-q -U pip", "")
