"""docker-compose.yml describes the real deployment: every command and variable must exist.

No Docker engine runs here, so this is the check: parse the file, run each
named command with ``--help``, make sure every option it passes is accepted,
and that every OUTBOX_* variable is a real setting.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from outbox import settings

ROOT = Path(__file__).resolve().parents[2]
OUR_PROGRAMS = {"outbox", "fake-provider"}


def _compose() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return document


def _services_with_our_commands() -> list[tuple[str, list[str]]]:
    out = []
    for name, service in _compose()["services"].items():
        command = service.get("command")
        if isinstance(command, list) and command and command[0] in OUR_PROGRAMS:
            out.append((name, [str(part) for part in command]))
    return out


def test_compose_runs_the_whole_deployment():
    services = _compose()["services"]
    assert {"postgres", "migrate", "api", "reconciler", "fake-provider"} <= set(services)
    dispatchers = [s for s in services.values() if "dispatcher" in (s.get("command") or [])]
    assert len(dispatchers) == 2
    assert "service_healthy" in str(services["migrate"]["depends_on"])
    assert "healthcheck" in services["postgres"]
    for service in services.values():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{port} must bind loopback only"


@pytest.mark.parametrize(("service", "command"), _services_with_our_commands())
def test_every_command_exists_and_accepts_its_options(service, command):
    # The console scripts sit beside this interpreter (the venv), whatever PATH says.
    beside = Path(sys.executable).parent / command[0]
    program = str(beside) if beside.exists() else shutil.which(command[0])
    assert program, f"{command[0]} is not installed (service {service})"
    # Positional words up to the first option are the subcommand path.
    words: list[str] = []
    for part in command[1:]:
        if part.startswith("-"):
            break
        words.append(part)
    proc = subprocess.run(
        [program, *words, "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, (
        f"{service}: `{' '.join(command[:1] + words)} --help` failed:\n{proc.stderr}"
    )
    for option in (part for part in command[1:] if part.startswith("--")):
        assert option in proc.stdout, f"{service}: {option} is not an option of {words}"


def test_every_outbox_variable_is_a_setting():
    fields = set(settings.Settings.model_fields)
    seen = 0
    for name, service in _compose()["services"].items():
        environment = service.get("environment") or {}
        for key in environment:
            if key.startswith("OUTBOX_"):
                seen += 1
                assert key[len("OUTBOX_") :].lower() in fields, f"{name}: {key} is not a setting"
    assert seen >= 5


def test_dockerfile_copies_what_exists_and_runs_as_non_root():
    text = (ROOT / "Dockerfile").read_text()
    for line in text.splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), f"Dockerfile copies missing {source}"
    assert "USER outbox" in text
