"""Modules peer to peer over real hivemind nodes (a DHT and libp2p streams on 127.0.0.1).

A coordinator serves the tiny 2x2 run; three peers that can be dialled serve the module
versions they hold (``SeedServer``) and fetch from one another (``SeedFetcher``); one of them is
hostile and changes a value in every module it serves, keeping the owner's signed hash; a fourth
peer runs in client mode, so it cannot be dialled: it serves nobody and still trains.
"""

from __future__ import annotations

import threading
import time

import torch

from dipaco.peer.peer import Peer
from dipaco.peer.seeds import SeedFetcher, SeedServer, seed_key
from dipaco.prepare.pipeline import prepare
from dipaco.protocols import auth
from dipaco.protocols import messages as m
from dipaco.protocols.hivemind import HivemindNode
from dipaco.run.factory import build_coordinator
from dipaco.run.metrics_log import MetricsLog


class Tampering(SeedServer):
    """A hostile holder: serves what it holds with one value changed, under the true hash."""

    def _serve(self, req: m.FetchSeed, *args) -> m.Modules:
        reply = super()._serve(req, *args)
        name = sorted(reply.tensors)[0]
        bad = reply.tensors[name].clone()
        bad.view(-1)[0] += 1.0
        return m.Modules(
            versions=reply.versions,
            hashes=reply.hashes,
            tensors={**reply.tensors, name: bad},
            signatures=reply.signatures,
        )


def test_peers_serve_modules_to_each_other_and_refuse_a_tampered_one(short_copy, short_config):
    config = short_config.replace(
        train={"rounds": 3}, scheduler={"quorum": 1.0, "heartbeat_seconds": 1.0}
    )
    root = short_copy()
    prep = prepare(root, short_config)
    prep.config = config
    co = build_coordinator(prep, MetricsLog(root / "m.jsonl"), evaluate=False)
    run_id = co.run_id
    owner = HivemindNode()
    nodes = [owner]
    peers: list[Peer] = []
    try:
        owner.serve(co.handle)
        entry = owner.visible_maddrs()

        def make_peer(name: str, serving: bool, server_cls=SeedServer):
            node = HivemindNode(initial_peers=entry, client_mode=not serving)
            nodes.append(node)
            identity = auth.Identity.generate()
            fetcher = SeedFetcher(node, run_id, identity, name, serving=serving, timeout=20.0)
            server = None
            if serving:
                server = server_cls(identity, fetcher.held)
                node.serve(server.handle, workers=2)
            links = []

            def connect(owner_id, addresses):
                t = node.transport(owner_id, addresses)
                links.append(t)
                return t

            peer = Peer(
                connect(owner.peer_id, entry).authenticate(identity, co.identity.public_key),
                name,
                root / "peers" / name,
                identity=identity,
                connect=connect,
                seeds=fetcher,
                stop=stop,
            )
            peers.append(peer)
            return peer, fetcher, server, node, links

        stop = threading.Event()
        hostile = make_peer("hostile", True, Tampering)
        honest = [make_peer(f"seeder{i}", True) for i in range(2)]
        shy = make_peer("shy", False)
        # The hostile peer starts first, so that it is the first holder of round 0's modules.
        threads = [threading.Thread(target=hostile[0].run, daemon=True)]
        threads[0].start()
        deadline = time.monotonic() + 60
        while not hostile[1].held._releases and time.monotonic() < deadline:
            time.sleep(0.1)
        assert hostile[1].held._releases, "the hostile peer never held a module"
        for peer, *_ in [*honest, shy]:
            threads.append(threading.Thread(target=peer.run, daemon=True))
            threads[-1].start()
        for t in threads:
            t.join(240)
        assert not any(t.is_alive() for t in threads), "a peer did not finish"
        assert co.finished
        runs = [hostile[0], *(h[0] for h in honest), shy[0]]
        assert all(p.run_finished for p in runs), [p.error for p in runs]

        tampered = hostile[2].served
        fetchers = [hostile[1], *(h[1] for h in honest), shy[1]]
        refused = sum(sum(f.refused.values()) for f in fetchers)
        # Every tampered module that was sent was refused and counted, and none of them was
        # trained on: the run finished, every module's final hash is the owner's own.
        assert tampered >= 1
        assert refused == tampered
        assert all(f.refused.get(hostile[3].peer_id, 0) <= 1 for f in fetchers)
        # ...and each was then fetched from an honest holder or from the owner.
        assert sum(f.from_seeds for f in fetchers) >= 1  # honest peers served each other
        assert sum(h[2].served for h in honest) >= 1
        # The peer in client mode trained, fetched, and announced nothing.
        assert shy[0].tasks_done >= 1
        assert shy[2] is None and shy[3].visible_maddrs() == []
        for mid in co.topology.module_ids():
            for v in range(config.train.rounds):
                holders = owner.get(seed_key(run_id, mid, v)) or {}
                assert shy[3].peer_id not in holders
        # Every module a peer trained from matched its owner's signed release.
        for peer in peers:
            for mid, (version, tensors) in peer.cache.items():
                if co.store.modules[mid].version == version:
                    for name, t in tensors.items():
                        assert torch.equal(t, co.store.params(mid)[name])
    finally:
        stop.set()
        for peer in peers:
            if peer.seeds is not None:
                peer.seeds.close()
        for node in reversed(nodes):
            node.shutdown()
