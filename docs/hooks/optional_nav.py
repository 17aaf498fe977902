"""mkdocs hook: nav entries whose page does not exist (yet) are left out.

Several pages are written in parallel with the nav that names them. Listing
them here once means a page appears in the site the moment its file is merged,
and until then ``mkdocs build --strict`` is not failed by a page that is not
there. Only entries marked optional (paths listed in ``extra.optional_pages``)
are dropped: a missing page the nav needs is still an error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _prune(items: list[Any], docs: Path, optional: set[str]) -> list[Any]:
    kept: list[Any] = []
    for item in items:
        if isinstance(item, dict):
            ((title, target),) = item.items()
            if isinstance(target, list):
                children = _prune(target, docs, optional)
                if children:
                    kept.append({title: children})
                continue
            if isinstance(target, str) and target in optional and not (docs / target).exists():
                continue
        elif isinstance(item, str) and item in optional and not (docs / item).exists():
            continue
        kept.append(item)
    return kept


def on_config(config: Any) -> Any:
    optional = set(config["extra"].get("optional_pages", []))
    if config["nav"]:
        config["nav"] = _prune(config["nav"], Path(config["docs_dir"]), optional)
    return config
