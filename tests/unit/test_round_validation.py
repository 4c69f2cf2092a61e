"""The scheduler's per-round validation when other owners hold modules: it fetches them, tries
again when a fetch fails, and says why when it cannot validate a round."""

import json

from dipaco.errors import TransportError
from dipaco.prepare.pipeline import prepare
from dipaco.run import factory
from dipaco.run.factory import build_coordinator
from dipaco.run.metrics_log import MetricsLog


def scheduler_with_a_remote_module(root, config, fetch):
    """A scheduler one of whose modules another owner holds, fetched with ``fetch``."""
    co = build_coordinator(prepare(root, config), MetricsLog(root / "m.jsonl"), evaluate=True)
    mid = sorted(co.owners)[-1]
    co.owners[mid] = "another-owner"
    co.fetch_remote = fetch
    return co, mid


def evals(root) -> dict[int, float]:
    log = root / "m.jsonl"
    lines = log.read_text().splitlines() if log.exists() else []
    events = [json.loads(line) for line in lines]
    return {e["round"]: e["ppl"] for e in events if e["event"] == "eval"}


def test_a_fetch_that_fails_once_is_tried_again_and_the_round_is_validated(
    run_copy, tiny_config, monkeypatch
):
    monkeypatch.setattr(factory.time, "sleep", lambda s: None)
    root = run_copy()
    asked = []

    def flaky(mids):
        asked.append(list(mids))
        if len(asked) == 1:
            raise TransportError("nothing moved to or from the owner for 30 s")
        return {m: co.store.params(m) for m in mids}

    co, mid = scheduler_with_a_remote_module(root, tiny_config, flaky)
    co.on_round(1)
    assert asked == [[mid], [mid]]
    assert list(evals(root)) == [1]
    assert co.eval_note is None


def test_an_owner_that_cannot_be_reached_skips_the_round_and_says_why(
    run_copy, tiny_config, monkeypatch
):
    monkeypatch.setattr(factory.time, "sleep", lambda s: None)
    root = run_copy()
    tries = []

    def down(mids):
        tries.append(mids)
        raise TransportError("cannot reach another-owner: connection refused")

    co, _ = scheduler_with_a_remote_module(root, tiny_config, down)
    co.on_round(1)
    assert len(tries) == factory.FETCH_TRIES
    assert evals(root) == {}
    assert "per-round validation skipped" in co.eval_note
    assert "connection refused" in co.eval_note


def test_the_next_round_is_validated_once_the_owner_answers_again(
    run_copy, tiny_config, monkeypatch
):
    monkeypatch.setattr(factory.time, "sleep", lambda s: None)
    root = run_copy()
    up = {"now": False}

    def sometimes(mids):
        if not up["now"]:
            raise TransportError("cannot reach another-owner")
        return {m: co.store.params(m) for m in mids}

    co, _ = scheduler_with_a_remote_module(root, tiny_config, sometimes)
    co.on_round(1)
    assert co.eval_note is not None
    up["now"] = True
    co.on_round(2)
    assert list(evals(root)) == [2]
    assert co.eval_note is None
