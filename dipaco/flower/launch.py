"""One run's Flower deployment, its files under ``<run-dir>/flower``:

tls/             the run's CA and the SuperLink's certificate (peers get tls/ca.pem)
home/            FLWR_HOME: the flwr CLI's config.toml, logs
nodes/*.pub      SuperNode public keys admitted with ``dipaco-coordinator add-peer``
node-<i>.log     output of the nodes ``--local-peers`` starts (their keys and state folders
                 are <run-dir>/peers/flower-<i>)
app/             the Flower app folder (a pyproject.toml naming dipaco's apps)
superlink.json   the live SuperLink's address and pid (add-peer registers keys with it)
result.json      written by the ServerApp when the run has finished
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from dipaco.errors import ConfigError
from dipaco.fileio import write_json_atomic
from dipaco.flower import deploy
from dipaco.protocols.auth import Identity

CONNECTION = "dipaco"  # the flwr CLI's name for this run's SuperLink


class FlowerDeployment:
    def __init__(
        self, run_dir: str | Path, listen: str = "127.0.0.1:0", names: list[str] | None = None
    ) -> None:
        self.names = list(names or [])  # host names and addresses nodes dial (in the cert)
        self.run_dir = Path(run_dir).resolve()
        self.dir = self.run_dir / "flower"
        self.home = self.dir / "home"
        self.listen = listen
        self.superlink: deploy.SuperLink | None = None
        self.nodes: list[subprocess.Popen] = []
        self.runner = None

    # ---- node keys ----------------------------------------------------------------------------
    def add_node(self, public_key: str) -> tuple[Path, bool]:
        """Admit a SuperNode key: kept in nodes/, and registered with the SuperLink at once if
        it is up. Returns the key file and whether it was registered now."""
        line = deploy.read_public_key(public_key)
        digest = hashlib.sha256(line.encode()).hexdigest()[:16]
        file = self.dir / "nodes" / f"{digest}.pub"
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(line + "\n")
        live = self.live_address()
        if live is None:
            return file, False
        deploy.register_node(self.home, CONNECTION, line)
        return file, True

    def live_address(self) -> str | None:
        """The address of this run's SuperLink if one is running now."""
        info_file = self.dir / "superlink.json"
        if not info_file.exists():
            return None
        info = json.loads(info_file.read_text())
        try:
            os.kill(int(info["pid"]), 0)
        except (OSError, KeyError, ValueError):
            return None
        return str(info["address"])

    # ---- up and down --------------------------------------------------------------------------
    def up(self) -> str:
        """Start the SuperLink (TLS and node authentication on), register the admitted keys."""
        if self.live_address() is not None:
            raise ConfigError(f"a SuperLink already serves {self.run_dir} ({self.live_address()})")
        host, _, port = self.listen.rpartition(":")
        try:
            port_number = int(port)
        except ValueError:
            raise ConfigError(f"--listen wants host:port, got {self.listen!r}") from None
        host = host or "127.0.0.1"
        if host in ("0.0.0.0", "::") and not self.names:
            self.names = [socket.getfqdn()]  # what remote nodes most likely dial
        hosts = [h for h in (host, *self.names) if h not in ("0.0.0.0", "::")]
        hosts += [h for h in ("127.0.0.1", "localhost") if h not in hosts]
        self.tls = deploy.make_tls(self.dir / "tls", hosts)
        self.home.mkdir(parents=True, exist_ok=True)
        self.superlink = deploy.SuperLink(
            self.home,
            host=host,
            port=port_number,
            tls=self.tls,
            log_file=self.dir / "superlink.log",
            database=self.dir / "superlink.db",
        )
        self.superlink.start()
        self.superlink.wait_ready()
        address = self.superlink.address
        if host in ("0.0.0.0", "::"):  # say where nodes dial, not where we listen
            self.public_address = f"{self.names[0]}:{self.superlink.port}"
        else:
            self.public_address = address
        write_json_atomic(
            self.dir / "superlink.json",
            {"address": address, "pid": self.superlink.pid, "ca": str(self.tls.ca)},
        )
        deploy.write_cli_config(self.home, CONNECTION, address, self.tls.ca)
        for file in sorted((self.dir / "nodes").glob("*.pub")):
            deploy.register_node(self.home, CONNECTION, file)
        return address

    def start_local_nodes(self, count: int, *, device: str = "cpu") -> list[subprocess.Popen]:
        """``dipaco-peer join --flower`` processes on this machine, each with its own key
        (admitted here) and state folder (``peers/flower-<i>``), as a lab's nodes would run."""
        assert self.superlink is not None
        me = Identity.load_or_create(self.run_dir / "coordinator" / "signing.key")
        for i in range(count):
            state = self.run_dir / "peers" / f"flower-{i}"
            self.add_node(deploy.make_node_key(state / "flower-node.key"))
            log_file = open(self.dir / f"node-{i}.log", "ab")  # noqa: SIM115 - the child's
            self.nodes.append(
                subprocess.Popen(
                    [
                        str(Path(sys.executable).parent / "dipaco-peer"),
                        "join",
                        "--flower",
                        self.superlink.address,
                        "--root-certificates",
                        str(self.tls.ca),
                        "--coordinator-key",
                        me.public_key,
                        "--state-dir",
                        str(state),
                        "--peer-id",
                        f"flower-{i}",
                        "--device",
                        device,
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            log_file.close()
        return self.nodes

    def submit(
        self,
        *,
        evaluate: bool = True,
        env: dict[str, str] | None = None,
        dashboard: str = "",
        dashboard_token: str = "",
    ):
        """``flwr run`` of dipaco's apps over this run folder; its output in flower/run.log.
        ``dashboard`` (HOST:PORT) makes the ServerApp, which holds the coordinator, serve the
        dashboard there; its URL appears in ``coordinator/dashboard``."""
        app = deploy.write_app(
            self.dir / "app",
            server="dipaco.flower.apps:server_app",
            client="dipaco.flower.apps:client_app",
            config={"run-dir": str(self.run_dir), "eval": True, "dashboard": "",
                    "dashboard-token": ""},
        )  # fmt: skip
        (self.dir / "result.json").unlink(missing_ok=True)
        (self.run_dir / "coordinator" / "dashboard").unlink(missing_ok=True)
        self.runner = deploy.submit_run(
            self.home,
            app,
            CONNECTION,
            {
                "run-dir": str(self.run_dir),
                "eval": evaluate,
                "dashboard": dashboard,
                "dashboard-token": dashboard_token,
            },
            log_file=self.dir / "run.log",
            env=env,
        )
        return self.runner

    def result(self) -> dict[str, Any] | None:
        file = self.dir / "result.json"
        return json.loads(file.read_text()) if file.exists() else None

    def down(self, grace: float = 10.0) -> None:
        """Stop the run's processes, all at once: SIGTERM to flwr run's tree, the local nodes
        (each stops its SuperNode and trainer) and the SuperLink; SIGKILL to every process group
        of theirs, read before anything was signalled, still alive after ``grace`` seconds."""
        running = [p for p in (self.runner, *self.nodes) if p is not None and p.poll() is None]
        groups = set()
        for proc in running:
            groups |= deploy.tree_groups(proc.pid)
        if self.superlink is not None:
            groups |= self.superlink.groups()
        if self.runner is not None and self.runner.poll() is None:
            deploy.kill_tree(self.runner.pid, signal.SIGTERM)
        for node in self.nodes:
            if node.poll() is None:
                node.terminate()
        if self.superlink is not None:
            self.superlink.send_signal(signal.SIGTERM)
        deploy.stop_groups(groups, grace)
        for proc in running:
            try:
                proc.wait(1.0)
            except subprocess.TimeoutExpired:
                pass
        if self.superlink is not None:
            self.superlink.stop(grace=0.5)  # reaps it, closes its log
            (self.dir / "superlink.json").unlink(missing_ok=True)

    def __enter__(self) -> FlowerDeployment:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # Ctrl-C: everything within 2.5 s (the command ends within seconds: cli/stopping.py)
        self.down(grace=2.5 if exc_type is KeyboardInterrupt else 10.0)
