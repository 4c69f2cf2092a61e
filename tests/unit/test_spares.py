"""Recycled files (fileio.Spares): a writer of many small files renames an emptied old file
next to the one it writes instead of creating one, and keeps the file it replaces instead of
deleting it. On ext4 without a journal, creating a file costs in proportion to the files
deleted in the last minutes (bench/soak.py under perf); what a user would notice here is only
that every write still lands whole, readers are never cut short, and files stop being created.
"""

from __future__ import annotations

import os

from dipaco.fileio import Spares, exchange, write_atomic


def test_a_replaced_file_is_kept_and_written_again_instead_of_a_new_one(tmp_path):
    spares = Spares(tmp_path / ".spare", max_bytes=1 << 20, age=0.0)
    target = tmp_path / "state.json"
    write_atomic(target, b"one", spares=spares)
    first = os.stat(target).st_ino
    write_atomic(target, b"two", spares=spares)
    assert target.read_bytes() == b"two"
    assert len(spares) == 1  # the file that held "one", kept rather than deleted
    write_atomic(target, b"three", spares=spares)
    assert target.read_bytes() == b"three"
    assert spares.reused == 1 and os.stat(target).st_ino == first  # no file created
    assert sorted(p.name for p in tmp_path.iterdir()) == [".spare", "state.json"]


def test_a_reader_of_a_replaced_file_reads_it_whole(tmp_path):
    spares = Spares(tmp_path / ".spare", max_bytes=1 << 20, age=0.0)
    target = tmp_path / "coordinator.json"
    write_atomic(target, b"old" * 1000, spares=spares)
    with open(target, "rb") as reader:
        write_atomic(target, b"new", spares=spares)  # the old file is now a spare
        assert reader.read() == b"old" * 1000
    assert target.read_bytes() == b"new"


def test_a_spare_waits_its_age_before_it_is_written_again(tmp_path):
    spares = Spares(tmp_path / ".spare", max_bytes=1 << 20, age=60.0)
    target = tmp_path / "f"
    for text in (b"a", b"b", b"c"):
        write_atomic(target, text, spares=spares)
    assert target.read_bytes() == b"c" and spares.reused == 0 and len(spares) == 2


def test_large_files_and_a_full_folder_are_deleted_as_before(tmp_path):
    spares = Spares(tmp_path / ".spare", max_bytes=10, keep=1, age=0.0)
    big, small, more = tmp_path / "big", tmp_path / "small", tmp_path / "more"
    folder = tmp_path / "a-folder"
    big.write_bytes(b"x" * 10)  # may be mapped by a reader: never emptied under it
    small.write_bytes(b"x")
    more.write_bytes(b"y")
    folder.mkdir()
    for f in (big, small, more):
        spares.give(f)
    spares.give(folder)  # not a file: never a spare (removing it is the caller's business)
    assert not big.exists() and not small.exists() and not more.exists() and folder.is_dir()
    assert len(spares) == 1 and len(list((tmp_path / ".spare").iterdir())) == 1
    spares.give(tmp_path / "never-existed")  # nothing to keep: no error


def test_a_folder_given_back_is_kept_file_by_file_and_removed(tmp_path):
    spares = Spares(tmp_path / ".spare", max_bytes=1 << 20, age=0.0)
    folder = tmp_path / "deltas" / "v3"
    (folder / "sub").mkdir(parents=True)
    for i in range(3):
        (folder / f"P{i}.dpt").write_bytes(b"d" * 100)
    spares.give_folder(folder)
    assert not folder.exists() and len(spares) == 3
    write_atomic(tmp_path / "new.dpt", b"fresh", spares=spares)
    assert (tmp_path / "new.dpt").read_bytes() == b"fresh" and spares.reused == 1


def test_spares_left_by_an_earlier_process_are_used_again(tmp_path):
    first = Spares(tmp_path / ".spare", max_bytes=1 << 20, age=60.0)
    for i in range(2):
        (tmp_path / f"f{i}").write_bytes(b"secret" * 10)
        first.give(tmp_path / f"f{i}")
    (tmp_path / ".spare" / "a-folder").mkdir()  # not a file: left alone
    again = Spares(tmp_path / ".spare", max_bytes=1 << 20, age=60.0)  # a restart
    assert len(again) == 2 and (tmp_path / ".spare" / "a-folder").is_dir()
    write_atomic(tmp_path / "x", b"new", spares=again)  # in one of them, emptied first
    assert (tmp_path / "x").read_bytes() == b"new" and again.reused == 1


def test_exchange_swaps_two_files_and_declines_when_one_is_missing(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"A")
    assert exchange(a, b) is False and a.read_bytes() == b"A"  # b missing: nothing changed
    b.write_bytes(b"B")
    if exchange(a, b):  # Linux: both names always exist
        assert (a.read_bytes(), b.read_bytes()) == (b"B", b"A")
    else:  # a system without RENAME_EXCHANGE: Spares.replace falls back to a rename
        assert (a.read_bytes(), b.read_bytes()) == (b"A", b"B")


def test_a_store_only_read_writes_nothing(tmp_path):
    """Opening spares (every ModuleStore does, also one opened to export or evaluate a run)
    makes no folder: a read-only run folder stays readable."""
    spares = Spares(tmp_path / "run" / ".spare", max_bytes=1 << 20)
    assert not (tmp_path / "run").exists() and len(spares) == 0
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "old").write_bytes(b"x")
    spares.give(tmp_path / "run" / "old")  # the first file given back makes the folder
    assert len(spares) == 1 and (tmp_path / "run" / ".spare").is_dir()
