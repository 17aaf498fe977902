"""Concurrent delivery of one operation: one task, one record, one outbox row, one receipt."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from outbox import Outbox, errors
from tests.foundation.conftest import counts

TOOL = "create_support_task"
ARGS = {"subject": "Check delayed delivery"}


def test_sixteen_calls_from_eight_threads_make_one_task(box: Outbox):
    start = threading.Barrier(8)

    def call(i: int) -> str:
        if i < 8:
            start.wait(timeout=10)
        return box.execute("acme", "op-concurrent", TOOL, ARGS).receipt_json

    with ThreadPoolExecutor(max_workers=8) as pool:
        receipts = list(pool.map(call, range(16)))
    assert len(receipts) == 16 and len(set(receipts)) == 1
    assert counts(box) == {"tasks": 1, "operations": 1, "outbox": 1}


def test_concurrent_conflicting_arguments_one_wins(box: Outbox):
    start = threading.Barrier(8)

    def call(i: int) -> str:
        start.wait(timeout=10)
        try:
            box.execute("acme", "op-race", TOOL, {"subject": f"variant {i % 2}"})
            return "ok"
        except errors.IdempotencyKeyReused:
            return "conflict"

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(call, range(8)))
    assert counts(box) == {"tasks": 1, "operations": 1, "outbox": 1}
    assert results.count("ok") >= 1 and results.count("conflict") >= 1
    assert results.count("ok") + results.count("conflict") == 8


WORKER = r"""
import json, sys, threading
from outbox import Outbox
url, key = sys.argv[1], sys.argv[2]
box = Outbox(url)
start = threading.Barrier(8)
out = []
def call():
    start.wait(timeout=30)
    out.append(box.execute("acme", key, "create_support_task", {"subject": "multi"}).receipt_json)
threads = [threading.Thread(target=call) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join(60)
print(json.dumps(out))
"""


@pytest.mark.e2e
def test_four_processes_of_eight_threads_make_one_task(box: Outbox, db_url):
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, db_url, "op-multi"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    receipts: list[str] = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=90)
            assert proc.returncode == 0, stderr
            receipts += json.loads(stdout)
    finally:
        for proc in procs:
            proc.kill()
    assert len(receipts) == 32 and len(set(receipts)) == 1
    assert counts(box) == {"tasks": 1, "operations": 1, "outbox": 1}
