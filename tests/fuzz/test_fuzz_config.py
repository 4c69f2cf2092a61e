"""Fuzzing run configs: a mutated config loads as a RunConfig or raises ConfigError naming it.

Run configs come from users (TOML files) and from run manifests sent by a scheduler, so every
malformed value, unknown key, wrong type or broken file must be a ConfigError, never a pydantic
or TOML exception, a TypeError from a merge, or a UnicodeDecodeError.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _fuzzing import FUZZ, assert_clean_error, byte_mutations, json_mutations
from hypothesis import given
from hypothesis import strategies as st

from dipaco.config import RunConfig, load_config, load_config_dict, preset_config
from dipaco.errors import ConfigError, DipacoError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny.toml"
VALID = preset_config("tiny").to_dict()


def _loads_or_config_error(load, *args) -> RunConfig | None:
    try:
        config = load(*args)
    except DipacoError as exc:
        assert isinstance(exc, ConfigError), type(exc).__name__
        assert_clean_error(exc)
        return None
    except Exception as exc:  # noqa: BLE001 - the property under test
        pytest.fail(f"{type(exc).__name__} escaped {load.__name__}: {exc!r}")
    assert isinstance(config, RunConfig)
    # A config that loads is whole: its derived parts build, and it survives a round trip.
    config.build_topology()
    config.build_model_config()
    assert load_config_dict(config.to_dict()) == config
    return config


@FUZZ
@given(json_mutations(VALID))
def test_mutated_config_dicts_load_or_raise_config_error(data):
    _loads_or_config_error(load_config_dict, data)


@FUZZ
@given(st.one_of(byte_mutations(EXAMPLE.read_bytes()), st.binary(max_size=200)))
def test_mutated_config_files_load_or_raise_config_error(tmp_path_factory, raw):
    path = tmp_path_factory.getbasetemp() / "fuzz-config.toml"
    path.write_bytes(raw)
    _loads_or_config_error(load_config, path)


@pytest.mark.parametrize(
    "text",
    [
        'preset = ["tiny"]\n',
        "preset = 3\n",
        'preset = "nope"\n',
        'preset = "tiny"\nmodel = 3\n',
        'preset = "tiny"\n[train]\nrounds = "many"\n',
        "[model]\ndim = 1e400\n",
        "model = []\n",
    ],
)
def test_odd_presets_and_sections_are_config_errors(tmp_path, text):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ConfigError):
        load_config(path)


def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path):
    path = tmp_path / "run.toml"
    path.write_bytes(b'name = "\xff\xfe"\n')
    with pytest.raises(ConfigError, match="run.toml"):
        load_config(path)
