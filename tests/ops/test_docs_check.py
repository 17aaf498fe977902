"""``make docs-check`` fails on what ``mkdocs build --strict`` warns of.

It runs the Makefile's own target on a two-page site: with a link to an anchor
the other page does not have it must fail and name the link; with the anchor
there it must pass. (With ``--quiet`` beside ``--strict``, mkdocs drops the
warnings before counting them and the broken site built with exit status 0.)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(sys.executable).parent.parent


def _site(tmp_path: Path, anchor: str) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "mkdocs.yml").write_text(
        "site_name: check\n"
        "nav: [index.md, other.md]\n"
        "validation:\n  links:\n    not_found: warn\n    anchors: warn\n",
        encoding="utf-8",
    )
    (tmp_path / "docs" / "index.md").write_text(
        f"# Home\n\nSee [the part](other.md#{anchor}).\n", encoding="utf-8"
    )
    (tmp_path / "docs" / "other.md").write_text(
        "# Other\n\n## The part\n\nText.\n", encoding="utf-8"
    )
    return tmp_path


def _docs_check(site: Path) -> subprocess.CompletedProcess[str]:
    if not (VENV / "bin" / "mkdocs").exists():
        pytest.fail(f"mkdocs is not installed in {VENV}: run `make venv`")
    # -o: the venv is installed already; do not remake its stamp from here.
    keep = ["-o", str(VENV / ".installed")]
    return subprocess.run(
        ["make", "-s", "-f", str(ROOT / "Makefile"), *keep, f"VENV={VENV}", "docs-check"],
        check=False,
        cwd=site,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_link_to_a_missing_anchor_fails_the_check(tmp_path: Path) -> None:
    result = _docs_check(_site(tmp_path, "no-such-part"))
    assert result.returncode != 0, result.stdout + result.stderr
    assert "other.md#no-such-part" in result.stdout + result.stderr


def test_the_same_site_with_the_anchor_passes_and_prints_no_info_lines(tmp_path: Path) -> None:
    result = _docs_check(_site(tmp_path, "the-part"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "INFO" not in result.stdout + result.stderr
