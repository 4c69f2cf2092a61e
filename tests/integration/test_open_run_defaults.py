"""An open run's defaults on honest runs that go well and badly: every delta scored on held-out
documents, copies of earlier deltas refused, and a diverging run still finished.

A run whose outer step is far too large (DiLoCo-4 at an outer learning rate of 10,000, the
regime ladder's diverged run) makes honest deltas that copy one another: each is nearly the
module's parameters scaled, once weight decay is most of every inner step. The copy check would
refuse them, as hostile, until the local peers' keys were banned and the run stalled; the
held-out check tells such a run (its paths score worse than where they started), and there the
copies are let through.
"""

from __future__ import annotations

import collections
import json
import threading

import pytest

from dipaco.prepare.pipeline import prepare
from dipaco.run.factory import build_coordinator
from dipaco.run.local import run_local_peers
from dipaco.run.metrics_log import MetricsLog

pytestmark = pytest.mark.slow


def run(root, config, reuse):
    prep = prepare(root, config, reuse=reuse)
    co = build_coordinator(prep, MetricsLog(root / "metrics.jsonl"), evaluate=False)
    for thread in run_local_peers(co, prep, 2, stop=threading.Event()):
        thread.join(300)
    events = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    return co, collections.Counter(e["event"] for e in events)


@pytest.mark.parametrize("outer_lr", [0.7, 1e4])
def test_an_open_run_with_its_defaults_finishes_whether_it_trains_or_diverges(
    tiny_config, prepared_tiny, tmp_path, outer_lr
):
    config = tiny_config.replace(
        topology={"levels": "1", "replicas": 4},
        train={"inner_steps": 8, "rounds": 4},
        outer={"lr": outer_lr},
        validation={"norm_check": "off"},  # as the regime ladder: a growing delta is no outlier
    )
    co, counts = run(tmp_path / "run", config, prepared_tiny)
    print(f"outer lr {outer_lr:g}: {dict(counts)}, refused {dict(co.rejections)}")
    # The defaults of an open run, nothing set by hand: held-out scoring and the copy check.
    assert co.heldout_loss is not None and co.copies.cosine == 0.9999
    assert co.finished and not co.rejections, dict(co.rejections)
    assert counts["heldout_check"] == 16 and counts["outer_step"] == 4 * 3
    if outer_lr < 1:  # honest deltas of a run that trains are never copies
        assert counts["copy_let_through"] == 0
    else:  # the diverged run's deltas copy one another: let through, not refused
        assert counts["copy_let_through"] >= 1
        assert co.key_scores.diverging()
