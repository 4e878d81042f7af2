"""docs/: the design, one benchmarks page of current figures, the sources page, and under
docs/results/ the raw results. Every relative link resolves (a file, and a heading for `#anchor`);
the benchmarks page stays a page (500 lines at most: the history is in git); every raw result is
linked from a page or read by a test or by the package, or it goes; code links the design
pages' sections that exist, or nothing; the design page is read in one sitting (400 lines)."""

from __future__ import annotations

import re
from pathlib import Path

from .helpers import ROOT

DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
PAGE_REF = re.compile(r"docs/([\w.-]+\.md)(#[\w-]+)?")
CODE_DIRS = ("streamdiff", "tools", "examples", "etc", "tests")
BENCHMARKS_MAX_LINES = 500
DESIGN_MAX_LINES = 400
# The design page and the pages it hands each part's detail to: code may link their sections.
DESIGN_PAGES = ("design.md", "models.md", "parallel.md", "placement.md", "operations.md", "api.md")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than - and _ dropped, spaces
    to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        s = slug(line.lstrip("#"))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def test_every_relative_link_in_the_pages_resolves():
    bad = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not bad, bad


def code_texts(bases=CODE_DIRS, suffix=""):
    """(file, text) of every text file under `bases` but this one."""
    for base in bases:
        for f in sorted((ROOT / base).rglob(f"*{suffix}")):
            if not f.is_file() or f == Path(__file__) or "__pycache__" in f.parts:
                continue
            try:
                yield f, f.read_text()
            except UnicodeDecodeError:
                continue


def test_the_benchmarks_page_holds_current_figures_not_a_notebook():
    lines = len((DOCS / "benchmarks.md").read_text().splitlines())
    assert lines <= BENCHMARKS_MAX_LINES, f"docs/benchmarks.md has {lines} lines, at most {BENCHMARKS_MAX_LINES}"


def test_every_raw_result_is_cited_by_a_page_or_read_by_the_code():
    """A file under docs/results/ stays while a page links it or a test or the package reads it
    (its path under docs/results/ appears in their source); the rest is history, kept by git."""
    linked = set()
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            linked.add((page.parent / target.partition("#")[0]).resolve())
    read = "\n".join(text for _, text in code_texts(("tests", "streamdiff"), ".py"))
    results = sorted(p for p in (DOCS / "results").rglob("*") if p.is_file())
    assert results, "docs/results/ is empty"
    unused = [
        str(p.relative_to(ROOT))
        for p in results
        if p.resolve() not in linked and p.relative_to(DOCS / "results").as_posix() not in read
    ]
    assert not unused, f"cited by no page and read by no code: {unused}"
    loose = [p.name for p in DOCS.iterdir() if p.is_file() and p.suffix != ".md"]
    assert not loose, f"raw results belong in docs/results/: {loose}"


def test_the_design_page_is_read_in_one_sitting():
    n = len((DOCS / "design.md").read_text().splitlines())
    assert n <= DESIGN_MAX_LINES, f"docs/design.md is {n} lines: move a part's detail to its page"


def test_the_code_links_only_design_sections_that_exist():
    """A code comment points to the design pages' section that gives the reason
    (`docs/placement.md#anchor`, an existing heading) or to nothing. Named whole, only the design
    pages and the sources page (published-models.md). Never the benchmarks page: its sections are
    figures that change."""
    design = {page: anchors(DOCS / page) for page in DESIGN_PAGES}
    bad = []
    for f, text in code_texts():
        for page, anchor in PAGE_REF.findall(text):
            if anchor and (page not in design or anchor[1:] not in design[page]):
                bad.append(f"{f.relative_to(ROOT)}: docs/{page}{anchor}")
            elif not anchor and page not in (*DESIGN_PAGES, "published-models.md"):
                bad.append(f"{f.relative_to(ROOT)}: docs/{page}")
    assert not bad, bad
