import argparse
import re

import pytest

from dipaco.cli.init import FIELDS, add_init_command, field_names, render_config, write_config
from dipaco.config import load_config, preset_config
from dipaco.errors import ConfigError


@pytest.mark.parametrize(
    ("preset", "topology"), [("tiny", None), ("demo", None), ("tiny", "1"), ("demo", "4x1")]
)
def test_init_then_load_equals_the_preset(tmp_path, preset, topology):
    out = write_config(tmp_path / "run.toml", preset, topology)
    loaded = load_config(out)
    expected = preset_config(preset)
    if topology is not None:
        expected = expected.replace(topology={"levels": topology})
    assert loaded == expected
    assert loaded.content_hash() == expected.content_hash()
    if topology is not None:
        assert loaded.topology.levels == topology


def test_every_field_has_a_comment():
    assert set(field_names()) == set(FIELDS), "config.py and dipaco init's comments disagree"
    lines = render_config("tiny").splitlines()
    for dotted in field_names():
        section, _, name = dotted.rpartition(".")
        start = lines.index(f"[{section}]") if section else 0
        pattern = re.compile(rf"^(# )?{re.escape(name)} = ")
        at = next(i for i in range(start, len(lines)) if pattern.match(lines[i]))
        comment = lines[at - 1]
        assert comment.startswith("# ") and "Allowed:" in comment, dotted
        assert len(comment) > len("# . Allowed: ."), dotted


def test_refuses_to_overwrite_without_force(tmp_path):
    out = tmp_path / "run.toml"
    out.write_text("keep me\n")
    with pytest.raises(ConfigError, match="--force"):
        write_config(out, "tiny")
    assert out.read_text() == "keep me\n"
    write_config(out, "tiny", force=True)
    assert load_config(out) == preset_config("tiny")


def test_cli_parser_and_command(tmp_path):
    parser = argparse.ArgumentParser()
    add_init_command(parser.add_subparsers(dest="command"))
    out = tmp_path / "sub" / "r.toml"
    args = parser.parse_args(["init", "--preset", "tiny", "--topology", "1", "--out", str(out)])
    assert args.fn(args) == 0
    assert load_config(out).build_topology().num_paths == 1
    with pytest.raises(ConfigError, match="already exists"):
        args.fn(args)


@pytest.mark.parametrize(
    ("preset", "topology", "names"),
    [
        ("huge", None, "preset: unknown preset 'huge'; allowed: demo, tiny"),
        ("tiny", "2by2", "topology.levels: '2by2'"),
        ("tiny", "0x2", "topology.levels"),
    ],
)
def test_bad_preset_or_topology_names_the_field(tmp_path, preset, topology, names):
    with pytest.raises(ConfigError, match=re.escape(names)):
        write_config(tmp_path / "run.toml", preset, topology)
    assert not (tmp_path / "run.toml").exists()


def test_uneven_topology_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="topology '2x2x2'.*levels"):
        write_config(tmp_path / "run.toml", "demo", "2x2x2")  # 4 blocks, 3 levels


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [
        ("rounds = 3", 'rounds = "three"', "train.rounds"),
        ("rounds = 3", "rounds = 3\nlearning_rate = 0.1", "train.learning_rate"),
        ('codec = "lossless"', 'codec = "zip"', "network.codec"),
        ("quorum = 1.0", "quorum = 2.0", "scheduler.quorum"),
    ],
)
def test_a_bad_edit_names_the_field(tmp_path, old, new, field):
    out = write_config(tmp_path / "run.toml", "tiny")
    text = out.read_text()
    assert old in text
    out.write_text(text.replace(old, new, 1))
    with pytest.raises(ConfigError, match=re.escape(field)):
        load_config(out)
