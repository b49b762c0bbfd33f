"""The README and docs/: the README stays a user's page (short, the two commands first, every
problem type and option listed), and no page points at a document the repository lacks."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from idem_middleware import IdempotencyMiddleware, Policy
from idem_middleware.errors import ProblemKind

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def section(heading: str) -> str:
    text = README.read_text()
    return re.split(r"\n## ", text.split(f"\n## {heading}\n", 1)[1], maxsplit=1)[0]


def test_the_readme_is_short() -> None:
    assert len(README.read_text().splitlines()) < 300


def test_the_readme_says_how_it_scales_and_what_was_tested() -> None:
    """Several processes, PgBouncer, a table by tenant and conflicts, each with what was tested
    (the section had moved to docs/scaling.md alone)."""
    scaling = section("Scaling")
    for fact in ("Processes", "PgBouncer", "statement_cache_size=0", "tenant", "40001", "40P01"):
        assert fact in scaling, fact
    assert scaling.count("tested") >= 3
    assert "(docs/scaling.md)" in scaling


def test_the_readme_opens_with_the_command_ci_runs() -> None:
    text = README.read_text()
    blocks = re.findall(r"```sh\n(.*?)```", text, re.DOTALL)
    ci = (ROOT / ".ci" / "run").read_text()
    # The second command, exactly as a newcomer pastes it, is the one CI runs.
    assert blocks[1].strip() in ci.splitlines()
    assert blocks[0].strip().endswith("python -m example_app")
    assert text.index(blocks[1]) < text.index("\n## ")


def test_every_problem_type_is_in_what_a_request_gets() -> None:
    text = section("What a request gets")
    missing = [kind.value for kind in ProblemKind if f"`{kind.value}`" not in text]
    assert not missing


def test_every_option_is_in_the_configuration_tables() -> None:
    text = section("Configuration")
    options = [f.name for f in dataclasses.fields(Policy)]
    options += [
        name
        for name in inspect.signature(IdempotencyMiddleware.__init__).parameters
        if name not in ("self", "app")
    ]
    missing = [name for name in options if f"| `{name}` |" not in text]
    assert not missing


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_cites_a_document_outside_the_repository(page: Path) -> None:
    text = page.read_text()
    assert "PROTOCOL" not in text  # the protocol is docs/protocol.md, in this project's words
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken


def test_the_docs_index_lists_every_page() -> None:
    index = (DOCS / "README.md").read_text()
    missing = [
        p.name for p in DOCS.glob("*.md") if p.name != "README.md" and f"({p.name})" not in index
    ]
    assert not missing


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#+ (.*)$", text, re.MULTILINE):
        slug = _slug(heading)
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_links_anchor_is_a_heading_of_its_page(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    broken = []
    for target in LINK.findall(text):
        path, _, anchor = target.partition("#")
        if not anchor or re.match(r"[a-z]+:", target):
            continue
        linked = (page.parent / path) if path else page
        if linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(target)
    assert not broken


#: `test_x.py::test_name`, and a following `::test_other` of the same file.
_CITED_TEST = re.compile(r"(?:(test_\w+)\.py)?::(test_\w+)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_test_exists(page: Path) -> None:
    """A page that names a test as its evidence names one that is there (a renamed test left
    docs/protocol.md citing one that was not)."""
    missing = []
    for line in page.read_text().splitlines():
        module = None
        for match in _CITED_TEST.finditer(line):
            module = match.group(1) or module
            files = list((ROOT / "tests").rglob(f"{module}.py")) if module else []
            if not files or f"def {match.group(2)}(" not in files[0].read_text():
                missing.append(f"{module}.py::{match.group(2)}")
    assert not missing
