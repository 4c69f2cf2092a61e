"""A run with a sparse codec: the run config's density and error-feedback decay reach the peer,
and the outer step takes the sparse defaults (no momentum, lr 2.5) unless the config sets them."""

import math

import pytest
import torch

from dipaco.config import outer_lr_momentum, preset_config
from dipaco.peer.peer import Peer
from dipaco.prepare.pipeline import prepare
from dipaco.protocols import bitpack, codecs
from dipaco.protocols import messages as m
from dipaco.protocols.transport import LocalTransport
from dipaco.run.factory import build_coordinator
from dipaco.run.metrics_log import MetricsLog


@pytest.mark.parametrize(
    "network, outer, expected, overlap",
    [
        ({"codec": "lossless"}, {}, (0.7, 0.9), False),
        ({"codec": "int8"}, {}, (0.7, 0.9), False),
        ({"codec": "topk2"}, {}, (2.5, 0.0), False),
        ({"codec": "topk4"}, {"lr": 1.0}, (1.0, 0.0), False),
        ({"codec": "topk2"}, {"momentum": 0.5}, (2.5, 0.5), False),
        ({"codec": "sign1"}, {}, (1.0, 0.5), False),
        ({"codec": "sign1"}, {"momentum": 0.9}, (1.0, 0.9), False),
        ({"codec": "lossless"}, {"lr": 0.3, "momentum": 0.0}, (0.3, 0.0), False),
        ({"codec": "int8"}, {}, (0.7, 0.9), True),  # overlap keeps the paper's step
        ({"codec": "int8"}, {"lr": 1.0, "momentum": 0.0}, (1.0, 0.0), True),
    ],
)
def test_the_outer_step_defaults_follow_the_codec_and_give_way_to_the_config(
    network, outer, expected, overlap
):
    c = preset_config("tiny").replace(network=network, outer=outer, scheduler={"overlap": overlap})
    assert outer_lr_momentum(c) == expected
    assert c.network.decay == (0.9 if c.network.sparse else 1.0)
    # What the config file says survives a round trip (unset stays unset).
    again = c.replace()
    assert outer_lr_momentum(again) == expected
    assert again.outer.lr == outer.get("lr")


def run_watching_deltas(short_copy, short_config, network: dict):
    """Two rounds of the short run with ``network``, one peer: the coordinator, the peer, the
    run's config and every SubmitDelta the peer sent."""
    config = short_config.replace(train={"rounds": 2}, network=network)
    root = short_copy()
    prep = prepare(root, short_config)
    prep.config = config  # the network and rounds are the coordinator's, not the data's
    co = build_coordinator(prep, MetricsLog(root / "m.jsonl"), evaluate=False)
    peer = Peer(LocalTransport(co.handle), "solo", root / "peer")
    sent: list[m.SubmitDelta] = []
    ask = peer.links.ask

    def watched(owner, make, doing=""):
        msg = make()
        if isinstance(msg, m.SubmitDelta):
            sent.append(msg)
        return ask(owner, make, doing)

    peer.links.ask = watched
    assert peer.run() == config.build_topology().num_paths * 2
    return co, peer, sent


def test_a_sparse_run_sends_the_configured_share_with_decayed_residuals(short_copy, short_config):
    co, peer, sent = run_watching_deltas(
        short_copy,
        short_config,
        {"codec": "topk2", "topk_density": 0.25, "error_feedback_decay": 0.5},
    )
    assert (co.outer.lr, co.outer.momentum) == (2.5, 0.0)
    assert co.finished and peer.feedback.decay == 0.5
    assert sent and all(msg.codec == "topk2" for msg in sent)
    # Every whole chunk of every delta sent a quarter of its elements, positions as a bitmap.
    big = [
        (name, t)
        for msg in sent
        for name, t in msg.tensors.items()
        if name.endswith("#idx") and t.shape[1] == codecs.SPARSE_CHUNK // 8
    ]
    assert big, "no tensor of a whole chunk or more"
    for name, index in big:
        k = bitpack.mask_positions(index, codecs.SPARSE_CHUNK).shape[1]
        assert k == math.ceil(0.25 * codecs.SPARSE_CHUNK), name


def test_a_sign1_run_sends_a_bit_an_element_and_takes_its_own_outer_step(short_copy, short_config):
    co, peer, sent = run_watching_deltas(short_copy, short_config, {"codec": "sign1"})
    assert (co.outer.lr, co.outer.momentum) == (1.0, 0.5)
    assert co.finished and peer.feedback.decay == 1.0
    assert sent and all(msg.codec == "sign1" for msg in sent)
    for msg in sent:
        for name, t in msg.tensors.items():
            if name.endswith(codecs.SCALE_SUFFIX):
                assert t.dtype == torch.float32 and bool((t >= 0).all()), name
            else:  # one bit an element, 256 elements a block
                assert t.dtype == torch.uint8 and t.shape[1] == codecs.BLOCK // 8, name
    # Every module moved in each of its outer steps, and stayed finite.
    for mid in co.owned_modules():
        assert co.store.version(mid) == 2
        assert all(bool(torch.isfinite(t).all()) for t in co.store.params(mid).values())
