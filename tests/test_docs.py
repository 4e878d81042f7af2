"""docs/: the design, one benchmarks page, the sources page, and under docs/results/ the raw results
the pages cite. Every relative link resolves (a file, and a heading for `#anchor`); every raw result
is linked from a page, or it goes; a code comment that tells a measurement links the benchmarks
page's section (`docs/benchmarks.md#anchor`), and that anchor exists."""

from __future__ import annotations

import re
from pathlib import Path

from .helpers import ROOT

DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE_REF = re.compile(r"docs/(\w[\w.-]*\.md)#([\w-]+)")


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


def test_every_raw_result_is_cited_by_a_page():
    linked = set()
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            linked.add((page.parent / target.partition("#")[0]).resolve())
    results = {p.resolve() for p in (DOCS / "results").rglob("*") if p.is_file()}
    assert results, "docs/results/ is empty"
    assert not sorted(str(p.relative_to(ROOT)) for p in results - linked)
    loose = [p.name for p in DOCS.iterdir() if p.is_file() and p.suffix != ".md"]
    assert not loose, f"raw results belong in docs/results/: {loose}"


def test_links_from_the_code_to_the_pages_name_existing_sections():
    bad = []
    for base in ("streamdiff", "tools", "examples", "etc", "tests"):
        for f in (ROOT / base).rglob("*"):
            if not f.is_file() or f == Path(__file__) or "__pycache__" in f.parts:
                continue
            try:
                text = f.read_text()
            except UnicodeDecodeError:
                continue
            for page, anchor in CODE_REF.findall(text):
                if not (DOCS / page).exists() or anchor not in anchors(DOCS / page):
                    bad.append(f"{f.relative_to(ROOT)}: docs/{page}#{anchor}")
    assert not bad, bad
