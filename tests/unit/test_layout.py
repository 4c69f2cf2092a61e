"""The package's shape stays what docs/architecture.md promises: no file in dipaco/ over 600
lines and no class over 300 (the import rules are lint-imports' job, in `make lint`)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "dipaco"


def test_no_file_over_600_lines_and_no_class_over_300() -> None:
    long_files, big_classes = [], []
    for file in sorted(PACKAGE.rglob("*.py")):
        text = file.read_text()
        name = str(file.relative_to(PACKAGE.parent))
        if text.count("\n") > 600:
            long_files.append((name, text.count("\n")))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 300:
                big_classes.append((f"{name}:{node.name}", node.end_lineno - node.lineno + 1))
    assert len(list(PACKAGE.rglob("*.py"))) > 100  # the walk found the package
    assert not long_files, f"split these files (at most 600 lines): {long_files}"
    assert not big_classes, f"split these classes (at most 300 lines): {big_classes}"


def test_every_part_says_what_it_is_for() -> None:
    """docs/design.md, "Layout": a part's __init__.py docstring says what it is for."""
    silent = [
        str(init.relative_to(PACKAGE.parent))
        for init in PACKAGE.rglob("__init__.py")
        if not ast.get_docstring(ast.parse(init.read_text()))
    ]
    assert not silent, silent
