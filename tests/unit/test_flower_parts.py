"""The Flower transport's parts one at a time: keys and certificates, records from the network,
the node's relay transport. (The whole runs are in test_flower_grid.py and, with a real
SuperLink, tests/integration/test_flower_run.py.)"""

from __future__ import annotations

import ipaddress
import json
import tomllib
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client

import numpy as np
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from dipaco.errors import ConfigError, TransportError, WireError
from dipaco.flower import deploy, forward
from dipaco.flower import records as rec
from dipaco.flower.client import NodeState, NodeTrainer, RelayTransport
from dipaco.protocols import auth
from dipaco.protocols import messages as m


def test_node_keys_are_p384_private_and_stable(tmp_path):
    key = tmp_path / "node.key"
    line = deploy.make_node_key(key)
    assert line.startswith("ecdsa-sha2-nistp384 ")
    assert key.stat().st_mode & 0o777 == 0o600
    assert deploy.make_node_key(key) == line  # a restart keeps the node's identity
    assert (tmp_path / "node.pub").read_text().strip() == line
    assert deploy.read_public_key(tmp_path / "node.pub") == line
    assert deploy.read_public_key(f"  {line}  ") == line


def test_keys_flower_would_refuse_are_refused_with_a_clear_error(tmp_path):
    ed = ed25519.Ed25519PrivateKey.generate().public_key()
    line = ed.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    with pytest.raises(ConfigError, match="SECP384R1"):
        deploy.read_public_key(line.decode())
    with pytest.raises(ConfigError, match="not an OpenSSH public key"):
        deploy.read_public_key("ecdsa-sha2-nistp384 AAAAnotbase64!!")
    with pytest.raises(ConfigError, match="neither a key line nor a file"):
        deploy.read_public_key(str(tmp_path / "missing.pub"))


def test_the_runs_certificate_names_the_listen_address(tmp_path):
    tls = deploy.make_tls(tmp_path / "tls", ["127.0.0.1", "localhost"])
    cert = x509.load_pem_x509_certificate(tls.cert.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("127.0.0.1") in san.get_values_for_type(x509.IPAddress)
    assert "localhost" in san.get_values_for_type(x509.DNSName)
    ca = x509.load_pem_x509_certificate(tls.ca.read_bytes())
    assert cert.issuer == ca.subject
    assert tls.key.stat().st_mode & 0o777 == 0o600
    again = deploy.make_tls(tmp_path / "tls", ["127.0.0.1", "localhost"])
    assert again.ca.read_bytes() == tls.ca.read_bytes()  # peers keep the CA they were given


def test_the_app_folder_names_dipacos_apps_and_nothing_else(tmp_path):
    app = deploy.write_app(
        tmp_path / "app",
        server="dipaco.flower.apps:server_app",
        client="dipaco.flower.apps:client_app",
        config={"run-dir": "/runs/r1", "eval": True},
    )
    doc = tomllib.loads((app / "pyproject.toml").read_text())
    flwr = doc["tool"]["flwr"]["app"]
    assert flwr["components"] == {
        "serverapp": "dipaco.flower.apps:server_app",
        "clientapp": "dipaco.flower.apps:client_app",
    }
    assert flwr["config"] == {"run-dir": "/runs/r1", "eval": True}
    assert [p.name for p in app.iterdir()] == ["pyproject.toml"]
    with pytest.raises(ConfigError):
        deploy.write_app(tmp_path / "x", server="not a ref", client="a:b", config={})


def test_node_config_strings_survive_quoting(tmp_path):
    arg = deploy.config_arg({"state-dir": "/a b/c", "n": 3}, tmp_path / "spill.toml", "node")
    assert arg == 'state-dir="/a b/c" n=3'
    tricky = deploy.config_arg({"label": 'node "0" it\'s'}, tmp_path / "spill.toml", "node")
    assert tomllib.loads((tmp_path / "spill.toml").read_text()) == {"label": 'node "0" it\'s'}
    assert tricky.endswith("spill.toml")


@pytest.mark.parametrize(
    "state",
    [
        "[1, 2",
        "[]",
        json.dumps({"modules": {"L0.M0": "3"}}),
        json.dumps({"paths": ["0"]}),
        json.dumps({"files": {"a": 1}}),
        "x" * (rec.MAX_STATE_BYTES + 1),
        "[" * 100_000,
    ],
)
def test_a_malformed_node_report_is_a_wire_error(state):
    with pytest.raises(WireError):
        rec.state_report({"state": state})


def test_records_carry_bytes_and_refuse_other_arrays():
    content = rec.pack({"op": "train", "raw": b"\x00\x01"}, {"frame": b"abc"}, {"f": b"xyz"})
    assert rec.blob(content, "frame") == b"abc"
    assert rec.files_of(content) == {"f": b"xyz"}
    assert rec.raw(rec.meta_of(content), "raw") == b"\x00\x01"
    floats = RecordDict(
        {
            rec.META: ConfigRecord({"op": "train"}),
            rec.BLOBS: ArrayRecord({"frame": Array(np.zeros(3, dtype=np.float32))}),
        }
    )
    with pytest.raises(WireError, match="uint8"):
        rec.blob(floats, "frame")
    with pytest.raises(WireError, match="no dipaco record"):
        rec.meta_of(RecordDict({}))
    with pytest.raises(WireError, match="must be bytes"):
        rec.raw({"welcome": "text"}, "welcome")


def _offer() -> m.TaskOffer:
    return m.TaskOffer(
        task_id="P1-r0-e0-a0",
        path=1,
        round=0,
        module_versions={"A": 0},
        inner_steps=2,
        step_offset=0,
        total_steps=10,
        lease_seconds=30.0,
        seed=0,
    )


def test_the_relay_answers_from_the_message_and_seals_the_delta_with_the_node_key():
    me = auth.Identity.generate()
    welcome = m.Welcome(run_id="r", config={})
    modules = m.Modules(versions={"A": 0}, hashes={"A": "h"})
    relay = RelayTransport(welcome, _offer(), modules, {"shards/P1/train.json": b"{}"})
    relay.authenticate(me, "ed25519:x")
    assert relay.request(m.Hello(peer_id="p")) is welcome
    assert relay.request(m.FetchModules(peer_id="p", task_id="P1-r0-e0-a0")) is modules
    with pytest.raises(TransportError):
        relay.request(m.FetchModules(peer_id="p", task_id="another"))
    chunk = relay.request(m.FetchFile(peer_id="p", name="shards/P1/train.json", offset=0, length=8))
    assert chunk.tensors["data"].numpy().tobytes() == b"{}"
    with pytest.raises(TransportError, match="did not send"):
        relay.request(m.FetchFile(peer_id="p", name="shards/P2/train.json", offset=0, length=8))
    delta = m.SubmitDelta(
        peer_id="p",
        task_id="P1-r0-e0-a0",
        path=1,
        base_versions={"A": 0},
        tokens=10,
        losses=[1.0],
        tensors={"A/w": torch.ones(2)},
    )
    ack = relay.request(delta)
    assert ack.accepted == ["A"]
    signed = auth.open_request(relay.submitted)
    assert signed.key == me.public_key
    assert m.decode_message(signed.body).tensors["A/w"].tolist() == [1.0, 1.0]
    with pytest.raises(TransportError, match="cannot be relayed"):
        relay.request(m.GetOwners())


def test_a_node_keeps_its_key_id_and_pinned_coordinator_across_messages(tmp_path):
    first = NodeState(tmp_path, {"superlink": "127.0.0.1:9092"})
    assert first.coordinator_key("ed25519:AAA") == "ed25519:AAA"  # trusted on first use
    again = NodeState(tmp_path, {"superlink": "127.0.0.1:9092"})
    assert again.identity.public_key == first.identity.public_key
    assert again.peer_id == first.peer_id
    assert again.coordinator_key("ed25519:EVIL") == "ed25519:AAA"  # pinned: not replaced
    hello = auth.open_request(again.hello())
    assert hello.key == first.identity.public_key
    assert m.decode_message(hello.body).peer_id == first.peer_id


def test_trainer_frames_round_trip_and_refuse_damage():
    meta = {"op": "train", "welcome": b"\x00\xff", "state": "{}", "n": 3}
    parts = {"blob:modules": b"abc", "file:shards/P0/train.json": b""}
    op, got_meta, got_parts = forward.decode(forward.encode("train", meta, parts))
    assert (op, got_meta, got_parts) == ("train", meta, parts)
    good = forward.encode("train", meta, parts)
    for bad in (b"", b"XXXX" + good[4:], good[:-1], good + b"!", good[:10]):
        with pytest.raises(WireError):
            forward.decode(bad)


def test_a_warm_trainer_answers_the_clientapp_and_refuses_strangers(tmp_path):
    trainer = NodeTrainer({"state-dir": str(tmp_path / "node")})
    try:
        cfg = {"state-dir": str(tmp_path / "node"), **trainer.node_config}
        assert (tmp_path / "node" / "flower" / "trainer.key").stat().st_mode & 0o777 == 0o600
        reply = forward.ask(cfg, "hello", rec.pack({"op": "hello"}))
        hello = auth.open_request(rec.blob(reply, "envelope"))
        assert hello.key == NodeState(tmp_path / "node", {}).identity.public_key
        # Without the key file's secret the connection is refused.
        host, _, port = trainer.server.address.rpartition(":")
        with pytest.raises(AuthenticationError):
            Client((host, int(port)), authkey=b"not the key")
    finally:
        trainer.close()
