"""The SuperLink and SuperNode programs (``flower-superlink``, ``flower-supernode``).

Each one is a :class:`~dipaco.flower.deploy.processes.FlowerProcess`: started in its own process
group, logging to a file. The SuperLink serves Fleet, Control and Runtime APIs on one HTTP(S)
port; a SuperNode authenticates with its node key, and a refused one says so in its log.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Mapping
from pathlib import Path

from dipaco.errors import ConfigError, TransportError
from dipaco.flower.deploy.config import ConfigValue, config_arg
from dipaco.flower.deploy.processes import FlowerProcess, flower_bin, free_port
from dipaco.flower.deploy.tls import TlsFiles

#: A refused SuperNode logs "Exit Code: 305" but its process exits with status 1 (uvicorn).
REFUSED_LOG_LINE = "Exit Code: 305"
#: ... followed by one of these: the key is not registered / no key was given at all.
REFUSED_UNREGISTERED = "[code: 2004] Failed to activate SuperNode."
REFUSED_NO_KEY = "[code: 2001] SuperNode authentication is enabled."


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class SuperLink(FlowerProcess):
    """``flower-superlink``: Fleet, Control and Runtime APIs all on one HTTP(S) port."""

    name = "superlink"

    def __init__(
        self,
        home: Path,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        tls: TlsFiles,
        log_file: Path | None = None,
        env: Mapping[str, str] | None = None,
        database: Path | None = None,
    ) -> None:
        super().__init__(home, log_file, env)
        self.host = host
        self.port = port
        self.tls = tls
        self.database = database

    @property
    def address(self) -> str:
        return _hostport(self.host, self.port)

    def _command(self) -> list[str]:
        if self.port == 0:
            self.port = free_port(self.host)
        cmd = [
            flower_bin("flower-superlink"),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--disable-runtime-dependency-installation",
            "--ssl-certfile",
            str(self.tls.cert),
            "--ssl-keyfile",
            str(self.tls.key),
            "--ssl-ca-certfile",
            str(self.tls.ca),
            "--enable-supernode-auth",  # SuperNodes need TLS for it in Flower 1.41 (exit code 104)
        ]
        for path in (self.tls.ca, self.tls.cert, self.tls.key):
            if not Path(path).is_file():
                raise ConfigError(f"SuperLink TLS file {path} does not exist")
        if self.database is not None:
            cmd += ["--database", str(self.database)]
        return cmd

    def wait_ready(self, timeout: float = 60.0) -> float:
        """Block until the port accepts connections; returns the seconds waited."""
        if self.proc is None:
            raise TransportError("SuperLink was not started")
        t0 = time.monotonic()
        while True:
            code = self.proc.poll()
            if code is not None:
                raise TransportError(
                    f"flower-superlink exited with code {code} before it was ready:\n"
                    + self.log_tail()
                )
            try:
                with socket.create_connection((self.host, self.port), timeout=1.0):
                    return time.monotonic() - t0
            except OSError:
                pass
            if time.monotonic() - t0 > timeout:
                raise TransportError(
                    f"flower-superlink not accepting connections on {self.address} after "
                    f"{timeout:.0f} s:\n" + self.log_tail()
                )
            time.sleep(0.1)


class SuperNode(FlowerProcess):
    """``flower-supernode``: one node; its SuperExec and ClientApps share its process group."""

    name = "supernode"

    def __init__(
        self,
        home: Path,
        superlink: str,
        *,
        ca: Path,
        node_key: Path,
        port: int = 0,
        node_config: Mapping[str, ConfigValue] | None = None,
        log_file: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(home, log_file, env)
        self.superlink = superlink
        self.ca = ca
        self.node_key = node_key
        self.port = port
        self.node_config = dict(node_config or {})

    def _command(self) -> list[str]:
        if self.port == 0:
            self.port = free_port()
        cmd = [
            flower_bin("flower-supernode"),
            "--superlink",
            self.superlink,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),  # each node on a host needs its own Runtime API port
        ]
        if not Path(self.ca).is_file():
            raise ConfigError(f"root certificates {self.ca} do not exist")
        cmd += ["--root-certificates", str(self.ca)]
        if not Path(self.node_key).is_file():
            raise ConfigError(f"SuperNode key {self.node_key} does not exist")
        cmd += ["--auth-supernode-private-key", str(self.node_key)]
        if self.node_config:
            spill = self.home / f"node-config-{self.port}.toml"
            cmd += ["--node-config", config_arg(self.node_config, spill, "node_config")]
        return cmd
