"""A real Flower 1.41 deployment on one host: TLS, SuperNode auth, SuperLink/SuperNode processes.

Flower 1.41 runs as separate programs (``flower-superlink``, ``flower-supernode``, the ``flwr``
CLI) that talk HTTP(S). This package owns the files they need (certificates, node keys, the app
folder, ``$FLWR_HOME/config.toml``) and their process lifetimes, so tests and the CLI can start
a federation, run an app and tear everything down without leaking processes.

The parts: ``tls`` (the CA, the server certificate, SuperNode keys), ``config`` (config maps, the
app folder, the CLI's config.toml), ``processes`` (environment, process groups, logs),
``superlink`` (the SuperLink and SuperNode programs) and ``flwr`` (the ``flwr`` CLI: register a
node, submit a run). The names below are the package's public face.
"""

from dipaco.flower.deploy.config import ConfigValue, config_arg, write_app, write_cli_config
from dipaco.flower.deploy.flwr import SERVERAPP_FAILED_LOG_LINE, register_node, submit_run
from dipaco.flower.deploy.processes import (
    descendants,
    flower_env,
    free_port,
    kill_tree,
    stop_groups,
    strip_ansi,
    tree_groups,
)
from dipaco.flower.deploy.superlink import (
    REFUSED_LOG_LINE,
    REFUSED_NO_KEY,
    REFUSED_UNREGISTERED,
    SuperLink,
    SuperNode,
)
from dipaco.flower.deploy.tls import TlsFiles, make_node_key, make_tls, read_public_key

__all__ = [
    "REFUSED_LOG_LINE",
    "REFUSED_NO_KEY",
    "REFUSED_UNREGISTERED",
    "SERVERAPP_FAILED_LOG_LINE",
    "ConfigValue",
    "SuperLink",
    "SuperNode",
    "TlsFiles",
    "config_arg",
    "descendants",
    "flower_env",
    "free_port",
    "kill_tree",
    "make_node_key",
    "make_tls",
    "read_public_key",
    "register_node",
    "stop_groups",
    "strip_ansi",
    "submit_run",
    "tree_groups",
    "write_app",
    "write_cli_config",
]
