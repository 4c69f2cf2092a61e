"""A third corpus for checking quality claims: the virtual environment's installed packages.

dipaco's presets were developed on the Python standard library (``builtin``) and on
``builtin:mixed``; a fix found on one is checked on the other, and on this one, which neither was
tuned on. It is what ``make test``'s environment installs: third-party Python sources (numpy,
scipy, scikit-learn, matplotlib, torch...), C and C++ headers (torch's ``include``), package
descriptions (the ``METADATA`` of every installed distribution: Markdown and reStructuredText
prose), protocol buffer definitions and licence texts. Each file is cut into pieces of 2-4 k
characters at line breaks; document ids are ``<kind>/<package path>#<piece>``, so
``bench/routing_study.py`` reports purity by kind. Deterministic for one environment.

    python bench/sitepackages_corpus.py --out runs/site.jsonl
    python bench/outer_sweep.py --preset capacity --source runs/site.jsonl --rounds 10 ...
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

KINDS = {  # kind: (glob patterns under site-packages, character budget)
    "pysrc": (["numpy/**/*.py", "scipy/**/*.py", "sklearn/**/*.py", "matplotlib/**/*.py"], 12e6),
    "cpp": (["torch/include/**/*.h"], 12e6),
    "readme": (["*.dist-info/METADATA"], 6e6),
    "proto": (["**/*.proto"], 3e6),
    "license": (["*.dist-info/LICEN[CS]E*", "*.dist-info/licenses/*"], 3e6),
}


def pieces(text: str, lo: int = 2000, hi: int = 4000) -> list[str]:
    """Cut at line breaks into pieces of lo..hi characters (a shorter tail is dropped)."""
    out, cur = [], []
    size = 0
    for line in text.splitlines(keepends=True):
        cur.append(line[:hi])
        size += len(cur[-1])
        if size >= lo:
            out.append("".join(cur)[:hi])
            cur, size = [], 0
    return out


def build(root: Path) -> list[dict]:
    docs = []
    for kind, (patterns, budget) in KINDS.items():
        files = sorted({p for pat in patterns for p in root.glob(pat) if p.is_file()})
        # A hash order spreads the budget over packages instead of the alphabet's first ones.
        files.sort(key=lambda p: hashlib.sha256(str(p.relative_to(root)).encode()).digest())
        used = 0
        for path in files:
            if used >= budget:
                break
            text = path.read_text(encoding="utf-8", errors="replace")
            for i, piece in enumerate(pieces(text)):
                docs.append({"id": f"{kind}/{path.relative_to(root)}#{i}", "text": piece})
                used += len(piece)
    return docs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the JSON-lines file to write")
    ap.add_argument("--root", default=sysconfig.get_paths()["purelib"], help="site-packages")
    args = ap.parse_args(argv)
    docs = build(Path(args.root))
    kinds: dict[str, int] = {}
    for d in docs:
        kinds[d["id"].split("/", 1)[0]] = kinds.get(d["id"].split("/", 1)[0], 0) + 1
    with open(args.out, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d) + "\n")
    print(f"wrote {len(docs)} documents to {args.out}: {kinds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
