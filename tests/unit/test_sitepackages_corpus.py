"""bench/sitepackages_corpus.py: the third corpus, built from a site-packages folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from dipaco.data.mixed import source_kind
from dipaco.data.sources import open_source

BENCH = Path(__file__).resolve().parents[2] / "bench" / "sitepackages_corpus.py"


def test_a_site_packages_folder_becomes_json_lines_that_dipaco_reads_with_kinds(tmp_path):
    root = tmp_path / "site"
    (root / "numpy" / "core").mkdir(parents=True)
    (root / "numpy" / "core" / "shape.py").write_text("x = 1  # numpy\n" * 600)  # 9 k chars
    (root / "torch" / "include").mkdir(parents=True)
    (root / "torch" / "include" / "tensor.h").write_text("int f(void);\n" * 200)  # 2.6 k
    (root / "pkg-1.0.dist-info").mkdir()
    (root / "pkg-1.0.dist-info" / "METADATA").write_text("Name: pkg\n\nA package.\n" * 150)
    (root / "pkg-1.0.dist-info" / "LICENSE").write_text("short")  # under 2 k: dropped
    out = tmp_path / "site.jsonl"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--out", str(out), "--root", str(root)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    docs = list(open_source(str(out)))
    kinds = sorted({source_kind(d.doc_id) for d in docs})
    assert kinds == ["cpp", "pysrc", "readme"]
    assert all(2000 <= len(d.text) <= 4000 for d in docs)
    # The 9 k-character source is cut at line breaks into pieces; every piece ends a line.
    numpy_docs = [d for d in docs if d.doc_id.startswith("pysrc/numpy/core/shape.py#")]
    assert len(numpy_docs) == 4 and all(d.text.endswith("\n") for d in numpy_docs)
    assert "wrote 6 documents" in proc.stdout
