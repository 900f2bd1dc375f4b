"""The docs stay true: the configuration reference is generated from the code and up to date, and
the docs' relative links point at files and headings that exist.
"""

from __future__ import annotations

import re
from pathlib import Path

from elastic_ddp.tools.config_reference import render

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"


def test_the_configuration_reference_is_up_to_date():
    assert (DOCS / "configuration.md").read_text() == render(), (
        "docs/configuration.md is stale: run `python -m elastic_ddp.tools.config_reference > docs/configuration.md`")


def test_the_configuration_reference_lists_every_flag():
    from elastic_ddp.config import build_parser

    text = render()
    flags = [action.option_strings[0] for action in build_parser()._actions if action.option_strings[0] != "-h"]
    missing = [flag for flag in flags if f"`{flag}`" not in text]
    assert not missing, missing


LINK = re.compile(r"\]\(([^)#\s]+)(?:#([^)\s]*))?\)")


def github_anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_in_the_docs_point_at_files_and_headings_that_exist():
    pages = [*DOCS.glob("*.md"), REPO / "launch" / "README.md"]
    broken = []
    for page in pages:
        for target, anchor in LINK.findall(page.read_text()):
            path = page.parent / target
            if "://" in target:
                continue
            if not path.exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
            elif anchor and anchor not in {github_anchor(line.lstrip("#")) for line in path.read_text().splitlines()
                                           if line.startswith("#")}:
                broken.append(f"{page.relative_to(REPO)} -> {target}#{anchor}")
    assert not broken, broken
