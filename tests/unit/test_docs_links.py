"""The repository stands on its own: no file cites a document a contributor who clones it lacks
(the design notes and reference files the project was started from live outside it; their content
is in docs/design.md), every relative link in its markdown reaches a file of the repository, and
every section of docs/design.md that code or docs name exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

TEXT_SUFFIXES = {".py", ".md", ".toml", ".sh", ".txt", ".cfg", ".ini", ".yml", ".yaml", ".html"}
TEXT_NAMES = {"Makefile"}
SKIP_DIRS = {".git", ".venv", "runs", "build", "dist", "artifacts", "__pycache__"}

# Written so that this file does not match itself: the design notes outside the repository, and
# a path that starts at the folder named shared next to the checkout (as is, or from ../).
OUTSIDE = re.compile(r"DESIGN[.]md|(?<![\w./-])(?:\.\./)*shared[/]|/work/share[d]")

INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
DESIGN_SECTION = re.compile(r"design\.md(?:\)|'s)?,? \"([^\"]+)\"")


def repository_files() -> list[str]:
    """The repository's files, relative to its root: git's tracked and not-ignored files, or (no
    git, e.g. an unpacked source archive) every file outside the usual build and cache folders."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout.decode()
        names = [n for n in out.split("\0") if n and (ROOT / n).is_file()]
        if names:
            return sorted(set(names))
    except (OSError, subprocess.CalledProcessError):
        pass
    return sorted(
        str(p.relative_to(ROOT))
        for p in ROOT.rglob("*")
        if p.is_file()
        and not any(part in SKIP_DIRS or part.endswith(".egg-info") for part in p.parts)
    )


def text_files(files: list[str]) -> list[str]:
    return [
        f
        for f in files
        if Path(f).suffix in TEXT_SUFFIXES or Path(f).name in TEXT_NAMES or f.startswith(".ci/")
    ]


def link_targets(markdown: str) -> list[str]:
    """The link targets of a markdown text, outside code blocks and code spans."""
    prose = CODE_SPAN.sub("", FENCE.sub("", markdown))
    return INLINE_LINK.findall(prose) + REFERENCE_LINK.findall(prose)


def test_nothing_cites_a_document_outside_the_repository() -> None:
    files = text_files(repository_files())
    assert "README.md" in files and "pyproject.toml" in files  # the listing found the repository
    found = []
    for name in files:
        for number, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                found.append(f"{name}:{number}: {line.strip()}")
    assert not found, (
        "these lines cite files outside the repository; cite docs/design.md's sections or another "
        "page of docs/ instead:\n" + "\n".join(found)
    )


def test_every_relative_markdown_link_reaches_a_file_of_the_repository() -> None:
    files = repository_files()
    present = set(files)
    folders = {str(parent) for f in files for parent in Path(f).parents}
    pages = [f for f in files if f.endswith(".md")]
    assert "README.md" in pages and "docs/architecture.md" in pages
    broken, checked = [], 0
    for page in pages:
        for target in link_targets((ROOT / page).read_text()):
            if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL, or a place on the same page
            checked += 1
            path = target.split("#", 1)[0].split("?", 1)[0]
            resolved = (ROOT / page).parent / path
            try:
                relative = str(resolved.resolve().relative_to(ROOT))
            except ValueError:
                broken.append(f"{page}: {target} (outside the repository)")
                continue
            if relative not in present and relative not in folders:
                broken.append(f"{page}: {target}")
    assert checked > 50  # the links were found
    assert not broken, "links to files that are not in the repository:\n" + "\n".join(broken)


def test_the_design_sections_that_are_cited_exist() -> None:
    design = (ROOT / "docs" / "design.md").read_text()
    headings = {h.strip() for h in re.findall(r"^#+ (.+)$", design, re.M)}
    missing = []
    for name in text_files(repository_files()):
        for number, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1):
            for section in DESIGN_SECTION.findall(line):
                if section not in headings:
                    missing.append(f'{name}:{number}: "{section}"')
    assert not missing, f"docs/design.md has no such section (it has {sorted(headings)}):\n" + (
        "\n".join(missing)
    )
