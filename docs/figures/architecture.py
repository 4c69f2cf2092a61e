"""Draws docs/architecture.png: dipaco's parts on their floors (docs/design.md, "Layout"), the
files of each, and the path of one delta. Run it again after moving files:

    .venv/bin/python docs/figures/architecture.py
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FLOORS = [  # (floor, label, parts); a part imports only from its own folder or floors below
    (5, "commands", ["cli"]),
    (4, "adapters", ["watch", "flower", "net"]),
    (3, "putting parts together", ["run"]),
    (2, "roles", ["coordinator", "peer", "prepare"]),
    (1, "shared services", ["routing", "protocols"]),
    (0.5, "settings", ["config"]),
    (0, "tensors and text", ["model", "data"]),
    (-1, "ground", ["errors", "fileio", "faults", "procs"]),
]
# The files a delta passes through, from `dipaco-peer join` to the new module version.
DELTA = [
    ("cli", "peer.py"), ("peer", "peer.py"), ("peer", "links.py"), ("peer", "modules.py"),
    ("peer", "training.py"), ("peer", "push.py"), ("protocols", "codecs"),
    ("protocols", "auth.py"), ("protocols", "hivemind"), ("coordinator", "service.py"),
    ("coordinator", "admission.py"), ("coordinator", "store.py"), ("coordinator", "rounds.py"),
    ("coordinator", "outer.py"),
]  # fmt: skip
COLOURS = {5: "#f4d6d6", 4: "#f8e5c8", 3: "#fdf3c4", 2: "#d9ecd0", 1: "#d3e4f2", 0.5: "#e6e0f3",
           0: "#e9e9e9", -1: "#f5f5f5"}  # fmt: skip


def files_of(part: str) -> list[str]:
    folder = ROOT / "dipaco" / part
    if not folder.is_dir():
        return []
    names = [p.name for p in folder.iterdir() if p.suffix == ".py" and p.name != "__init__.py"]
    names += [p.name for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    return sorted(names)


def layout() -> list[tuple[float, str, list[str], float, float]]:
    """Each floor with its height (room for its parts' file lists) and its bottom, top first."""
    rows, y = [], 0.0
    for floor, label, parts in reversed(FLOORS):
        width = 12.2 / len(parts)
        per_line = max(1, int((width - 0.3) / 1.45))
        lines = max((-(-len(files_of(p)) // per_line) for p in parts), default=0)
        height = 0.65 + 0.2 * lines
        rows.append((floor, label, parts, y, height))
        y += height + 0.15
    return list(reversed(rows))


def main() -> None:
    rows = layout()
    top = rows[0][3] + rows[0][4]
    fig, ax = plt.subplots(figsize=(15, 1.0 + top * 0.95))
    ax.set_xlim(0, 15)
    ax.set_ylim(-0.1, top + 0.4)
    ax.axis("off")
    centres: dict[tuple[str, str], tuple[float, float]] = {}
    for floor, label, parts, y, height in rows:
        ax.add_patch(FancyBboxPatch((0.05, y), 14.9, height, boxstyle="round,pad=0.02",
                                    fc=COLOURS[floor], ec="#999999", lw=0.8))  # fmt: skip
        ax.text(0.2, y + height - 0.25, f"floor {floor:g}", fontsize=10, weight="bold",
                color="#555555")  # fmt: skip
        ax.text(0.2, y + height - 0.47, label, fontsize=8, color="#555555")
        width = 12.2 / len(parts)
        per_line = max(1, int((width - 0.3) / 1.45))
        for i, part in enumerate(parts):
            x = 2.6 + i * width
            ax.add_patch(FancyBboxPatch((x, y + 0.06), width - 0.2, height - 0.12,
                                        boxstyle="round,pad=0.02", fc="white", ec="#666666"))  # fmt: skip
            is_file = not (ROOT / "dipaco" / part).is_dir()
            ax.text(x + 0.1, y + height - 0.3, f"{part}{'.py' if is_file else '/'}",
                    fontsize=11, weight="bold")  # fmt: skip
            for j, name in enumerate(files_of(part)):
                fx = x + 0.1 + (j % per_line) * 1.45
                fy = y + height - 0.55 - (j // per_line) * 0.2
                on_path = (part, name) in DELTA
                ax.text(fx, fy, name, fontsize=7.2, color="#b22222" if on_path else "#333333",
                        weight="bold" if on_path else "normal")  # fmt: skip
                centres[(part, name)] = (fx + 0.45, fy + 0.05)
    points = [centres[k] for k in DELTA if k in centres]
    for a, b in zip(points, points[1:], strict=False):
        ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=8, color="#b22222",
                                     alpha=0.55, lw=1.0, connectionstyle="arc3,rad=0.15"))  # fmt: skip
    ax.text(14.9, top + 0.2,
            "imports go down only (import-linter, make lint); red: one delta's way, "
            "dipaco-peer join to the new module version",
            ha="right", fontsize=9, color="#b22222")  # fmt: skip
    out = ROOT / "docs" / "architecture.png"
    fig.savefig(out, dpi=110, bbox_inches="tight")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
