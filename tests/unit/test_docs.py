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


PROMISE_TABLE_HEADER = ("promise", "how it is kept", "the test that checks it", "its limits (not promised)")
TEST_REFERENCE = re.compile(r"`(tests/[\w/]+\.py)(?:::(\w+))?`")


def promise_rows(page: Path) -> list[list[str]]:
    """The rows of the first table under "## The promises" in `page`, each a list of its cells; [] when there
    is no such table."""
    lines = page.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "## The promises"), None)
    if start is None:
        return []
    table = []
    for line in lines[start + 1:]:
        if line.startswith("## "):
            break
        if line.startswith("|"):
            table.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif table:
            break
    if not table or tuple(table[0]) != PROMISE_TABLE_HEADER:
        return []
    return [row for row in table[2:] if len(row) == len(PROMISE_TABLE_HEADER)]


def test_every_promise_names_a_test_that_exists():
    rows = promise_rows(DOCS / "failure-semantics.md")
    assert len(rows) >= 10, ("docs/failure-semantics.md must open with the promises as a table "
                             f"| {' | '.join(PROMISE_TABLE_HEADER)} | of at least 10 rows; found {len(rows)}")
    problems = []
    for promise, _, tests, limits in rows:
        named = TEST_REFERENCE.findall(tests)
        if not named:
            problems.append(f"{promise}: names no test as `tests/...py` or `tests/...py::test_name`")
        for path, name in named + TEST_REFERENCE.findall(limits):
            file = REPO / path
            if not file.is_file():
                problems.append(f"{promise}: {path} does not exist")
            elif name and not re.search(rf"^\s*(?:async\s+)?def {re.escape(name)}\(", file.read_text(), re.MULTILINE):
                problems.append(f"{promise}: {path} has no test {name}")
    assert not problems, problems


# A number of this project's issue tracker: "issue 26", "issues 26 and 27", "#26"; not another project's
# ("pytorch/pytorch#135712", a URL's ".../issues/135712") nor an HTML entity or an anchor.
ISSUE_NUMBER = re.compile(r"\bissues?\s+#?\d+|(?<![\w/&#])#\d+\b", re.IGNORECASE)
# A commit hash: 7 to 40 hex digits with at least one digit and one letter, alone in backticks or after
# "at " or "tree " (so that port numbers, sizes and plain words are not taken for one).
HEX_WORD = r"(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}"
COMMIT_HASH = re.compile(rf"`{HEX_WORD}`|\b(?i:at|trees?)\s+`?{HEX_WORD}\b")


def user_pages() -> list[Path]:
    """What a user reads: README.md and docs/*.md, less the history file (docs/design/ holds design records)."""
    return [REPO / "README.md", *sorted(page for page in DOCS.glob("*.md") if page.name != "benchmarks-history.md")]


def test_the_history_patterns_find_history_and_only_history():
    for history in ("(issue 26)", "issues 26 and 27", "Issue 43's goals", "see #41", "tree `35fea28`",
                    "at 1e6caea", "`0c8680a`", "trees `a64edc7`"):
        assert ISSUE_NUMBER.search(history) or COMMIT_HASH.search(history), history
    for ordinary in ("port 29400", "at 127.0.0.1:29400", "pytorch/pytorch#135712", "etcd-io/etcd#14110",
                     "https://github.com/pytorch/pytorch/issues/135712", "`deadbeef`", "`1234567`",
                     "the issue is the import", "colour #a1b2c3", "at 1000000 steps", "`3e38`", "at facade"):
        assert not ISSUE_NUMBER.search(ordinary) and not COMMIT_HASH.search(ordinary), ordinary


def test_user_pages_name_no_issue_number_and_no_commit_hash():
    found = [f"{page.relative_to(REPO)}:{number}: {match.group(0)}"
             for page in user_pages()
             for number, line in enumerate(page.read_text().splitlines(), start=1)
             for pattern in (ISSUE_NUMBER, COMMIT_HASH)
             for match in pattern.finditer(line)]
    assert not found, ("user pages state what is true now; history (issue numbers, trees, commit hashes) "
                       "belongs in docs/benchmarks-history.md:\n" + "\n".join(found))
