"""Using a run: a path exported as a Hugging Face Llama matches dipaco's logits; generation."""

from __future__ import annotations

import json

import pytest
import torch

from dipaco.cli.common import command_parser
from dipaco.cli.use import add_use_commands
from dipaco.config import load_config_dict
from dipaco.coordinator.store import ModuleStore
from dipaco.errors import ConfigError, DataError
from dipaco.prepare.pipeline import prepare
from dipaco.run.export import export_path, open_run
from dipaco.run.generate import generate, path_logits, route_tokens


@pytest.fixture(scope="module")
def used_run(tmp_path_factory, prepared_tiny):
    """A prepared tiny run whose modules (v0) are the initial model plus seeded per-module noise,
    so that different paths are different models."""
    import shutil

    root = tmp_path_factory.mktemp("use") / "run"
    shutil.copytree(prepared_tiny, root)
    config = load_config_dict(json.loads((root / "config.json").read_text()), origin="test")
    prep = prepare(root, config)
    modules = config.build_topology().init_modules(prep.initial_state())
    gen = torch.Generator().manual_seed(0)
    for tensors in modules.values():
        for t in tensors.values():
            t.add_(torch.randn(t.shape, generator=gen) * 0.05)
    ModuleStore(root / "coordinator").initialize(modules)
    return open_run(root)


def test_exported_paths_match_dipaco_logits(used_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = torch.tensor([[5, 17, 300, 42, 3, 99, 12, 400, 260, 7]])
    logits = {}
    for path in (0, used_run.topology.num_paths - 1):
        out = export_path(used_run, path, tmp_path / f"P{path}")
        assert (out / "model.safetensors").exists() and (out / "config.json").exists()
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert model.config.vocab_size == used_run.model_config.vocab_size
        assert not model.config.tie_word_embeddings
        with torch.no_grad():
            hf = model(ids).logits.float()
        ours = path_logits(used_run, path, ids)
        torch.testing.assert_close(hf, ours, atol=1e-4, rtol=1e-4)
        logits[path] = ours
    assert not torch.allclose(logits[0], logits[used_run.topology.num_paths - 1], atol=1e-3)

    tok = AutoTokenizer.from_pretrained(tmp_path / "P0")
    ours_tok = used_run.prep.tokenizer
    for text in ["def f(x):\n    return  x + 12  # héllo 😀", "  two\n\nlines\t", "plain text"]:
        assert tok.encode(text, add_special_tokens=False) == ours_tok.encode(text)
        assert tok.encode(text) == ours_tok.encode(text)  # no BOS added, as in training
        assert tok.decode(ours_tok.encode(text)) == text


def test_generate_is_routed_and_deterministic(used_run):
    prompt = "import os\n\ndef main():\n    "
    a = generate(used_run, prompt, max_new_tokens=12, seed=3)
    b = generate(used_run, prompt, max_new_tokens=12, seed=3)
    assert a == b
    assert a["text"] and 0 <= a["path"] < used_run.topology.num_paths
    assert a["paths_used"] == [a["path"]]
    expected = route_tokens(used_run, used_run.prep.tokenizer.encode(prompt))
    assert a["path"] == expected
    r = generate(used_run, prompt, max_new_tokens=12, seed=3, reroute_every=4)
    assert r["path"] == a["path"] and len(r["paths_used"]) == 3
    assert all(0 <= p < used_run.topology.num_paths for p in r["paths_used"])


def test_bad_inputs_give_clear_errors(used_run, tmp_path):
    n = used_run.topology.num_paths
    with pytest.raises(ConfigError, match=f"numbered 0 to {n - 1}"):
        export_path(used_run, n, tmp_path / "bad")
    with pytest.raises(ConfigError, match="does not exist"):
        path_logits(used_run, -1, [1, 2, 3])
    with pytest.raises(DataError, match="does not exist"):
        open_run(tmp_path / "missing")
    with pytest.raises(DataError, match="empty prompt"):
        generate(used_run, "", max_new_tokens=2)


def test_cli_commands(used_run, tmp_path, capsys):
    from dipaco.cli.common import run_command

    parser, sub = command_parser("dipaco", None)
    add_use_commands(sub)
    root = str(used_run.prep.root)
    args = parser.parse_args(["generate", "x = 1\n", "--run-dir", root, "--max-new-tokens", "5"])
    args.json = True
    assert run_command(lambda: args.fn(args)) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) >= {"text", "path", "paths_used"}
    bad = parser.parse_args(["export", "--run-dir", root, "--path", "99", "--out", str(tmp_path)])
    assert run_command(lambda: bad.fn(bad)) == 2
    assert "path 99 does not exist" in capsys.readouterr().out
