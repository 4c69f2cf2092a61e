"""``builtin:mixed``: several kinds of text from the machine's own files, and shard purity."""

from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest
from _composition import format_composition, shard_composition  # bench/ (tests/conftest.py)

from dipaco.data import mixed
from dipaco.data.sources import open_source
from dipaco.errors import DataError

MAN_PAGE = r""".\" a comment
.TH FROB 1 "2024" "frob 1.0"
.SH NAME
frob \- twiddle the \fBbits\fR of a file
.SH SYNOPSIS
.B frob
[\fB\-v\fR] \fIfile\fR
.SH DESCRIPTION
.PP
Frob reads \fIfile\fR and prints \(lqfrobbed\(rq bytes.
.de XX
this macro body never shows
..
.TP
.BR \-v ", " \-\-verbose
Say more.
.SH NOTES
Frob has been twiddling bits since the early days of the project and will go on
doing so for as long as there are files with bits in them to be twiddled.
Its output is stable from one release to the next, byte for byte.
"""


def write_mo(path, pairs):
    """A minimal GNU .mo catalogue holding ``pairs`` (msgid -> msgstr), header first."""
    items = sorted({"": "Content-Type: text/plain; charset=UTF-8\n", **pairs}.items())
    ids = b"".join(k.encode() + b"\0" for k, _ in items)
    strs = b"".join(v.encode() + b"\0" for _, v in items)
    n = len(items)
    start = 28 + 16 * n
    id_table, str_table, off = b"", b"", start
    for k, _ in items:
        id_table += struct.pack("<2I", len(k.encode()), off)
        off += len(k.encode()) + 1
    for _, v in items:
        str_table += struct.pack("<2I", len(v.encode()), off)
        off += len(v.encode()) + 1
    header = struct.pack("<7I", 0x950412DE, 0, n, 28, 28 + 8 * n, 0, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header + id_table + str_table + ids + strs)


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A machine's folders in miniature: python, C headers, man pages, catalogues, licenses."""
    py = tmp_path / "py"
    (py / "pkg").mkdir(parents=True)
    for i in range(4):
        (py / "pkg" / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * 40)
    inc = tmp_path / "include"
    (inc / "sys").mkdir(parents=True)
    for i in range(4):
        (inc / "sys" / f"h{i}.h").write_text(f"#define FLAG_{i} 0x{i}\nint call_{i}(void);\n" * 30)
    (inc / "link.h").symlink_to(inc / "sys" / "h0.h")  # symlinks are skipped
    man = tmp_path / "man"
    (man / "man1").mkdir(parents=True)
    (man / "man1" / "frob.1.gz").write_bytes(gzip.compress(MAN_PAGE.encode()))
    (man / "de" / "man1").mkdir(parents=True)
    (man / "de" / "man1" / "frob.1").write_text(MAN_PAGE.replace("Say more.", "Mehr sagen."))
    (man / "man1" / "broken.1.gz").write_bytes(b"not gzip at all")  # unreadable: skipped
    locale = tmp_path / "locale"
    words = {f"message number {i}": f"le message numéro {i} du programme" for i in range(20)}
    write_mo(locale / "fr" / "LC_MESSAGES" / "frob.mo", words)
    lic = tmp_path / "licenses"
    lic.mkdir()
    (lic / "MIT").write_text("Permission is hereby granted, free of charge...\n" * 20)
    monkeypatch.setattr(mixed, "PYTHON_ROOT", py)
    monkeypatch.setattr(mixed, "C_ROOT", inc)
    monkeypatch.setattr(mixed, "MAN_ROOT", man)
    monkeypatch.setattr(mixed, "LOCALE_ROOT", locale)
    monkeypatch.setattr(mixed, "LICENSE_ROOTS", ((lic, "*"),))
    return tmp_path


def test_roff_becomes_readable_text():
    text = mixed.roff_to_text(MAN_PAGE)
    assert "NAME" in text and "frob - twiddle the bits of a file" in text
    assert "“frobbed”" in text
    assert "-v, --verbose" in text
    assert "macro body" not in text and "comment" not in text and "\\f" not in text


def test_a_catalogue_gives_its_translations_without_the_header(tmp_path):
    path = tmp_path / "x.mo"
    write_mo(path, {"file": "fichier", "read error": "erreur de lecture"})
    text = mixed.catalogue_text(path)
    assert set(text.splitlines()) == {"fichier", "erreur de lecture"}


def test_every_kind_is_read_and_the_order_is_fixed(machine):
    docs = mixed.build_mixed_corpus(budget_chars=100_000)
    kinds = {mixed.source_kind(d.doc_id) for d in docs}
    assert kinds == set(mixed.KINDS)
    ids = [d.doc_id for d in docs]
    assert len(ids) == len(set(ids))
    assert not any("link.h" in i or "broken" in i for i in ids)
    german = next(d for d in docs if d.doc_id.startswith("man-intl/de/"))
    assert "Mehr sagen." in german.text
    assert [d.doc_id for d in mixed.build_mixed_corpus(budget_chars=100_000)] == ids
    # Kinds interleave: the first few documents are not all of one kind.
    assert len({mixed.source_kind(i) for i in ids[:8]}) > 1


def test_a_budget_caps_each_kind(machine):
    docs = mixed.build_mixed_corpus(budget_chars=1_000)
    comp = mixed.mixed_composition(docs)
    # A kind stops at the first piece that reaches the budget.
    assert all(v["characters"] < 1_000 + 4_000 for v in comp.values())
    assert comp["python"]["documents"] < 4


def test_too_few_kinds_is_a_clear_error(machine, monkeypatch):
    empty = machine / "nothing"
    monkeypatch.setattr(mixed, "C_ROOT", empty)
    monkeypatch.setattr(mixed, "MAN_ROOT", empty)
    monkeypatch.setattr(mixed, "LOCALE_ROOT", empty)
    monkeypatch.setattr(mixed, "LICENSE_ROOTS", ((empty, "*"),))
    with pytest.raises(DataError, match="at least 3 kinds.*found 1 \\(python\\)"):
        mixed.build_mixed_corpus(budget_chars=100_000)


def test_this_machine_has_a_mixed_corpus():
    """The real thing, from this machine's files: what the capacity preset trains on."""
    docs = list(open_source("builtin:mixed"))
    comp = mixed.mixed_composition(docs)
    assert len(comp) >= mixed.MIN_KINDS
    assert sum(v["characters"] for v in comp.values()) > 10_000_000
    spread = mixed.mixed_corpus(max_docs=200)
    assert len(spread) == 200 and len({mixed.source_kind(d.doc_id) for d in spread}) >= 3


def test_shard_purity_counts_dominant_sources():
    ids = ["a/1", "a/2", "a/3", "b/1", "b/2", "c/1"]
    pure = shard_composition(ids, np.array([0, 0, 0, 1, 1, 2]), 3)
    assert pure["purity"] == 1.0 and pure["baseline_purity"] == 0.5
    assert pure["paths"]["1"]["dominant"] == "b"
    mixed_up = shard_composition(ids, np.array([0, 1, 0, 1, 0, 1]), 3)
    assert mixed_up["purity"] == pytest.approx(3 / 6)  # P0: 2 of a; P1: 1 each
    assert mixed_up["paths"]["2"]["documents"] == 0
    table = format_composition(mixed_up)
    assert "| P0 | 3 | 2 | 1 | 0 | a | 0.67 |" in table
    with pytest.raises(ValueError):
        shard_composition(ids, np.array([0]), 1)


def test_builtin_mixed_n_asks_for_n_million_characters_of_each_kind(machine):
    """``builtin:mixed:N``: the corpus with N million characters of each kind (larger paths need
    more tokens); a kind with less on the machine gives what it has; a bad N is a clear error."""
    mixed._full_mixed.cache_clear()
    small = list(open_source("builtin:mixed:0.002"))  # 2,000 characters of each kind
    large = list(open_source("builtin:mixed:1"))
    assert 0 < len(small) < len(large)
    per_kind = mixed.mixed_composition(small)
    assert all(v["characters"] <= 2_000 + 4_000 for v in per_kind.values())  # one piece over
    for bad in ("builtin:mixed:lots", "builtin:mixed:0", "builtin:mixed:-3"):
        with pytest.raises(DataError, match="millions of characters"):
            open_source(bad)
    mixed._full_mixed.cache_clear()
