"""The ``flwr`` CLI: registering SuperNode keys with the SuperLink and submitting runs.

``flwr`` reaches the SuperLink's Control API through the connection that
:func:`~dipaco.flower.deploy.config.write_cli_config` wrote into ``$FLWR_HOME/config.toml``.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from dipaco.errors import ConfigError, TransportError
from dipaco.fileio import write_atomic
from dipaco.flower.deploy.config import ConfigValue, check_config, toml_dumps
from dipaco.flower.deploy.processes import flower_bin, flower_env, strip_ansi
from dipaco.flower.deploy.tls import read_public_key

#: A ServerApp exception is logged as "Exit Code: 201" in the run's log stream, yet
#: ``flwr run --stream`` still exits 0; the run's status is then "finished:failed".
SERVERAPP_FAILED_LOG_LINE = "Exit Code: 201"


def _flwr(home: Path, args: Sequence[str], timeout: float = 60.0) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            [flower_bin("flwr"), *args],
            env=flower_env(home),
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as err:
        raise TransportError(f"flwr {' '.join(args)} timed out after {timeout:.0f} s") from err


def _output(proc: subprocess.CompletedProcess) -> str:
    return strip_ansi((proc.stdout or "") + (proc.stderr or "")).strip()


def register_node(home: Path, superlink_name: str, public_key: str | Path) -> None:
    """Register a SuperNode public key with the SuperLink; an already known key is fine."""
    line = read_public_key(public_key)
    with tempfile.TemporaryDirectory(prefix="dipaco-pub-") as tmp:
        pub = Path(tmp) / "node.pub"
        pub.write_text(line + "\n")
        proc = _flwr(home, ["supernode", "register", str(pub), superlink_name])
    out = _output(proc)
    if proc.returncode == 0:
        return
    if "already in use" in out.lower():  # flwr: "Public key already in use" (exit 1)
        return
    raise ConfigError(
        f"flwr supernode register failed (exit {proc.returncode}) for {line[:40]}...:\n{out}"
    )


def submit_run(
    home: Path,
    app_dir: Path,
    superlink_name: str,
    run_config: Mapping[str, ConfigValue] | None = None,
    *,
    log_file: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen:
    """Start ``flwr run --stream`` in its own process group: it lives as long as the run.

    Run-config keys must already exist in the app's ``[tool.flwr.app.config]``. The values go
    through a TOML file, so any string survives. stdout+stderr go to ``log_file`` (default
    ``home/flwr-run.log``). ``flwr run`` checks that the ``module:attr`` components can be found
    from its own process (app folder + ``sys.path``), so a module outside the installed
    environment needs ``PYTHONPATH`` in ``env`` here as well as in the SuperLink/SuperNode's.
    """
    app_dir = Path(app_dir).resolve()
    if not (app_dir / "pyproject.toml").is_file():
        raise ConfigError(f"{app_dir} is not a Flower app folder (no pyproject.toml)")
    cmd = [flower_bin("flwr"), "run", str(app_dir), superlink_name]
    if run_config:
        import tomllib

        try:
            app_doc = tomllib.loads((app_dir / "pyproject.toml").read_text())
            known = set(app_doc["tool"]["flwr"]["app"].get("config", {}))
        except (tomllib.TOMLDecodeError, KeyError) as err:
            raise ConfigError(f"{app_dir}/pyproject.toml is not a Flower app: {err}") from err
        unknown = sorted(set(run_config) - known)
        if unknown:  # flwr would only say "[code: 15] Invalid run configuration."
            raise ConfigError(
                f"run_config keys {unknown} are not in [tool.flwr.app.config] of {app_dir}"
            )
        Path(home).mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=home, prefix="run-config-", suffix=".toml")
        os.close(fd)
        write_atomic(tmp, toml_dumps(check_config(run_config, "run_config")).encode())
        cmd += ["--run-config", tmp]
    cmd.append("--stream")
    log_path = Path(log_file) if log_file is not None else Path(home) / "flwr-run.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = flower_env(home)
    full_env.update(env or {})
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
        )
