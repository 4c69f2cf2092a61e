import subprocess
import sys
from pathlib import Path

import pytest

from dipaco.config import load_config, preset_config
from dipaco.errors import ConfigError
from dipaco.prepare.pipeline import prepare


def test_toml_config_starts_from_a_preset_and_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('preset = "tiny"\n[train]\nrounds = 7\n[topology]\nlevels = "1"\n')
    config = load_config(path)
    assert config.train.rounds == 7 and config.model.dim == preset_config("tiny").model.dim
    assert config.build_topology().num_paths == 1


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("[train]\nlr = -1\n", "train.lr"),
        ("[train]\nlearning_rate = 0.1\n", "train.learning_rate"),
        ('[topology]\nlevels = "2by2"\n', "2by2"),
        ("[model]\ndim = 130\nn_heads = 4\n", "model.dim"),
        ('[routing]\nmethod = "magic"\n', "routing.method"),
        ('preset = "huge"\n', "unknown preset"),
        ("[routing]\noverlap = 5\n", "routing.overlap"),
        ("[routing]\ndiscriminative_after = [8]\n", "routing.discriminative_after"),
        ('[routing]\nmethod = "iid"\ndiscriminative_after = [2]\n', "iid"),
        ("[topology]\nreplicas = 0\n", "topology.replicas"),
        ("[eval]\nreroute_windows = [0]\n", "eval.reroute_windows"),
        ("[train\n", "not valid TOML"),
    ],
)
def test_bad_configs_name_the_field(tmp_path, text, names):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=names.replace(".", r"\.")):
        load_config(path)


def test_cli_reports_a_bad_config_in_one_line_and_exits_2(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[train]\nrounds = 0\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dipaco.cli.main",
            "demo",
            "--config",
            str(path),
            "--run-dir",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "train.rounds" in proc.stdout and "Traceback" not in proc.stdout + proc.stderr


def test_a_run_folder_refuses_a_different_config(prepared_tiny, tiny_config, tmp_path):
    import shutil

    root = tmp_path / "run"
    shutil.copytree(prepared_tiny, root)
    with pytest.raises(ConfigError, match="model"):
        prepare(root, tiny_config.replace(model={"dim": 64}))
    # Operational settings may change on resume.
    prep = prepare(root, tiny_config.replace(scheduler={"lease_seconds": 99.0}))
    assert prep.config.scheduler.lease_seconds == 99.0
    assert Path(root / "config.json").exists()
