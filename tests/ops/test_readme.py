"""The README and the docs are a newcomer's path: they must stay true to the code.

The README is the front page (what it is, the two commands, the picture, what
is and is not promised, links); everything else is the site under docs/,
which ``make test`` also builds with ``mkdocs build --strict`` (broken links
and anchors, pages left out of the nav). These tests hold both to the code:
every setting, metric, command and make target they name exists.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from outbox import settings
from outbox.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
DOCS = {
    path.relative_to(ROOT).as_posix(): path.read_text(encoding="utf-8")
    for path in sorted((ROOT / "docs").glob("*.md"))
}
EVERYTHING = {"README.md": README, **DOCS}
README_MAX_LINES = 300


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _section(text: str, heading: str) -> str:
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


# --- the front page -----------------------------------------------------------------------


def test_the_readme_is_a_front_page() -> None:
    assert len(README.splitlines()) <= README_MAX_LINES


def test_it_opens_with_the_commands_that_set_everything_up() -> None:
    first = "\n".join(README.splitlines()[:40])
    for command in ("make demo", "make test", "make run"):
        assert command in first, f"{command!r} is not in the README's first 40 lines"


def test_it_draws_the_picture_and_says_what_is_and_is_not_promised() -> None:
    assert "one database transaction" in README.lower()
    picture = _section(README, "The picture")
    assert "dispatcher" in picture and "reconciler" in picture and "outcome_unknown" in picture
    promised = _section(README, "What is promised")
    not_promised = _section(README, "What is not promised")
    assert "exactly once" not in promised.lower()
    assert not_promised.lstrip().startswith("- **Exactly once.**")
    # Nowhere is "exactly once" claimed: each mention is in what is not promised.
    for name, text in EVERYTHING.items():
        for match in re.finditer(r"exactly[ -]once", text, flags=re.IGNORECASE):
            around = text[max(0, match.start() - 200) : match.end() + 200].lower()
            assert any(word in around for word in ("not promised", "never", "nobody")), (
                f"{name} mentions exactly once without denying it: ...{around}..."
            )


def test_it_links_the_docs_pages_that_exist() -> None:
    for page in ("getting-started", "guarantees", "architecture", "configuration", "runbook"):
        assert f"(docs/{page}.md)" in README, f"the README does not link docs/{page}.md"


def test_links_and_images_resolve() -> None:
    checks = [("README.md", README, ROOT)] + [
        (name, text, (ROOT / name).parent) for name, text in DOCS.items()
    ]
    for name, text, base in checks:
        anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)}
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith("#"):
                assert target[1:] in anchors, f"{name}: no heading for the link {target}"
            elif not target.startswith("http"):
                path = target.split("#", 1)[0]
                assert (base / path).exists(), f"{name} links {target}, which does not exist"


# --- the docs, held to the code --------------------------------------------------------------


def test_every_setting_is_in_the_configuration_table_and_nothing_else_is() -> None:
    fields = {f"OUTBOX_{name.upper()}" for name in settings.Settings.model_fields}
    table = DOCS["docs/configuration.md"]
    missing = sorted(v for v in fields if f"`{v}`" not in table)
    assert not missing, f"settings missing from docs/configuration.md: {missing}"
    # Read by the processes outside Settings (before settings load, or per transport):
    # each must be read somewhere in our source and be in the table too.
    outside = {"OUTBOX_APP", "OUTBOX_TOKEN"}
    source = "\n".join(
        path.read_text(encoding="utf-8")
        for package in ("outbox", "reconciler")
        for path in (ROOT / package).rglob("*.py")
    )
    for name in sorted(outside):
        assert f'"{name}"' in source, f"{name} is documented but nothing reads it"
        assert f"`{name}`" in table, f"{name} is missing from docs/configuration.md"
    # Variables read by tests and tools, not by the service.
    others = {"OUTBOX_TEST_POSTGRES_URL", "OUTBOX_SCREENSHOTS"} | outside
    for name, text in EVERYTHING.items():
        named = set(re.findall(r"OUTBOX_[A-Z_]+[A-Z]", text))
        unknown = sorted(named - fields - others)
        assert not unknown, f"{name} names variables that are not settings: {unknown}"


def test_every_metric_they_name_exists() -> None:
    # Counters are module globals; the backlog gauges come from a collector
    # at scrape time. Either way the name is a literal in our source.
    source = "\n".join(
        path.read_text(encoding="utf-8")
        for package in ("outbox", "reconciler")
        for path in (ROOT / package).rglob("*.py")
    )
    named = {
        m
        for text in EVERYTHING.values()
        for m in re.findall(r"`(outbox_[a-z_]*[a-z])(?![a-z_*])", text)
    }
    assert {"outbox_deliveries_total", "outbox_review_queue"} <= named
    unknown = sorted(n for n in named if f'"{n}"' not in source)
    assert not unknown, f"the docs name metrics nobody exports: {unknown}"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def test_every_command_they_show_exists() -> None:
    commands = _subcommands(build_parser())
    shown: set[tuple[str, str]] = set()
    for text in EVERYTHING.values():
        shown |= set(
            re.findall(
                r"(?:^|\$ |`|\(|= )outbox ([a-z][a-z-]*)(?: ([a-z][a-z-]*))?",
                text,
                flags=re.MULTILINE,
            )
        )
    first_words = {command for command, _ in shown}
    assert {"serve", "dispatcher", "reconciler", "dev", "review", "db", "tokens"} <= first_words
    unknown = sorted(c for c in first_words if c not in commands)
    assert not unknown, f"the docs show commands the CLI does not have: {unknown}"
    # `outbox tokens list`, `outbox review resolve`: the action must exist too.
    for command, action in sorted(shown):
        actions = _subcommands(commands[command])
        if actions and action:
            assert action in actions, f"the docs show `outbox {command} {action}`, which is not"
    assert ("tokens", "list") in shown and ("tokens", "revoke") in shown


def test_every_make_target_they_name_exists() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    targets = set(re.findall(r"^([a-z][a-z-]*):", makefile, flags=re.MULTILINE))
    named = {t for text in EVERYTHING.values() for t in re.findall(r"`make ([a-z][a-z-]*)", text)}
    named |= set(re.findall(r"^make ([a-z][a-z-]*)", README, flags=re.MULTILINE))
    assert {"demo", "test", "run", "chaos-quick", "docs"} <= named
    unknown = sorted(named - targets)
    assert not unknown, f"the docs name make targets the Makefile does not have: {unknown}"


def test_every_docs_page_is_in_the_site_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    missing = [name for name in DOCS if f": {Path(name).name}" not in nav]
    assert not missing, f"pages missing from mkdocs.yml's nav: {missing}"
