"""docs/getting-started.md works as written: its ``sh`` blocks run, in order, in one shell.

They run in an empty directory, so the SQLite file is fresh, with the
project's commands on the PATH. The only change made to the text is the two
ports (8000 and 9000): free loopback ports take their place, so the run never
meets a server someone else started. The run is bounded by the test's timeout;
every server it starts is in its own process group, killed at the end.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from contextlib import suppress
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "getting-started.md"


def shell_blocks(text: str) -> list[str]:
    return re.findall(r"^```sh\n(.*?)^```$", text, flags=re.MULTILINE | re.DOTALL)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_the_page_has_blocks_to_run() -> None:
    blocks = shell_blocks(PAGE.read_text(encoding="utf-8"))
    script = "\n".join(blocks)
    assert len(blocks) >= 5
    for command in ("outbox db upgrade", "outbox tokens create", "outbox tasks create", "curl"):
        assert command in script


@pytest.mark.e2e
@pytest.mark.slow
def test_the_getting_started_blocks_run_as_written(tmp_path: Path) -> None:
    api_port, provider_port = free_port(), free_port()
    script = "\n".join(shell_blocks(PAGE.read_text(encoding="utf-8")))
    script = script.replace("8000", str(api_port)).replace("9000", str(provider_port))
    adapters = tmp_path / "adapters.toml"
    # The default helpdesk adapter points at port 9000: point it at ours instead.
    adapters.write_text(
        f'[adapters.helpdesk]\nkind = "helpdesk"\nbase_url = "http://127.0.0.1:{provider_port}"\n',
        encoding="utf-8",
    )
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["OUTBOX_ADAPTERS"] = str(adapters)
    env["OUTBOX_LOG_LEVEL"] = "WARNING"
    proc = subprocess.Popen(
        ["bash", "-e", "-o", "pipefail", "-c", script],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate()  # bounded by pytest's timeout
    finally:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever the script left running
    assert proc.returncode == 0, out
    assert (work / "var" / "outbox.db").exists()
    assert '"status": "succeeded"' in out, out
    assert out.count('"task_id": 1') >= 2  # the first call and its replay
    assert "idempotency-key-reused" in out  # the conflict, answered
    assert '"operation_id":"order-4712"' in out.replace(" ", ""), out
