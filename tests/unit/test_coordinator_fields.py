"""The coordinator's parts own their fields (docs/architecture.md, "Where the coordinator is
going"): every field of every class in dipaco/coordinator is created in that class's
``__init__`` (or declared on the class), and no code reads or writes a coordinator's field by a
name in a string (``getattr(core, "x")``), which the type checker in ``make lint`` cannot see.
Read from the source, so a new method that creates a field, or a getattr, fails here."""

from __future__ import annotations

import ast
from pathlib import Path

PART = Path(__file__).resolve().parents[2] / "dipaco" / "coordinator"


def _self_stores(node: ast.AST) -> list[tuple[int, str]]:
    return [
        (n.lineno, n.attr)
        for n in ast.walk(node)
        if isinstance(n, ast.Attribute)
        and isinstance(n.ctx, ast.Store)
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
    ]


def _created(cls: ast.ClassDef) -> set[str]:
    names = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}  # type: ignore[union-attr]
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name in ("__init__", "__post_init__"):
            names |= {attr for _, attr in _self_stores(node)}
    return names


def test_every_field_of_a_coordinator_part_is_created_in_its_init():
    late = []
    for path in sorted(PART.glob("*.py")):
        tree = ast.parse(path.read_text())
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            created = _created(cls)
            for fn in cls.body:
                if not isinstance(fn, ast.FunctionDef) or fn.name in ("__init__", "__post_init__"):
                    continue
                late += [
                    f"{path.name}:{line} {cls.name}.{fn.name} creates self.{attr}"
                    for line, attr in _self_stores(fn)
                    if attr not in created
                ]
    assert late == []


def test_no_field_is_reached_by_a_name_in_a_string():
    found = []
    for path in sorted(PART.glob("*.py")):
        for n in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Name)
                and n.func.id in ("getattr", "setattr", "hasattr", "delattr")
                and n.args
                and isinstance(n.args[0], ast.Name)
                and n.args[0].id in ("self", "core", "co", "coordinator")
            ):
                found.append(f"{path.name}:{n.lineno} {n.func.id}({n.args[0].id}, ...)")
    assert found == []
