"""Fuzzing a peer's downloads: whatever the manifest and the replies say, a file is either the
one the manifest names (size and SHA-256) inside the run folder, or a DipacoError.

The manifest comes from the scheduler's Welcome and the bytes from FetchFile replies, both from
the network: a wrong entry, a path that climbs out of the run folder, a reply of the wrong type,
a chunk at the wrong offset, too long, of the wrong dtype or mangled on the way must all end in
a clear error, and no file outside the run folder is ever written.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch
from _fuzzing import FUZZ, assert_clean_error, frame_mutations, json_mutations
from hypothesis import given
from hypothesis import strategies as st

from dipaco.errors import DipacoError
from dipaco.peer import download
from dipaco.peer.download import RunFiles
from dipaco.protocols import messages as m
from dipaco.protocols.transport import Transport

CONTENT = bytes(range(256)) * 3 + b"tail"
INFO = {"size": len(CONTENT), "sha256": hashlib.sha256(CONTENT).hexdigest()}
CHUNK = 300  # small chunks, so that a file takes several replies


def _chunk(name: str, offset: int, length: int) -> m.FileChunk:
    data = bytearray(CONTENT[offset : offset + length])
    return m.FileChunk(
        name,
        len(CONTENT),
        INFO["sha256"],
        offset,
        {"data": torch.frombuffer(data, dtype=torch.uint8)}
        if data
        else {"data": torch.zeros(0, dtype=torch.uint8)},
    )


ODD_REPLIES = [
    m.Ok(),
    m.Error(reason="unknown-file", message="no such file"),
    m.NoTask(reason="x", retry_after=0.0, finished=False),
    m.FileChunk("f", 1, "", 0, {}),
    m.FileChunk("f", 1, "", 0, {"data": torch.zeros(2, 2, dtype=torch.uint8)}),
    m.FileChunk("f", 1, "", 0, {"data": torch.ones(3, dtype=torch.float32)}),
    m.FileChunk("f", 1, "", 0, {"data": torch.zeros(0, dtype=torch.uint8)}),
    m.FileChunk("f", 1, "", 0, {"data": torch.zeros(4 * CHUNK, dtype=torch.uint8)}),
    m.FileChunk("f", 1, "", 7, {"data": torch.zeros(5, dtype=torch.uint8)}),
]


class FlakyServer(Transport):
    """Serves CONTENT in chunks; reply number ``bad_at`` is replaced by ``bad`` (bytes)."""

    def __init__(self, bad_at: int, bad: bytes | None) -> None:
        self.bad_at, self.bad, self.calls = bad_at, bad, 0

    def _roundtrip(self, data: bytes) -> bytes:
        req = m.decode_message(data)
        assert isinstance(req, m.FetchFile)
        reply = m.encode_message(_chunk(req.name, req.offset, req.length))
        self.calls += 1
        if self.calls - 1 == self.bad_at and self.bad is not None:
            return self.bad
        return bytes(reply)


@st.composite
def bad_replies(draw: st.DrawFn) -> bytes | None:
    kind = draw(st.sampled_from(["none", "message", "frame"]))
    if kind == "none":
        return None
    if kind == "message":
        return bytes(m.encode_message(draw(st.sampled_from(ODD_REPLIES))))
    offset = draw(st.sampled_from([0, CHUNK, 2 * CHUNK]))
    valid = bytes(m.encode_message(_chunk("f", offset, CHUNK)))
    return draw(frame_mutations(valid))


names = st.one_of(
    st.just("shards/P0/train.tokens"),
    # ABSOLUTE stands for an absolute path beside the run folder (made per example, below).
    st.sampled_from(["../escape.bin", "ABSOLUTE", "a/../../b", "", ".", "x/./y", "sub/"]),
    st.text(alphabet="ab./", min_size=1, max_size=8),
)


@pytest.fixture(scope="module", autouse=True)
def small_chunks():
    old, download.CHUNK = download.CHUNK, CHUNK
    yield
    download.CHUNK = old


@FUZZ
@given(
    name=names,
    info=st.one_of(st.just(INFO), json_mutations(INFO)),
    bad_at=st.integers(0, 3),
    bad=bad_replies(),
    cached=st.sampled_from([None, b"", CONTENT, CONTENT[:-1] + b"!"]),
)
def test_downloads_give_the_manifest_file_or_a_clean_error(
    tmp_path_factory, name, info, bad_at, bad, cached
):
    base = tmp_path_factory.getbasetemp() / "fuzz-download"
    shutil.rmtree(base, ignore_errors=True)
    folder = base / "run"
    folder.mkdir(parents=True)
    if name == "ABSOLUTE":
        name = str(base / "abs.bin")
    if cached is not None and name == "shards/P0/train.tokens":
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(cached)
    files = RunFiles(FlakyServer(bad_at, bad), "peer", {name: info}, folder)
    try:
        got = files.get(name)
    except DipacoError as exc:
        assert_clean_error(exc)
    except Exception as exc:  # noqa: BLE001 - the property under test
        pytest.fail(f"{type(exc).__name__} escaped RunFiles.get({name!r}): {exc!r}")
    else:
        # Extra keys in an entry are harmless; its size and hash are what a download honours.
        assert {k: info[k] for k in INFO} == INFO, "a download honoured a damaged entry"
        assert Path(got).resolve().is_relative_to(folder.resolve())
        assert Path(got).read_bytes() == CONTENT
    outside = [p for p in base.rglob("*") if not p.resolve().is_relative_to(folder.resolve())]
    assert not outside, f"wrote outside the run folder: {outside}"


def test_shard_prefixes_outside_the_run_folder_are_refused(tmp_path):
    files = RunFiles(FlakyServer(-1, None), "peer", {}, tmp_path)
    for prefix in ("../x", "/etc/x", "shards/../../x"):
        with pytest.raises(DipacoError):
            files.shard(prefix, {})
