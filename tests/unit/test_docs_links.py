"""The docs' references resolve: every relative link and every ``docs/….md`` path named in
the docs, the README, the code, the tests and the benches points at a file the repository
holds, and every ``#anchor`` on it at one of that file's headings (as GitHub makes them).
The package docstring's map names every package of ``rollpoint``.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import rollpoint

ROOT = Path(__file__).parents[2]
PACKAGE = Path(rollpoint.__file__).parent
MARKDOWN_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
IMAGE_LINK = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
DOCS_PATH = re.compile(r"(?<![\w/.])docs/[\w./-]+\.md(?:#[\w-]+)?")
FENCE = re.compile(r"^(```|~~~)")
SEARCHED = ("src", "tests", "bench", "examples", "docs")
SEARCHED_FILES = ("README.md", "pyproject.toml", "Makefile")
SUFFIXES = {".py", ".md", ".toml", ".yaml", ".yml", ".txt", ".cfg"}


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped (hyphens
    and underscores kept), each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: Counter[str] = Counter()
    found = set()
    in_code = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        slug = _slug(line.lstrip("#"))
        found.add(slug if seen[slug] == 0 else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return frozenset(found)


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _searched_files() -> Iterator[Path]:
    for top in SEARCHED:
        for path in sorted((ROOT / top).rglob("*")):
            if path.is_file() and path.suffix in SUFFIXES and ".venv" not in path.parts:
                yield path
    for name in SEARCHED_FILES:
        if (ROOT / name).exists():
            yield ROOT / name


def _problem(target: Path, anchor: str, where: str, what: str) -> str | None:
    if not target.exists():
        return f"{where}: {what}: {target.relative_to(ROOT)} does not exist"
    if anchor and target.suffix == ".md" and anchor not in anchors(target):
        return f"{where}: {what}: no heading '#{anchor}' in {target.relative_to(ROOT)}"
    return None


def test_every_relative_link_in_the_docs_resolves() -> None:
    problems = []
    for page in _markdown_files():
        text = page.read_text(encoding="utf-8")
        for number, line in enumerate(text.splitlines(), 1):
            for link in [*MARKDOWN_LINK.findall(line), *IMAGE_LINK.findall(line)]:
                if re.match(r"^[a-z][a-z0-9+.-]*:", link):
                    continue  # http:, https:, mailto:
                file, _, anchor = link.partition("#")
                target = (page.parent / file).resolve() if file else page
                where = f"{page.relative_to(ROOT)}:{number}"
                problem = _problem(target, anchor, where, link)
                if problem:
                    problems.append(problem)
    assert not problems, "\n".join(problems)


def test_every_docs_path_named_anywhere_exists() -> None:
    problems = []
    named = 0
    for path in _searched_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            for mention in DOCS_PATH.findall(line):
                named += 1
                file, _, anchor = mention.partition("#")
                where = f"{path.relative_to(ROOT)}:{number}"
                problem = _problem(ROOT / file, anchor, where, mention)
                if problem:
                    problems.append(problem)
    assert named > 0, "the search found no docs path at all: the pattern is broken"
    assert not problems, "\n".join(problems)


def test_the_slug_is_githubs() -> None:
    # Cases taken from links the docs make, and from GitHub's rendering of these headings.
    assert _slug(" The run's event log: `run_events.jsonl`") == "the-runs-event-log-run_eventsjsonl"
    assert _slug(" Seeing a run: `rollpoint report`") == "seeing-a-run-rollpoint-report"
    assert _slug(" 6. Call order (the coordinator)") == "6-call-order-the-coordinator"
    assert _slug(" Sessions 14\u201315 (2026-12-03)") == "sessions-1415-2026-12-03"


def test_the_package_docstring_names_every_package() -> None:
    packages = sorted(
        p.parent.name for p in PACKAGE.glob("*/__init__.py") if not p.parent.name.startswith("_")
    )
    doc = rollpoint.__doc__ or ""
    missing = [name for name in packages if f"``{name}/``" not in doc]
    assert not missing, f"rollpoint's docstring map leaves out {missing}"


def test_nothing_cites_a_design_document_the_repository_does_not_hold() -> None:
    # The design is docs/design.md; a section number of an outside document ("DESIGN" and a
    # section sign) is a reference no reader of the repository can follow.
    outside = re.compile("DESIGN" + r"(?:\.md)?\s*" + "\u00a7")
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in _searched_files()
        for number, line in enumerate(
            path.read_text(encoding="utf-8", errors="replace").splitlines(), 1
        )
        if outside.search(line)
    ]
    assert not found, f"citations of an outside design document: {found}"
