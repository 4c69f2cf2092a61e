"""Run files served by the coordinator (FetchFile) and fetched, checked and cached by peers."""

import hashlib

import pytest

from dipaco.coordinator.core import Coordinator
from dipaco.coordinator.outer import OuterSettings
from dipaco.errors import DataError, RejectedError
from dipaco.model.topology import Topology
from dipaco.model.transformer import ModelConfig, new_dense_model
from dipaco.peer.download import RunFiles
from dipaco.protocols import messages as m
from dipaco.protocols.transport import LocalTransport

TOPO = Topology.parse("2x2", 2)


def serve(tmp_path, size=9_000_123):
    blob = tmp_path / "served" / "big.bin"
    blob.parent.mkdir()
    blob.write_bytes(bytes(range(256)) * (size // 256) + b"x" * (size % 256))
    info = {"size": size, "sha256": hashlib.sha256(blob.read_bytes()).hexdigest()}
    co = Coordinator(
        tmp_path / "co",
        TOPO,
        rounds=1,
        inner_steps=1,
        step_offset=0,
        total_steps=1,
        seed=0,
        outer=OuterSettings(),
        lease_seconds=10,
        run_id="t",
        peer_config={"files": {"big.bin": info}},
        files={"big.bin": blob},
    )
    cfg = ModelConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, max_seq_len=16)
    co.start(TOPO.init_modules(new_dense_model(cfg, 0).state_dict()))
    return co, blob, info


def test_a_file_arrives_whole_in_chunks_and_is_cached(tmp_path):
    co, blob, info = serve(tmp_path)
    files = RunFiles(LocalTransport(co.handle), "p", {"big.bin": info}, tmp_path / "peer")
    got = files.get("big.bin")
    assert got.read_bytes() == blob.read_bytes()
    assert files.downloaded == info["size"]  # three 4 MiB chunks or less
    files.get("big.bin")
    assert files.downloaded == info["size"]  # cached: nothing fetched again
    got.write_bytes(b"tampered")
    files.get("big.bin")
    assert (
        got.read_bytes() == blob.read_bytes()
    )  # a cached file that no longer matches is refetched


def test_a_file_that_does_not_match_the_manifest_is_refused(tmp_path):
    co, _, info = serve(tmp_path, size=1000)
    wrong = {"big.bin": {**info, "sha256": "0" * 64}}
    files = RunFiles(LocalTransport(co.handle), "p", wrong, tmp_path / "peer")
    with pytest.raises(DataError, match="does not match"):
        files.get("big.bin")
    assert not (tmp_path / "peer" / "big.bin").exists()
    assert not list((tmp_path / "peer").glob("*.part"))
    with pytest.raises(DataError, match="no file"):
        files.get("other.bin")


def test_bad_file_requests_are_rejected_and_counted(tmp_path):
    co, _, _ = serve(tmp_path, size=1000)
    tr = LocalTransport(co.handle)
    cases = {
        "unknown-file": m.FetchFile(peer_id="p", name="../../etc/passwd", offset=0, length=10),
        "bad-range": m.FetchFile(peer_id="p", name="big.bin", offset=5000, length=10),
    }
    for reason, req in cases.items():
        with pytest.raises(RejectedError) as err:
            tr.request(req)
        assert err.value.reason == reason
    with pytest.raises(RejectedError):
        tr.request(m.FetchFile(peer_id="p", name="big.bin", offset=0, length=64 << 20))
    assert co.status().state["rejections"] == {"unknown-file": 1, "bad-range": 2}


def test_a_shard_name_outside_the_run_folder_is_refused(tmp_path):
    co, _, _ = serve(tmp_path, size=1000)
    files = RunFiles(LocalTransport(co.handle), "p", {}, tmp_path / "peer")
    for name in ("../../etc/passwd", "/etc/passwd", "shards/../../x"):
        with pytest.raises(DataError, match="outside the run folder"):
            files.shard(name)
    # A shard the manifest does not list, and the offer gives no size and hash for, is refused.
    with pytest.raises(DataError, match="no file"):
        files.shard("shards/phase1/P0/train")
