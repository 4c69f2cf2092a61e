"""The scheduler's per-round validation when other owners hold modules: it fetches them, tries
again when a fetch fails, and says why when it cannot validate a round."""

import json

import pytest

from dipaco.errors import TransportError
from dipaco.prepare.pipeline import prepare
from dipaco.run import round_work
from dipaco.run.factory import build_coordinator
from dipaco.run.metrics_log import MetricsLog


@pytest.fixture
def scheduler(run_copy, tiny_config, monkeypatch):
    """``make(failures)``: a scheduler one of whose modules another owner holds; fetching it
    fails ``failures`` times (the owner unreachable), then works. Returns (scheduler, the
    modules asked for at each try, the run folder)."""
    monkeypatch.setattr(round_work.time, "sleep", lambda s: None)

    def make(failures: int):
        root = run_copy()
        co = build_coordinator(
            prepare(root, tiny_config), MetricsLog(root / "m.jsonl"), evaluate=True
        )
        co.owners[sorted(co.owners)[-1]] = "another-owner"
        asked: list[list[str]] = []

        def fetch(mids):
            asked.append(list(mids))
            if len(asked) <= failures:
                raise TransportError("cannot reach another-owner: connection refused")
            return {mid: co.store.params(mid) for mid in mids}

        co.set_remote_fetcher(fetch)
        return co, asked, root

    return make


def evals(root) -> dict[int, float]:
    log = root / "m.jsonl"
    lines = log.read_text().splitlines() if log.exists() else []
    events = [json.loads(line) for line in lines]
    return {e["round"]: e["ppl"] for e in events if e["event"] == "eval"}


def test_a_fetch_that_fails_once_is_tried_again_and_the_round_is_validated(scheduler):
    co, asked, root = scheduler(failures=1)
    co.on_round(1)
    assert co.after_round.drain(60)  # the validation runs after the round, on its own thread
    remote = [mid for mid, owner in co.owners.items() if owner == "another-owner"]
    assert asked == [remote, remote]
    assert list(evals(root)) == [1]
    assert co.eval_note is None


def test_an_owner_that_cannot_be_reached_skips_the_round_and_says_why(scheduler):
    co, asked, root = scheduler(failures=round_work.FETCH_TRIES)
    co.on_round(1)
    assert co.after_round.drain(60)
    assert len(asked) == round_work.FETCH_TRIES
    assert evals(root) == {}
    assert "per-round validation skipped" in co.eval_note
    assert "connection refused" in co.eval_note

    # The owner answers again: the next round is validated and the note is gone.
    co.on_round(2)
    assert co.after_round.drain(60)
    assert list(evals(root)) == [2]
    assert co.eval_note is None
