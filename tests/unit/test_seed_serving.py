"""Serving modules peer to peer, one part at a time: what a peer serves (``SeedServer``), what
it keeps (``Held``), and what it accepts from another peer (``SeedFetcher``'s check). The
whole path over real hivemind nodes is tests/integration/test_modules_peer_to_peer.py."""

import random
import time

import torch

from dipaco.cli.peer_report import seed_summary
from dipaco.peer import seeds
from dipaco.peer.seeds import SEED_BURST, Held, Release, SeedFetcher, SeedServer, seed_key
from dipaco.protocols import auth
from dipaco.protocols import messages as m
from dipaco.protocols.addresses import announceable, reachable
from dipaco.protocols.reasons import Reason
from dipaco.protocols.transport import LocalTransport
from dipaco.protocols.wire import tensors_sha256

TENSORS = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}
DIGEST = tensors_sha256(TENSORS)


def release(version: int = 3) -> Release:
    return Release(version, DIGEST, "sig", dict(TENSORS))


def serving() -> tuple[SeedServer, auth.Identity]:
    me = auth.Identity.generate()
    held = Held()
    held.put("L0.M1", release())
    return SeedServer(me, held), me


def ask(server: SeedServer, me: auth.Identity, msg):
    return (
        LocalTransport(server.handle)
        .authenticate(auth.Identity.generate(), me.public_key)
        .request(msg)
    )


def test_a_held_version_is_served_with_the_owners_release():
    server, me = serving()
    reply = ask(server, me, m.FetchSeed(peer_id="p", module="L0.M1", version=3))
    assert reply.versions == {"L0.M1": 3} and reply.hashes == {"L0.M1": DIGEST}
    assert reply.signatures == {"L0.M1": "sig"}
    assert {k: v.tolist() for k, v in reply.tensors.items()} == {
        f"L0.M1/{k}": v.tolist() for k, v in TENSORS.items()
    }
    assert server.served == 1 and server.bytes_out == 9 * 4


def test_what_is_not_held_or_not_a_seed_request_is_refused_and_counted():
    server, me = serving()
    for msg, reason in [
        (m.FetchSeed(peer_id="p", module="L0.M1", version=2), Reason.NOT_HELD),  # an old one
        (m.FetchSeed(peer_id="p", module="L9.M9", version=3), Reason.NOT_HELD),
        (m.GetStatus(), Reason.BAD_MESSAGE),
    ]:
        try:
            ask(server, me, msg)
        except Exception as exc:  # noqa: BLE001 - the refusal, as the asking peer sees it
            assert getattr(exc, "reason", None) == reason, exc
        else:
            raise AssertionError(f"{msg} was answered")
    assert server.refused == {Reason.NOT_HELD: 2, Reason.BAD_MESSAGE: 1} and server.served == 0


def test_a_replayed_or_unsigned_request_is_refused():
    server, me = serving()
    sealed, nonce = auth.seal_request(
        auth.Identity.generate(),
        m.encode_message(m.FetchSeed(peer_id="p", module="L0.M1", version=3)),
    )
    first = auth.open_reply(server.handle(sealed), nonce, me.public_key)
    assert isinstance(m.decode_message(first.body), m.Modules)
    again = m.decode_message(auth.open_reply(server.handle(sealed), nonce, me.public_key).body)
    assert isinstance(again, m.Error) and again.reason == Reason.REPLAY
    garbage = m.decode_message(auth.open_reply(server.handle(b"\x00" * 40), "", None).body)
    assert isinstance(garbage, m.Error)
    assert server.served == 1 and sum(server.refused.values()) == 2


def test_held_keeps_the_newest_version_of_each_module():
    held = Held()
    assert held.put("M", release(2)) and not held.put("M", release(1))
    assert held.get("M", 2) is not None and held.get("M", 1) is None
    assert held.put("M", release(4)) and held.get("M", 2) is None


def fetcher() -> SeedFetcher:
    return SeedFetcher(None, "run", auth.Identity.generate(), "me", serving=False)


def test_a_module_that_is_not_the_signed_release_is_refused_and_its_holder_dropped():
    f = fetcher()
    good = m.Modules({"M": 3}, {"M": DIGEST}, {f"M/{k}": v for k, v in TENSORS.items()})
    assert f._checked("h0", good, "M", 3, DIGEST) is not None
    tampered = dict(good.tensors)
    tampered["M/b"] = torch.full((3,), 2.0)
    extra = {**good.tensors, "N/x": torch.zeros(1)}
    renamed = {"M/w2": TENSORS["w"], "M/b": TENSORS["b"]}
    for i, reply in enumerate(
        [
            m.Modules({"M": 3}, {"M": DIGEST}, tampered),  # one value changed, hash kept
            m.Modules({"M": 3}, {"M": DIGEST}, extra),  # another module smuggled in
            m.Modules({"M": 3}, {"M": DIGEST}, renamed),
            m.Modules({"M": 2}, {"M": DIGEST}, good.tensors),  # another version
            m.Modules({"M": 3}, {"M": "0" * 64}, good.tensors),  # another release
            m.Error(reason="x", message="y"),
        ]
    ):
        assert f._checked(f"h{i + 1}", reply, "M", 3, DIGEST) is None
    assert f.refused == {f"h{i}": 1 for i in range(1, 7)}
    assert f.bad == {f"h{i}" for i in range(1, 7)}


class Records:
    """A DHT's answer for one key (the holders of a module version), as a node returns it."""

    peer_id = "self"

    def __init__(self, found):
        self.found = found

    def get(self, key):
        return self.found


def test_holders_are_the_well_formed_records_of_others_fastest_first():
    ok = {"key": "k", "addresses": ["/ip4/127.0.0.1/tcp/1"]}
    f = fetcher()
    f.node = Records(
        {
            "self": ok,  # this peer
            "slow": ok,
            "fast": ok,
            "banned": ok,
            "no-key": {"addresses": []},
            "bad-addresses": {"key": "k", "addresses": "x"},
            "not-a-dict": [1, 2],
            7: ok,
        }
    )
    f.bad.add("banned")
    f.speed.update({"slow": 1.0, "fast": 100.0})
    assert [h for h, _ in f.holders("M", 1)] == ["fast", "slow"]
    f.node = Records(["not", "a", "dict"])
    assert f.holders("M", 1) == []


def test_a_holder_behind_another_nat_is_never_chosen(monkeypatch):
    # A serving peer behind a home router announces its LAN address: peers elsewhere cannot
    # dial it (judged from inside real networks in tests/integration/test_internet.py).
    monkeypatch.setattr(seeds, "reachable", lambda a: not a.startswith("/ip4/192.168.7."))
    f = fetcher()
    lan = {"key": "k", "addresses": ["/ip4/192.168.7.2/tcp/1"]}
    both = {"key": "k", "addresses": ["/ip4/192.168.7.3/tcp/1", "/ip4/198.18.0.9/tcp/1"]}
    f.node = Records({"behind": lan, "both": both})
    assert f.holders("M", 1) == [("both", {"key": "k", "addresses": ["/ip4/198.18.0.9/tcp/1"]})]
    assert f.unreachable == {"behind"} and f.counts()["unreachable"] == 1
    assert "1 serving peer(s) behind another NAT skipped" in seed_summary(f, None)


def test_a_serving_peer_announces_no_loopback_address_unless_it_has_no_other():
    assert announceable(["/ip4/127.0.0.1/tcp/5", "/ip4/192.168.1.2/tcp/5"]) == [
        "/ip4/192.168.1.2/tcp/5"
    ]
    assert announceable(["/ip4/127.0.0.1/tcp/5"]) == ["/ip4/127.0.0.1/tcp/5"]  # one machine
    assert reachable("/ip4/127.0.0.1/tcp/5") and reachable("/dns4/example.org/tcp/5")
    assert reachable("/ip4/198.18.0.9/tcp/5")  # not a network kept behind a router
    # Anyone writes the DHT's records: malformed or relayed addresses never raise.
    for junk in ("/ip4/8.8.8.8/tcp/1/p2p-circuit/p2p/", "/ip4/999.1.1.1/tcp/1", "", "/ip4"):
        assert reachable(junk) in (True, False)
    assert not reachable("/ip4/192.168.254.77/tcp/1/p2p/R/p2p-circuit/p2p/T") or reachable(
        "/ip4/192.168.254.77/tcp/1"
    )  # a relayed address is judged by its relay's


class LaterRecords:
    """A DHT where another peer holds ``held`` (module, version) and announces ``later`` 0.3 s
    from now."""

    peer_id = "self"

    def __init__(self, later, held=()):
        self.later, self.held, self.at = later, held, time.monotonic() + 0.3

    def get(self, key):
        ok = {"other": {"key": "k", "addresses": ["/ip4/127.0.0.1/tcp/1"]}}
        keys = [seed_key("run", mid, v) for mid, v in self.held]
        if time.monotonic() >= self.at:
            keys += [seed_key("run", mid, v) for mid, v in self.later]
        return ok if key in keys else None


def test_the_runs_first_versions_and_successors_of_shared_ones_wait_for_a_holder():
    # Every peer that starts with the run wants the version-0 modules at once: one fetches
    # from the owner, announces, and the others wait for it rather than all asking the owner.
    f = fetcher()
    f.wait = 30.0
    random.seed(1)  # waits drawn past 0.3 s
    f.node = LaterRecords([("M", 0)])
    assert f.find({"M": 0}) == {"M": 0}
    # A later version waits only if someone else held its previous one (else no one serves).
    f.node = LaterRecords([("N", 5)])
    assert f.find({"N": 5}) == {}  # nobody held N v4: asked of the owner at once
    f.node = LaterRecords([("N", 5)], held=[("N", 4)])
    assert f.find({"N": 5}) == {"N": 5}


class Unreachable(Records):
    """A DHT whose records name addresses no transport can dial."""

    def transport(self, holder, addresses, timeout):
        raise ValueError(f"invalid multiaddr {addresses[0]!r}")


def test_a_holder_whose_record_cannot_be_dialled_is_skipped_for_good():
    f = fetcher()
    f.node = Unreachable({"junk": {"key": "k", "addresses": ["not an address"]}})
    assert f.fetch("M", 1, DIGEST) is None  # no exception: the owner serves it instead
    assert f.bad == {"junk"} and not f.refused and f.from_seeds == 0


class Announcements(Records):
    """Records what a serving peer announces (the DHT's ``store``)."""

    def __init__(self):
        super().__init__({})
        self.stored: list[tuple[str, float]] = []

    def visible_maddrs(self):
        return ["/ip4/127.0.0.1/tcp/1/p2p/self"]

    def store(self, key, value, ttl, subkey=None):
        self.stored.append((key, ttl))
        return True


def test_a_serving_peer_announces_each_version_once_and_again_before_its_record_expires(
    monkeypatch,
):
    from dipaco.peer import seeds

    clock = [100.0]
    monkeypatch.setattr(seeds.time, "monotonic", lambda: clock[0])
    f = SeedFetcher(Announcements(), "run", auth.Identity.generate(), "me", serving=True)
    f.hold("M", release(1))
    f.hold("M", release(1))  # trained from again a minute later: no new record
    clock[0] += 60
    f.hold("M", release(1))
    assert [k for k, _ in f.node.stored] == ["dipaco.run.seeds.M.v1"]
    clock[0] += seeds.SEED_TTL / 2  # half the record's life: announced again
    f.hold("M", release(1))
    f.hold("M", release(0))  # an older version than the one held: never announced
    f.hold("M", release(2))
    assert [k for k, _ in f.node.stored] == ["dipaco.run.seeds.M.v1"] * 2 + [
        "dipaco.run.seeds.M.v2"
    ]
    quiet = SeedFetcher(Announcements(), "run", auth.Identity.generate(), "me", serving=False)
    quiet.hold("M", release(1))  # client mode: holds (for nothing) and announces nothing
    assert quiet.node.stored == [] and quiet.held.get("M", 1) is not None


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def refusal(server: SeedServer, me: auth.Identity, asker: auth.Identity, msg) -> str | None:
    """The reason ``asker``'s request is refused with, or None when it is served."""
    link = LocalTransport(server.handle).authenticate(asker, me.public_key)
    try:
        link.request(msg)
    except Exception as exc:  # noqa: BLE001 - the refusal, as the asking peer sees it
        return getattr(exc, "reason", repr(exc))
    return None


def test_one_key_gets_its_share_of_a_serving_peers_upload_and_no_more(monkeypatch):
    me, held, clock = auth.Identity.generate(), Held(), Clock()
    held.put("L0.M1", release(3))
    server = SeedServer(me, held, clock=clock)
    greedy, other = auth.Identity.generate(), auth.Identity.generate()
    fetch = m.FetchSeed(peer_id="g", module="L0.M1", version=3)
    # One version, at most twice per key (a retry after a lost reply): then from its owner.
    assert [refusal(server, me, greedy, fetch) for _ in range(3)] == [None, None, "rate-limited"]
    assert refusal(server, me, other, fetch) is None  # another key is not held back by it
    held.put("L0.M1", release(4))  # a new version: fetched afresh
    new = m.FetchSeed(peer_id="g", module="L0.M1", version=4)
    assert refusal(server, me, greedy, new) is None
    # Requests: a burst of SEED_BURST, then one a second (refusals spend tokens too).
    spent = 4  # the greedy key's requests so far
    asked = [refusal(server, me, greedy, m.FetchSeed("g", "L9.M9", 1)) for _ in range(8)]
    assert asked == ["not-held"] * (SEED_BURST - spent) + ["rate-limited"] * (
        8 - SEED_BURST + spent
    )
    clock.now += 2.0
    assert refusal(server, me, greedy, m.FetchSeed("g", "L9.M9", 1)) == "not-held"
    assert server.served == 4 and server.refused["rate-limited"] == 1 + 8 - SEED_BURST + spent
    # The counts of the least recent keys are forgotten beyond SEED_KEYS: bounded memory.
    assert server._uses.keys == seeds.SEED_KEYS
    monkeypatch.setattr(server._uses, "keys", 3)
    for _ in range(3):
        refusal(server, me, auth.Identity.generate(), fetch)
    assert len(server._uses) == 3 and greedy.public_key not in server._uses
