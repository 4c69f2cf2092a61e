"""Run files served by the coordinator (FetchFile) and fetched, checked and cached by peers."""

import hashlib

import pytest

from dipaco.coordinator.core import Coordinator
from dipaco.coordinator.outer import OuterSettings
from dipaco.errors import DataError, RejectedError, TransportError
from dipaco.model.topology import Topology
from dipaco.model.transformer import ModelConfig, new_dense_model
from dipaco.peer import download
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


@pytest.mark.parametrize(
    "name",
    ["x" * 300, "a/" * 20 + "b", ".hidden", "a/./b", "a//b", "a\\b", "a\x00b", "tokenizer.model/"],
)
def test_a_manifest_name_that_is_not_plain_is_a_clear_error_not_an_os_error(tmp_path, name):
    """Issue 17, break 6: too long a name, or one naming a folder, raised raw OS errors."""
    co, _, info = serve(tmp_path, size=1000)
    files = RunFiles(LocalTransport(co.handle), "p", {name: info}, tmp_path / "peer")
    with pytest.raises(DataError, match="outside the run folder"):
        files.get(name)
    assert not (tmp_path / "peer").exists() or not any((tmp_path / "peer").rglob("*"))


def test_a_name_that_is_a_folder_here_is_a_clear_error(tmp_path):
    co, _, info = serve(tmp_path, size=1000)
    (tmp_path / "peer" / "big.bin").mkdir(parents=True)
    files = RunFiles(LocalTransport(co.handle), "p", {"big.bin": info}, tmp_path / "peer")
    with pytest.raises(DataError, match="is a folder"):
        files.get("big.bin")


def test_a_download_larger_than_the_free_disk_is_refused_before_any_byte(tmp_path):
    co, _, info = serve(tmp_path, size=1000)
    huge = {**info, "size": 1 << 62}  # the coordinator's word, checked before anything is fetched
    files = RunFiles(LocalTransport(co.handle), "p", {"big.bin": huge}, tmp_path / "peer")
    with pytest.raises(DataError, match="GiB free"):
        files.get("big.bin")
    assert files.downloaded == 0 and not (tmp_path / "peer" / "big.bin.part").exists()


class FakeDHT:  # a unit test of find_run alone; the real DHT is in tests/integration
    def __init__(self, runs, manifests):
        self.records = {"dipaco.runs": runs, **manifests}

    def get(self, key):
        return self.records.get(key)


def test_a_run_id_from_the_dht_that_is_not_a_plain_name_is_ignored():
    from dipaco.errors import ConfigError, TransportError
    from dipaco.protocols import discovery

    evil = "../../../tmp/evil"
    manifest = {"run_id": evil}
    entry = {"manifest": discovery.manifest_sha256(manifest)}
    dht = FakeDHT({evil: entry}, {discovery.key(evil, "manifest"): manifest})
    with pytest.raises(TransportError, match="found no run in the DHT"):
        discovery.find_run(dht, wait=0.3)
    with pytest.raises(ConfigError, match="not a run id"):
        discovery.find_run(dht, run_id=evil, wait=0.3)
    good = {"run_id": "0123456789abcdef"}
    dht = FakeDHT(
        {evil: entry, "0123456789abcdef": {"manifest": discovery.manifest_sha256(good)}},
        {discovery.key("0123456789abcdef", "manifest"): good},
    )
    assert discovery.find_run(dht, wait=0.3)[0] == "0123456789abcdef"


class SilentDHT(FakeDHT):
    """A DHT whose first ``silent`` reads do not answer in time (as HivemindNode.get says)."""

    def __init__(self, runs, manifests, silent: int):
        super().__init__(runs, manifests)
        self.silent = silent

    def get(self, key):
        from dipaco.errors import TransportError

        if self.silent:
            self.silent -= 1
            raise TransportError("the DHT did not answer within 60 s", reason="timeout")
        return super().get(key)


def test_a_dht_that_does_not_answer_is_asked_again_until_the_wait_is_spent():
    from dipaco.errors import TransportError
    from dipaco.protocols import discovery
    from dipaco.protocols.hivemind.node import HivemindNode

    good = {"run_id": "0123456789abcdef"}
    runs = {"0123456789abcdef": {"manifest": discovery.manifest_sha256(good)}}
    dht = SilentDHT(runs, {discovery.key("0123456789abcdef", "manifest"): good}, silent=2)
    assert discovery.find_run(dht, wait=5.0)[0] == "0123456789abcdef"
    with pytest.raises(TransportError, match="found no run in the DHT"):
        discovery.find_run(SilentDHT(runs, {}, silent=100), wait=0.3)

    class Unanswered:  # hivemind's future of a DHT call that never comes back
        def result(self, timeout=None):
            assert timeout is not None  # never a wait without end
            raise TimeoutError

    with pytest.raises(TransportError, match="did not answer") as info:
        HivemindNode._dht_result(Unanswered(), "reading dipaco.runs")
    assert info.value.reason == "timeout"


class Flaky(LocalTransport):
    """A link whose streams are reset now and then: the ``drops``-th requests fail."""

    def __init__(self, handler, drops):
        super().__init__(handler)
        self.calls, self.drops = 0, set(drops)

    def _roundtrip(self, data):
        self.calls += 1
        if self.calls in self.drops:
            raise TransportError("the coordinator closed the stream without a reply")
        return super()._roundtrip(data)


def test_a_chunk_lost_to_a_reset_stream_is_asked_again_and_the_file_arrives_whole(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(download, "CHUNK_RETRY_SECONDS", 0.0)
    co, blob, info = serve(tmp_path)
    link = Flaky(co.handle, drops={1, 3})  # the first request, and a later chunk
    got = RunFiles(link, "p", {"big.bin": info}, tmp_path / "peer").get("big.bin")
    assert got.read_bytes() == blob.read_bytes() and link.calls == 5  # 3 chunks + 2 again


def test_a_link_that_keeps_failing_is_given_up_after_a_few_tries(tmp_path, monkeypatch):
    monkeypatch.setattr(download, "CHUNK_RETRY_SECONDS", 0.0)
    co, _, info = serve(tmp_path, size=1000)
    link = Flaky(co.handle, drops=range(1, 100))
    with pytest.raises(TransportError, match="closed the stream"):
        RunFiles(link, "p", {"big.bin": info}, tmp_path / "peer").get("big.bin")
    assert link.calls == download.CHUNK_TRIES
