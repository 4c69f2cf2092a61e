"""Crash-safe writes (fileio.AtomicFile) on plain descriptors: small writes gathered into one
``writev``, large parts written from their own memory, the folder made only when missing, the
mode 0644 whatever the umask. What a user would notice: every file lands whole and in order,
even when the kernel writes less than asked, and nothing is left behind by an aborted write.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from dipaco import fileio
from dipaco.fileio import AtomicFile, write_atomic


def test_small_and_large_parts_land_whole_and_in_order(tmp_path):
    target = tmp_path / "f.bin"
    big = np.arange(100_000, dtype=np.float32)  # 400 KB: written from its own memory
    parts = [b"head", memoryview(big), bytearray(b"x" * 70_000), b"", b"tail"]
    f = AtomicFile(target)
    for p in parts[:2]:
        f.write(p)
    f.write(*parts[2:])
    assert not target.exists()  # nothing appears before the commit
    f.commit()
    assert target.read_bytes() == b"head" + big.tobytes() + b"x" * 70_000 + b"tail"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def test_many_small_writes_are_gathered_and_a_short_write_goes_on(tmp_path, monkeypatch):
    calls = []
    real = os.writev

    def short(fd, buffers):  # the kernel may write less than asked: at most 1000 bytes
        calls.append(len(buffers))
        budget, out = 1000, []
        for b in buffers:
            out.append(bytes(b[:budget]))
            budget -= len(out[-1])
            if budget == 0:
                break
        return real(fd, out)

    monkeypatch.setattr(fileio.os, "writev", short)
    target = tmp_path / "tokens.bin"
    chunks = [bytes([i % 251]) * 37 for i in range(2000)]  # a shard's many small documents
    f = AtomicFile(target)
    for c in chunks:
        f.write(c)
    f.commit()
    assert target.read_bytes() == b"".join(chunks)
    assert len(calls) == -(-len(b"".join(chunks)) // 1000)  # no call wasted, none extra


def test_a_missing_folder_is_made_and_the_mode_ignores_the_umask(tmp_path, monkeypatch):
    monkeypatch.setattr(fileio, "_UMASK", 0o077)
    old = os.umask(0o077)
    try:
        target = tmp_path / "a" / "b" / "state.json"
        write_atomic(target, b"{}")
    finally:
        os.umask(old)
    assert target.read_bytes() == b"{}"
    assert target.stat().st_mode & 0o777 == 0o644  # shared artifacts readable by others


def test_an_aborted_or_failed_write_leaves_nothing(tmp_path, monkeypatch):
    target = tmp_path / "f.bin"
    f = AtomicFile(target)
    f.write(b"partial")
    f.abort()
    assert list(tmp_path.iterdir()) == []

    def full(fd, buffers):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fileio.os, "writev", full)
    with pytest.raises(OSError):
        write_atomic(target, b"x" * (1 << 17))
    assert list(tmp_path.iterdir()) == []
