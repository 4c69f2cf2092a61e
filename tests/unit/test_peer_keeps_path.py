"""A peer that gets the same path again continues from what it holds: no path built anew, no
inner state read back from disk, and the same parameters as a peer that rebuilds and reloads."""

import torch

from dipaco.peer.peer import Peer
from dipaco.prepare.pipeline import prepare
from dipaco.protocols.transport import LocalTransport
from dipaco.run.factory import build_coordinator
from dipaco.run.metrics_log import MetricsLog


def _whole_run(root, config, keep: bool, before_fetch=None):
    """One peer trains the whole run; the coordinator, the trainer's counts, the tasks' paths."""
    co = build_coordinator(prepare(root, config), MetricsLog(root / "m.jsonl"), evaluate=False)
    tasks: dict[str, int] = {}
    peer = Peer(
        LocalTransport(co.handle),
        "solo",
        root / "peer",
        on_progress=lambda info: tasks.setdefault(info["task"], info["path"]),
    )
    peer.keep_path = keep
    if before_fetch is not None:
        fetch = peer.fetch
        peer.fetch = lambda task: (before_fetch(peer), fetch(task))[1]
    assert peer.run() == len(tasks) > 0 and peer.run_finished
    co.store.sync_all()
    return co, peer.trainer.counts, list(tasks.values())


def _repeats(paths):
    return sum(a == b for a, b in zip(paths, paths[1:], strict=False))


def test_the_same_path_again_is_continued_in_memory_with_the_same_result(short_copy, short_config):
    kept_co, kept, paths = _whole_run(short_copy("kept"), short_config, keep=True)
    fresh_co, fresh, fresh_paths = _whole_run(short_copy("fresh"), short_config, keep=False)
    assert paths == fresh_paths
    # The peer prefers its last path: the first task of round 1 is the last one of round 0.
    again = _repeats(paths)
    assert again >= 1, paths
    assert kept["reused"] == again and kept["built"] == len(paths) - again, (kept, paths)
    assert kept["state kept"] == again and kept["state loaded"] == len(paths) - again, kept
    assert fresh["reused"] == 0 and fresh["state kept"] == 0 and fresh["built"] == len(paths)
    for mid in kept_co.topology.module_ids():
        assert kept_co.store.version(mid) == fresh_co.store.version(mid) > 0
        for name, tensor in kept_co.store.params(mid).items():
            assert torch.equal(tensor, fresh_co.store.params(mid)[name]), (mid, name)


def test_a_state_file_written_since_by_another_process_is_read_not_the_kept_state(
    short_copy, short_config
):
    """Another process sharing the state folder rewrote the path's state after each task: the
    next task of the path reuses the model, but reads the state file back."""

    def rewrite(peer):
        for file in peer.inner.folder.glob("*.dpt"):
            data = file.read_bytes()
            file.unlink()
            file.write_bytes(data)  # another inode, another time

    _, counts, paths = _whole_run(short_copy(), short_config, keep=True, before_fetch=rewrite)
    again = _repeats(paths)
    assert again >= 1 and counts["reused"] == again, (counts, paths)
    assert counts["state kept"] == 0 and counts["state loaded"] == len(paths), counts
