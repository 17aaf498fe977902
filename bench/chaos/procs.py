"""The run's child processes: start from the CLI, kill -9, restart, and always reap.

Each child runs in its own session (so its process group id is its pid) with
its output in a log file of the run directory. ``kill()`` sends SIGKILL to the
whole group, as an OOM killer or a pulled plug would; ``stop()`` sends SIGTERM
and falls back to SIGKILL after a bounded wait. ``Supervisor.close()``, called
from a ``finally``, kills every group it ever started, so no child outlives
the run whatever happened in it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
READY_TIMEOUT_S = 90.0  # a busy shared machine can take that long to import and bind
STOP_GRACE_S = 5.0


def free_port() -> int:
    """An ephemeral loopback port that was free a moment ago (the child binds it again)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


class Child:
    """One named child: a command line, an environment, and its current process."""

    def __init__(
        self, name: str, argv: Sequence[str], env: Mapping[str, str], log_dir: Path
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.env = dict(env)
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.kills = 0
        self.terms = 0
        self.exits: list[int] = []  # exit codes seen for processes that ended on their own

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            log.write(f"--- start {self.starts + 1} at {time.time():.3f}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.argv,
                cwd=ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: we kill the group
            )
        self.starts += 1

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the process group: no handler runs, nothing is released."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            self.kills += 1
        _reap(proc, 10.0)

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
            self.terms += 1
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
        _reap(proc, 10.0)

    def restart_if_dead(self) -> bool:
        """Start it again if it died on its own (a crash we did not cause); True if so."""
        if self.proc is not None and self.proc.poll() is not None:
            self.exits.append(self.proc.returncode)
            self.start()
            return True
        return False

    def final_kill(self) -> None:
        """For ``finally``: the group dies, whatever state it is in."""
        proc = self.proc
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        _reap(proc, 10.0)

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def _reap(proc: subprocess.Popen[bytes], timeout: float) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout)


class Supervisor:
    """Every child of one phase. Thread-safe: the chaos thread kills while the main waits."""

    def __init__(self, log_dir: Path, base_env: Mapping[str, str]) -> None:
        self.log_dir = log_dir
        self.base_env = dict(base_env)
        self.children: dict[str, Child] = {}
        self.lock = threading.Lock()

    def add(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None) -> Child:
        merged = {**self.base_env, **(env or {})}
        child = Child(name, argv, merged, self.log_dir)
        with self.lock:
            self.children[name] = child
        child.start()
        return child

    def named(self, prefix: str) -> list[Child]:
        with self.lock:
            return [c for n, c in self.children.items() if n.startswith(prefix)]

    def close(self) -> None:
        with self.lock:
            children = list(self.children.values())
        for child in children:
            child.final_kill()


def wait_http(url: str, timeout: float = READY_TIMEOUT_S, child: Child | None = None) -> None:
    """Poll ``url`` until it answers 200; fail early if ``child`` died meanwhile."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if child is not None and child.proc is not None and child.proc.poll() is not None:
            raise RuntimeError(
                f"{child.name} exited with {child.proc.returncode} before it was ready:\n"
                + child.log_tail()
            )
        try:
            response = httpx.get(url, timeout=1.0)
            if response.status_code == 200:
                return
            last = f"HTTP {response.status_code}"
        except httpx.HTTPError as exc:
            last = type(exc).__name__
        time.sleep(0.05)
    tail = child.log_tail() if child is not None else ""
    raise RuntimeError(f"{url} not ready after {timeout:.0f}s ({last})\n{tail}")
