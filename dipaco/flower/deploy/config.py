"""Flower's configuration files: the flat config maps, the app folder and the CLI's config.toml.

Flower configs are flat str/int/float/bool maps. :func:`config_arg` writes one as Flower's
``k=v`` argument (or a TOML file when a value cannot be inlined), :func:`write_app` writes the app
folder's ``pyproject.toml``, :func:`write_cli_config` the ``$FLWR_HOME/config.toml`` through
which the ``flwr`` CLI reaches a SuperLink.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dipaco.errors import ConfigError
from dipaco.fileio import write_atomic

ConfigValue = str | int | float | bool

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")
_APP_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9-]*$")
_OBJECT_REF = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


def toml_dumps(obj: Mapping[str, Any]) -> str:
    """``obj`` as TOML text (tomli_w, a dependency of flwr)."""
    try:
        import tomli_w
    except ImportError as err:  # a dependency of flwr, so present wherever flwr is
        raise ConfigError("tomli_w is missing; install flwr (it depends on tomli_w)") from err
    return tomli_w.dumps(obj)


def check_config(config: Mapping[str, Any], what: str) -> dict[str, ConfigValue]:
    """Flower configs are flat str/int/float/bool maps; reject anything else early."""
    out: dict[str, ConfigValue] = {}
    for key, value in config.items():
        if not isinstance(key, str) or not _BARE_KEY.match(key):
            raise ConfigError(f"{what}: key {key!r} must use letters, digits, '-', '_' or '.'")
        if not isinstance(value, str | int | float | bool):
            raise ConfigError(f"{what}: {key} = {value!r} is not a str, int, float or bool")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{what}: {key} = {value!r} must be finite")
        out[key] = value
    return out


def _inline_value(value: ConfigValue) -> str | None:
    """A TOML value that survives Flower's ``k=v`` parser, or None when it cannot be inlined.

    Flower splits on ``(\\S+?)=('[^']*'|"[^"]*"|\\S+)`` and then parses each value as TOML.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        return None
    if '"' not in value:
        return '"' + value.replace("\\", "\\\\") + '"'
    if "'" not in value:
        return "'" + value + "'"
    return None


def config_arg(config: Mapping[str, Any], spill: Path, what: str) -> str:
    """``k=v k2=v2`` for Flower's ``--node-config``/``--run-config``.

    Values the inline syntax cannot carry go to the TOML file ``spill`` instead, whose path is
    returned (Flower accepts a single ``*.toml`` path in place of the pairs).
    """
    checked = check_config(config, what)
    parts = []
    for key, value in checked.items():
        inline = _inline_value(value)
        if inline is None:
            write_atomic(spill, toml_dumps(checked).encode())
            return str(spill.resolve())
        parts.append(f"{key}={inline}")
    return " ".join(parts)


def write_app(
    folder: Path,
    *,
    server: str,
    client: str,
    config: Mapping[str, ConfigValue],
) -> Path:
    """A Flower app folder holding only ``pyproject.toml``; the code comes from site-packages.

    ``flwr run`` zips every ``*.py``/``*.toml``/``*.md``/``*.json``/``*.yaml`` under the folder
    into the FAB (10 MB cap) and the app processes put the unpacked FAB first on ``sys.path``,
    so the folder must stay free of stray files, above all of a ``dipaco/`` copy that would
    shadow the installed package. No Python file is required.
    """
    for ref, role in ((server, "server"), (client, "client")):
        if not _OBJECT_REF.match(ref):
            raise ConfigError(f"write_app: {role} must be 'module:attr', got {ref!r}")
    doc = {
        "build-system": {"requires": ["hatchling"], "build-backend": "hatchling.build"},
        "project": {
            "name": "dipaco-flower",
            "version": "1.0.0",
            "description": "dipaco as a Flower app",  # flwr warns when these two are missing
            "license": "Apache-2.0",
            "dependencies": [],
        },
        "tool": {
            "flwr": {
                "app": {
                    "publisher": "dipaco",
                    "components": {"serverapp": server, "clientapp": client},
                    "config": check_config(config, "write_app config"),
                }
            }
        },
    }
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / "pyproject.toml", toml_dumps(doc).encode())
    return folder


def write_cli_config(home: Path, name: str, address: str, ca: Path) -> None:
    """``$FLWR_HOME/config.toml`` so ``flwr ... <name>`` reaches the SuperLink's Control API.

    Other connections already in the file are kept; ``name`` becomes the default.
    """
    import tomllib

    if not _APP_NAME.match(name):
        raise ConfigError(f"superlink connection name {name!r}: letters, digits and '-' only")
    path = Path(home) / "config.toml"
    doc: dict[str, Any] = {}
    if path.exists():
        try:
            doc = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path} is not valid TOML: {err}") from err
    links = doc.setdefault("superlink", {})
    ca = Path(ca).resolve()  # flwr requires an absolute path here
    if not ca.is_file():
        raise ConfigError(f"root certificates {ca} do not exist")
    links[name] = {"address": address, "root-certificates": str(ca)}
    links["default"] = name
    write_atomic(path, toml_dumps(doc).encode())
