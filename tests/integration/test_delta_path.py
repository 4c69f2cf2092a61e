"""One large delta on its way in, over a real hivemind stream to a coordinator: how many times
its bytes are hashed and copied whole, how often the coordinator's lock is taken for it
(docs/architecture.md, "What one delta costs on its way in", holds the figures; these tests hold
the code to them). A hash pass is one hash object (BLAKE3, SHA-256, XXH3) fed at least half the
delta's bytes, at either end; a whole copy is an allocation of at least half its bytes, at
either end, by anyone (our code, torch, NumPy, hivemind, asyncio), counted by a malloc wrapper
(_alloc_count.c, compiled here and preloaded into a child process that sends the delta).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import xxhash
from _delta_path_child import TOPO, send_one_delta

from dipaco.protocols import auth
from dipaco.protocols import messages as m

# The figures docs/architecture.md states, for a delta that comes in through hivemind.
HASH_PASSES = {"blake3": 2}  # the envelope: sealed by the peer, opened by the coordinator
# The coordinator's buffer the stream's pieces are written into. The peer sends from the
# delta's own memory (wire.Pieces), and the coordinator's tensors are views of its buffer.
WHOLE_COPIES = 1
LOCK_TAKEN = 16  # the coordinator's lock, for one delta that closes no round
HERE = Path(__file__).resolve().parent


class Counted:
    """A hash object that counts the bytes it is fed."""

    def __init__(self, real, kind: str, log: list, data=None) -> None:
        self._real, self.kind, self.bytes = real, kind, 0
        log.append(self)
        if data is not None:
            self.bytes += memoryview(data).nbytes

    def update(self, data) -> None:
        self.bytes += memoryview(data).nbytes
        self._real.update(data)

    def __getattr__(self, name):
        return getattr(self._real, name)


@pytest.fixture
def hashes(monkeypatch):
    log: list[Counted] = []
    real_sha256, real_xxh3, real_blake3 = hashlib.sha256, xxhash.xxh3_128, auth.blake3.blake3

    def sha256(data=b"", **kw):
        return Counted(real_sha256(data, **kw), "sha256", log, data)

    def xxh3(data=b"", **kw):
        return Counted(real_xxh3(data, **kw), "xxh3", log, data)

    def blake3(data=b"", **kw):
        return Counted(real_blake3(data, **kw), "blake3", log, data)

    blake3.AUTO = real_blake3.AUTO  # type: ignore[attr-defined]
    monkeypatch.setattr(hashlib, "sha256", sha256)
    monkeypatch.setattr(xxhash, "xxh3_128", xxh3)
    monkeypatch.setattr(auth, "blake3", SimpleNamespace(blake3=blake3))
    return log


def test_a_large_delta_is_hashed_as_few_times_as_stated(tmp_path, hashes):
    @contextlib.contextmanager
    def watch(co):
        hashes.clear()  # the request alone
        yield

    co, task, size, reply = send_one_delta(tmp_path / "run", watch)
    assert size > 5_000_000
    assert not isinstance(reply, m.Error), reply
    assert task.path in co.store.modules[TOPO.path_modules(task.path)[0]].pending  # admitted

    passes: dict[str, int] = {}
    for h in hashes:
        if h.bytes >= size // 2:
            passes[h.kind] = passes.get(h.kind, 0) + 1
    assert passes == HASH_PASSES


def test_a_large_delta_is_copied_whole_as_few_times_as_stated(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "the allocation counter needs a C compiler (cc or gcc) on PATH"
    lib = tmp_path / "alloc_count.so"
    subprocess.run(
        [cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(HERE / "_alloc_count.c"), "-ldl"],
        check=True,
    )
    # Allocations from 64 KiB on, to see the pieces too; a whole copy is half the delta or more.
    out = subprocess.run(
        [sys.executable, str(HERE / "_delta_path_child.py"), str(tmp_path / "run"), "65536"],
        env={**os.environ, "LD_PRELOAD": str(lib)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    size, sizes = seen["size"], seen["allocations"]
    assert seen["reply"] == "DeltaAck" and size > 5_000_000
    assert sizes, "the counter saw no allocation: was it preloaded?"
    whole = sorted(round(n / size, 3) for n in sizes if n >= size // 2)
    assert len(whole) == WHOLE_COPIES, (whole, f"{sum(sizes) / size:.1f} delta sizes in all")
    assert seen["lock"] <= LOCK_TAKEN, seen["lock"]
    assert "coordinator/admission.py" in seen["files"], seen["files"]
