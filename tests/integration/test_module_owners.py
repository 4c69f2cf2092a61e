"""Two coordinators sharing the modules of one run, in one process over the local transport.

The networked form (separate processes over hivemind) is in test_hivemind_run.py; this one
checks the ownership logic itself: hand-over, per-owner fetch and push, reports, and that the
result equals a single coordinator's bit for bit.
"""

import json
import threading

import pytest
import torch

from dipaco.coordinator.access import change_access
from dipaco.coordinator.gather import fetch_current, gather, whole_run
from dipaco.coordinator.owner import Reporter, take_over
from dipaco.errors import DataError, RejectedError
from dipaco.peer.peer import Peer
from dipaco.prepare.pipeline import prepare
from dipaco.protocols import auth
from dipaco.protocols import messages as m
from dipaco.protocols.transport import LocalTransport
from dipaco.run.export import open_run
from dipaco.run.factory import build_coordinator, build_owner
from dipaco.run.metrics_log import MetricsLog

SECOND = ["L1.M0", "L1.M1"]


def run_peers(primary, peers_dir, n, connect):
    stop = threading.Event()
    peers, threads = [], []
    for i in range(n):
        peer = Peer(
            LocalTransport(primary.handle), f"peer-{i}", peers_dir, stop=stop, connect=connect
        )
        peers.append(peer)
        threads.append(threading.Thread(target=peer.run, daemon=True))
        threads[-1].start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads)
    assert all(p.run_finished for p in peers), [p.error for p in peers]


def test_two_owners_match_one_coordinator_bit_for_bit(run_copy, tiny_config):
    # No deadline closes a round; no delta is scored: two owners cannot score a path whose
    # modules they split, one coordinator could, and a scored delta's weight would differ.
    tiny_config = tiny_config.replace(
        scheduler={"quorum": 1.0}, validation={"heldout_check": False}
    )
    ref_root = run_copy("single")
    reference = build_coordinator(
        prepare(ref_root, tiny_config), MetricsLog(ref_root / "m.jsonl"), evaluate=False
    )
    run_peers(reference, ref_root / "peers", 2, connect=None)
    assert reference.finished

    root = run_copy("primary")
    prep = prepare(root, tiny_config)
    primary = build_coordinator(prep, MetricsLog(root / "metrics.jsonl"), evaluate=False)
    owner_metrics = MetricsLog(root.parent / "owner" / "metrics.jsonl")
    second = build_owner(
        root.parent / "owner",
        primary.peer_config,
        owner_metrics,
        owner_id="owner-b",
    )
    # The scheduler's operator allows the second owner's key (dipaco-coordinator allow --owner).
    change_access(primary.root, second.identity.public_key, allow=True, owner=True)
    # The owner introduces itself as the CLI's owner does; it must not show up as a peer.
    hello = m.Hello(peer_id="owner-b", device="coordinator")
    LocalTransport(primary.handle).authenticate(second.identity).request(hello)
    assert take_over(second, LocalTransport(primary.handle), SECOND) == SECOND
    assert {mid for mid, o in primary.owners.items() if o == "owner-b"} == set(SECOND)
    assert set(primary.store.modules) == set(prep.config.build_topology().module_ids()) - set(
        SECOND
    )
    reporter = Reporter(second, LocalTransport(primary.handle), interval=0.2)
    reporter.start()
    try:
        run_peers(
            primary, root / "peers", 2, connect=lambda owner, addrs: LocalTransport(second.handle)
        )
    finally:
        reporter.close()
    assert primary.finished and second.finished
    rounds = tiny_config.train.rounds
    for mid, record in reference.store.modules.items():
        owner = second if mid in SECOND else primary
        assert owner.store.version(mid) == record.version == rounds
        for name, tensor in record.params.items():
            assert torch.equal(owner.store.params(mid)[name], tensor), (mid, name)
    # Each owner applied exactly the deltas it acknowledged, once each.
    steps = [e for e in owner_metrics.read() if e["event"] == "outer_step"]
    acked = [e for e in owner_metrics.read() if e["event"] == "delta_acked"]
    assert len(steps) == len(SECOND) * rounds
    assert sorted(t for e in steps for t in e["tasks"]) == sorted(e["task"] for e in acked)
    # The loss curves still see every task (the scheduler logs TaskDone).
    deltas = [e for e in MetricsLog(root / "metrics.jsonl").read() if e["event"] == "delta"]
    assert len(deltas) == 4 * rounds

    # What `dipaco status` shows: owners as owners, peers without them, no task of a peer gone.
    state = primary.status().state
    assert sorted(state["peers"]) == ["peer-0", "peer-1"]
    assert all(p["task"] is None and p["state"] != "training" for p in state["peers"].values())
    assert state["owners"]["owner-b"]["modules"] == SECOND
    assert not state["owners"]["owner-b"]["scheduler"] and state["owners"]["local"]["scheduler"]

    # Gathered whole: the owner's final modules, checked against the scheduler's record and the
    # owner's release signatures, into the scheduler's folder, where eval and export find them.
    def connect(owner, addresses, key):
        assert owner == "owner-b" and key == second.identity.public_key
        return LocalTransport(second.handle).authenticate(primary.identity, key)

    with pytest.raises(DataError, match=r"owner owner-b .* holds L1\.M0 v2, L1\.M1 v2: not asked"):
        gather(root)  # nothing gathered yet, and no way to ask
    got = gather(root, connect=connect)
    assert sorted(got) == SECOND
    with pytest.raises(DataError, match=r"modules \['L1.M0', 'L1.M1'\] are trained by other"):
        open_run(root)  # a library caller that gathers nothing gets no stale modules
    usable = open_run(root, remote=lambda d: whole_run(d, network=False))
    assert sorted(usable.remote) == SECOND
    for mid in prep.config.build_topology().module_ids():
        for name, tensor in reference.store.params(mid).items():
            assert torch.equal(usable.params(mid)[name], tensor), (mid, name)
    # A damaged gathered copy is not used: it is fetched again.
    version_file = root / "gathered" / "L1.M0" / f"v{rounds}.dpt"
    version_file.write_bytes(version_file.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(DataError, match="owner-b"):
        gather(root)
    assert sorted(gather(root, connect=connect)) == SECOND
    # An owner that serves something other than what it reported is refused, and named.
    state_file = root / "coordinator" / "coordinator.json"
    saved = json.loads(state_file.read_text())
    saved["remote"]["L1.M1"]["hash"] = "0" * 64
    state_file.write_text(json.dumps(saved))
    with pytest.raises(
        DataError, match=r"owner-b.*L1\.M1 v2 is not the release the scheduler recorded"
    ):
        gather(root, connect=connect)


class Poisoner(Peer):
    """Trains honestly, pushes -2.5 times its delta (tests/faults/hostile.py's poisoner)."""

    def push(self, task, delta, tokens, losses, before_send=None):  # noqa: ANN001
        delta = {mid: {k: -2.5 * v for k, v in t.items()} for mid, t in delta.items()}
        return super().push(task, delta, tokens, losses, before_send)


def two_owners(root, config):
    """A scheduler owning every module but SECOND, an owner of SECOND reporting to it, and the
    scheduler's way to fetch the owner's current releases (FetchReleases, signature-checked)."""
    prep = prepare(root, config)
    primary = build_coordinator(prep, MetricsLog(root / "metrics.jsonl"), evaluate=False)
    second = build_owner(
        root.parent / "owner",
        primary.peer_config,
        MetricsLog(root.parent / "owner" / "metrics.jsonl"),
        owner_id="owner-b",
    )
    change_access(primary.root, second.identity.public_key, allow=True, owner=True)
    assert take_over(second, LocalTransport(primary.handle), SECOND) == SECOND

    def connect(owner, addresses, key):
        return LocalTransport(second.handle).authenticate(primary.identity, key)

    def fetch(mids):
        return fetch_current(
            connect,
            primary.run_id,
            {mid: ("owner-b", [], second.identity.public_key) for mid in mids},
        )

    primary.set_remote_fetcher(fetch)
    return prep, primary, second


def test_two_owners_score_every_path_whole_and_refuse_a_poisoner_at_both(run_copy, tiny_config):
    """With an open run's defaults, every path's modules split between two owners: the
    scheduler scores each path's delta whole (ScoreDelta) and signs a verdict, each owner
    admits its modules' deltas only with it. A poisoner's deltas are refused before either
    owner takes them; a delta without the verdict, or not the one scored, is refused."""
    config = tiny_config.replace(scheduler={"quorum": 1.0})
    assert config.security.join == "open" and config.validation.heldout_check == "auto"
    root = run_copy("scored")
    prep, primary, second = two_owners(root, config)
    reporter = Reporter(second, LocalTransport(primary.handle), interval=0.2)
    reporter.start()
    stop = threading.Event()
    owner_link = lambda owner, addrs: LocalTransport(second.handle)  # noqa: E731
    honest = [
        Peer(
            LocalTransport(primary.handle),
            f"peer-{i}",
            root / "peers",
            stop=stop,
            connect=owner_link,
        )
        for i in range(2)
    ]
    bad = Poisoner(
        LocalTransport(primary.handle),
        "poisoner",
        root / "bad",
        stop=stop,
        connect=owner_link,
        give_up_seconds=20.0,
    )
    threads = [threading.Thread(target=p.run, daemon=True) for p in [*honest, bad]]
    try:
        for t in threads:
            t.start()
        for t in threads[:2]:
            t.join(300)
        assert all(p.run_finished for p in honest), [p.error for p in honest]
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        reporter.close()
    assert primary.finished and second.finished

    events = MetricsLog(root / "metrics.jsonl").read()
    owner_events = MetricsLog(root.parent / "owner" / "metrics.jsonl").read()
    scored = [e for e in events if e["event"] == "delta_scored"]
    assert scored and all(e["peer"] != "poisoner" for e in scored)
    # Every delta either owner took was scored whole first; none of the poisoner's.
    for log in (events, owner_events):
        acked = {e["task"] for e in log if e["event"] == "delta_acked"}
        assert acked and acked <= {e["task"] for e in scored}
        assert not [e for e in log if e["event"] == "delta_acked" and e["peer"] == "poisoner"]
    refused = primary.status().state["rejections_by_peer"]
    assert refused.get("poisoner", {}).get("worse-heldout", 0) >= 1, refused
    # Every delta of every step was scored whole: both owners took the paper's mean (the
    # "auto" aggregation's robust combiner names itself in the step's event).
    steps = [e for log in (events, owner_events) for e in log if e["event"] == "outer_step"]
    assert steps and not [e for e in steps if "aggregation" in e]


def test_an_owner_refuses_a_delta_without_the_verdict_or_not_the_one_scored(run_copy, tiny_config):
    root = run_copy("unscored")
    _, primary, second = two_owners(root, tiny_config)
    me = auth.Identity.generate()
    to_scheduler = LocalTransport(primary.handle).authenticate(me)
    to_owner = LocalTransport(second.handle).authenticate(me, second.identity.public_key)
    to_scheduler.request(m.Hello(peer_id="mallory", device="cpu"))
    offer = to_scheduler.request(m.ClaimTask(peer_id="mallory"))
    assert isinstance(offer, m.TaskOffer) and offer.score_first
    zeros = {
        f"{mid}/{name}": torch.zeros_like(t)
        for mid in offer.module_versions
        for name, t in (second if mid in SECOND else primary).store.params(mid).items()
    }

    def submit(tensors, verdict=""):
        return m.SubmitDelta(
            peer_id="mallory",
            task_id=offer.task_id,
            path=offer.path,
            base_versions=offer.module_versions,
            tokens=1000,
            losses=[1.0],
            tensors={k: v for k, v in tensors.items() if k.split("/")[0] in SECOND},
            ticket=offer.ticket,
            verdict=verdict,
        )

    with pytest.raises(RejectedError, match="no verdict signed by the scheduler") as no_verdict:
        to_owner.request(submit(zeros))
    assert no_verdict.value.reason == "unscored"
    scored = to_scheduler.request(
        m.ScoreDelta(
            peer_id="mallory",
            task_id=offer.task_id,
            path=offer.path,
            base_versions=offer.module_versions,
            tokens=1000,
            tensors=zeros,
            ticket=offer.ticket,
        )
    )
    assert isinstance(scored, m.Scored)
    # Another delta under the verdict: refused; the delta scored: admitted with it.
    other = {k: v + 0.01 for k, v in zeros.items()}
    with pytest.raises(RejectedError, match="is not the one the scheduler scored") as swapped:
        to_owner.request(submit(other, scored.verdict))
    assert swapped.value.reason == "unscored"
    # A ticket is not a verdict (signed for another purpose), nor a verdict a ticket.
    with pytest.raises(RejectedError, match="no verdict signed") as ticket_as_verdict:
        to_owner.request(submit(zeros, offer.ticket))
    assert ticket_as_verdict.value.reason == "unscored"
    ack = to_owner.request(submit(zeros, scored.verdict))
    theirs = [mid for mid in offer.module_versions if mid in SECOND]
    assert isinstance(ack, m.DeltaAck) and ack.accepted == theirs
    counted = second.status().state["rejections_by_peer"]["mallory"]
    assert counted == {"unscored": 3}, counted
