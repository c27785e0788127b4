"""The README and docs/ stay true: links resolve to files and headings that exist, the source files they name exist,
the README stays a front page, and dated measurements live in docs/results/."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS, *sorted((ROOT / "docs" / "results").glob("*.md")),
         ROOT / "examples" / "third_party_backend" / "README.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")
# A source path in backticks, as the docs name files: `core/engine/llm_engine.py`, `backends/cpu/csrc/vec.h`.
SOURCE_PATH = re.compile(r"`((?:core|backends|plugins|benchmarks|tests|examples)/[\w/.\-]+\.(?:py|cpp|h))`")
DATED_HEADING = re.compile(r"^#+ .*\b20\d\d-\d\d-\d\d", re.M)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.exists(), f"{page.name}: {target} does not exist"
        if anchor:
            assert anchor in anchors(resolved), f"{page.name}: no heading #{anchor} in {resolved.name}"


@pytest.mark.parametrize("page", [p for p in PAGES if "results" not in p.parts],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_named_source_files_exist(page):
    """A page that names a source file names one that is there (files move; the docs must follow)."""
    missing = [path for path in SOURCE_PATH.findall(page.read_text()) if not (ROOT / path).exists()]
    assert not missing, f"{page.name} names files that do not exist: {missing}"


def test_the_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; depth belongs in docs/"


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_dated_measurements_live_in_docs_results(page):
    dated = DATED_HEADING.findall(page.read_text())
    assert not dated, f"{page.name} has dated sections {dated}: move them to docs/results/<date>-<machine>.md"
