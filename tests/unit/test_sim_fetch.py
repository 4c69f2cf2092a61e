"""The simulated peer judges a fetch's versions by the real peer's rule
(peer/modules.fetch_modules): it gives up a task whose module moved past its base, and trains
from a newer version no later than the task's round."""

from __future__ import annotations

from sim.peers import moved_past

from dipaco.protocols import messages as m


def offer(rnd: int, versions: dict[str, int]) -> m.TaskOffer:
    return m.TaskOffer("P0-r1-e0-a1", 0, rnd, dict(versions), 5, 0, 5, 60.0, 0)


def test_a_module_past_the_tasks_base_and_round_gives_the_task_up():
    task = offer(1, {"L0.M0": 1, "S.embed": 1})
    assert moved_past(task, {"L0.M0": 1, "S.embed": 2})
    assert task.module_versions == {"L0.M0": 1, "S.embed": 1}


def test_a_newer_version_no_later_than_the_round_becomes_the_base():
    task = offer(2, {"L0.M0": 1, "S.embed": 2})  # a task a round ahead, on L0.M0's last version
    assert not moved_past(task, {"L0.M0": 2, "S.embed": 2})
    assert task.module_versions == {"L0.M0": 2, "S.embed": 2}


def test_the_versions_asked_for_train():
    task = offer(1, {"L0.M0": 1})
    assert not moved_past(task, {"L0.M0": 1}) and task.module_versions == {"L0.M0": 1}


def test_the_rule_every_side_applies():
    """messages.trains_from: the peer's fetch, the owner's fetch reply, admission, hedging and
    this simulator all judge a module's version by it."""
    assert m.trains_from(3, 3, 3) == 3  # at the base
    assert m.trains_from(3, 4, 4) == 4  # an ahead task's module reached its round
    assert m.trains_from(3, 4, 5) is None  # past the round
    assert m.trains_from(3, 3, 4) is None  # a task on time, its module stepped without it
    assert m.trains_from(3, 4, 2) is None  # older than the base: never served for the task
