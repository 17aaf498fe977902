"""A process that dies inside the creating transaction leaves nothing behind."""

from __future__ import annotations

import subprocess
import sys

import pytest

from outbox import Outbox
from tests.foundation.conftest import counts

DIE_INSIDE = r"""
import os, sys
from outbox import Outbox, faults
box = Outbox(sys.argv[1])
faults.arm(sys.argv[2], lambda: os._exit(9))
box.execute("acme", "op-crash", "create_support_task", {"subject": "dies mid-transaction"})
print("unreachable")
"""


@pytest.mark.e2e
@pytest.mark.parametrize(
    "window",
    ["create.after_task_insert", "create.after_operation_insert", "create.after_outbox_insert"],
)
def test_killed_inside_the_transaction_leaves_nothing(box: Outbox, db_url, window):
    proc = subprocess.run(
        [sys.executable, "-c", DIE_INSIDE, db_url, window],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 9, proc.stderr
    assert "unreachable" not in proc.stdout
    assert counts(box) == {"tasks": 0, "operations": 0, "outbox": 0}
    # The lock died with the process; the retry creates exactly once.
    assert box.execute("acme", "op-crash", "create_support_task", {"subject": "x"}).created
    assert counts(box) == {"tasks": 1, "operations": 1, "outbox": 1}
