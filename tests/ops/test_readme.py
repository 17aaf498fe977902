"""The README is a newcomer's path: it must stay true to the code it describes."""

from __future__ import annotations

import re
from pathlib import Path

from outbox import settings
from outbox.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_it_opens_with_the_commands_that_set_everything_up() -> None:
    first = "\n".join(README.splitlines()[:40])
    for command in ("make demo", "make test", "make run"):
        assert command in first, f"{command!r} is not in the README's first 40 lines"


def test_every_setting_is_in_the_configuration_table_and_nothing_else_is() -> None:
    named = set(re.findall(r"OUTBOX_[A-Z_]+[A-Z]", README))
    fields = {f"OUTBOX_{name.upper()}" for name in settings.Settings.model_fields}
    table = README.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    missing = sorted(v for v in fields if f"`{v}`" not in table)
    assert not missing, f"settings missing from the configuration table: {missing}"
    # Variables read by tests and tools, not by the service.
    others = {"OUTBOX_TEST_POSTGRES_URL", "OUTBOX_SCREENSHOTS"}
    unknown = sorted(named - fields - others)
    assert not unknown, f"the README names variables that are not settings: {unknown}"


def test_every_metric_it_names_exists() -> None:
    # Counters are module globals; the backlog gauges come from a collector
    # at scrape time. Either way the name is a literal in our source.
    source = "\n".join(
        path.read_text(encoding="utf-8")
        for package in ("outbox", "reconciler")
        for path in (ROOT / package).rglob("*.py")
    )
    named = set(re.findall(r"`(outbox_[a-z_]+)", README))
    assert {"outbox_deliveries_total", "outbox_review_queue"} <= named
    unknown = sorted(n for n in named if f'"{n}"' not in source)
    assert not unknown, f"the README names metrics nobody exports: {unknown}"


def test_every_command_it_shows_exists() -> None:
    parser = build_parser()
    commands = set(parser._subparsers._group_actions[0].choices)
    shown = set(re.findall(r"(?:^|\$ |`)outbox ([a-z][a-z-]*)", README, flags=re.MULTILINE))
    assert {"serve", "dispatcher", "reconciler", "dev", "review", "db"} <= shown
    unknown = sorted(shown - commands)
    assert not unknown, f"the README shows commands the CLI does not have: {unknown}"


def test_links_and_images_resolve() -> None:
    anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", README, flags=re.MULTILINE)}
    for target in re.findall(r"\]\(([^)\s]+)\)", README):
        if target.startswith("#"):
            assert target[1:] in anchors, f"no heading for the link {target}"
        elif not target.startswith("http"):
            assert (ROOT / target).exists(), f"the README links {target}, which does not exist"
