"""`dipaco eval/gather --owner-dir` on a folder the run left behind (issue 49): a killed
scheduler's folder, after a standby carried the run on, is named as behind, with what to open
instead; an owner folder that is older, or lacks the module, is named too."""

import json

import pytest

from dipaco.coordinator.gather import BehindTheRun, gather, gather_run
from dipaco.errors import DataError


def scheduler_folder(root, version=3):
    (root / "coordinator").mkdir(parents=True)
    (root / "coordinator" / "coordinator.json").write_text(
        json.dumps(
            {
                "run_id": "r1",
                "owner_id": "local",
                "owners": {"L1.M0": "owner-b", "L0.M0": "local"},
                "remote": {"L1.M0": {"version": version, "hash": "ab" * 32}},
                "addresses": {"owner-b": ["/ip4/127.0.0.1/tcp/9/p2p/QmOwnerB"]},
                "owner_keys": {},
            }
        )
    )
    return root


def owner_folder(root, version):
    module = root / "coordinator" / "modules" / "L1.M0"
    module.mkdir(parents=True)
    (module / "head.json").write_text(json.dumps({"version": version, "hash": "cd" * 32}))
    return root


def test_an_owner_folder_further_along_says_this_folder_is_behind(tmp_path):
    run = scheduler_folder(tmp_path / "scheduler", version=3)
    owner = owner_folder(tmp_path / "owner", version=5)
    with pytest.raises(BehindTheRun) as caught:
        gather_run(run, owner_dirs=[owner])  # no network tried: no owner serves v3 any more
    said = str(caught.value)
    assert f"{run} is behind the run" in said and "holds L1.M0 at v5" in said
    assert "recorded v3" in said and "the standby's --run-dir" in said
    assert "pass --owner-dir DIR" not in said  # it was passed: not asked for again


def test_an_older_or_empty_owner_folder_is_named(tmp_path):
    run = scheduler_folder(tmp_path / "scheduler", version=3)
    old = owner_folder(tmp_path / "old", version=2)
    with pytest.raises(
        DataError, match=r"--owner-dir .*old holds L1\.M0 at v2, not at the final v3"
    ):
        gather(run, owner_dirs=[old])
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"looked in --owner-dir .*empty: not there"):
        gather(run, owner_dirs=[tmp_path / "empty"])
