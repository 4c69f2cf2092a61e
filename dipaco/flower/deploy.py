"""A real Flower 1.41 deployment on one host: TLS, SuperNode auth, SuperLink/SuperNode processes.

Flower 1.41 runs as separate programs (``flower-superlink``, ``flower-supernode``, the ``flwr``
CLI) that talk HTTP(S). This module owns the files they need (certificates, node keys, the app
folder, ``$FLWR_HOME/config.toml``) and their process lifetimes, so tests and the CLI can start
a federation, run an app and tear everything down without leaking processes.

Every program is started in its own process group with an environment from ``flower_env``, which
keeps Flower offline (no telemetry, no update check, no ``uv sync``) and away from ``~/.flwr``.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from dipaco.errors import ConfigError, TransportError
from dipaco.fileio import write_atomic

ConfigValue = str | int | float | bool

#: A refused SuperNode logs "Exit Code: 305" but its process exits with status 1 (uvicorn).
REFUSED_LOG_LINE = "Exit Code: 305"
#: ... followed by one of these: the key is not registered / no key was given at all.
REFUSED_UNREGISTERED = "[code: 2004] Failed to activate SuperNode."
REFUSED_NO_KEY = "[code: 2001] SuperNode authentication is enabled."
#: A ServerApp exception is logged as "Exit Code: 201" in the run's log stream, yet
#: ``flwr run --stream`` still exits 0; the run's status is then "finished:failed".
SERVERAPP_FAILED_LOG_LINE = "Exit Code: 201"

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")
_APP_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9-]*$")
_OBJECT_REF = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


# ----------------------------------------------------------------------------------------------
# Environment and small helpers


def flower_env(home: Path) -> dict[str, str]:
    """The environment for every Flower program: offline, quiet, and confined to ``home``.

    Children inherit it: SuperExec and the ``flwr-serverapp``/``flwr-clientapp`` processes get
    the environment of the SuperLink/SuperNode that launched them, so extra variables (for
    example ``DIPACO_*``) set here reach the apps.
    """
    env = dict(os.environ)
    env.update(
        {
            "FLWR_HOME": str(Path(home).resolve()),
            "FLWR_TELEMETRY_ENABLED": "0",  # default posts events to telemetry.flower.ai
            "FLWR_DISABLE_UPDATE_CHECK": "1",  # default queries the Flower API for new versions
            # Same as --disable-runtime-dependency-installation: no `uv sync` of app deps.
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "PYTHONUNBUFFERED": "1",  # logs reach our log files as they happen
        }
    )
    # SuperLink/SuperNode launch `flower-superexec`, `flwr-serverapp` and `flwr-clientapp` by
    # bare name, so the scripts' folder must be on PATH even when the venv is not activated.
    bin_dir = Path(sys.executable).parent
    if (bin_dir / "flower-superexec").exists():
        path = env.get("PATH", "")
        if path.split(os.pathsep)[0] != str(bin_dir):
            env["PATH"] = str(bin_dir) + (os.pathsep + path if path else "")
    for key in ("FLWR_TRACING_ENABLED", "FLWR_ENABLE_EVENT_LOG"):
        env.pop(key, None)
    return env


def strip_ansi(text: str) -> str:
    """Flower colours its log lines unconditionally; tests and messages want plain text."""
    return _ANSI.sub("", text)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the usual bind-to-0 race applies)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _bin(name: str) -> str:
    """Flower's console scripts, taken from this interpreter's environment first."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    from shutil import which

    found = which(name)
    if found is None:
        raise ConfigError(f"{name} not found next to {sys.executable} or on PATH; install flwr")
    return found


def _tail(path: Path | None, lines: int = 40) -> str:
    if path is None or not path.exists():
        return "(no log)"
    text = strip_ansi(path.read_text(errors="replace"))
    return "\n".join(text.splitlines()[-lines:])


def _write_private(path: Path, data: bytes) -> None:
    """Write a secret crash-safely with mode 0600 from the first byte on."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mkstemp: 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    os.chmod(path, 0o600)


def _toml_dumps(obj: Mapping[str, Any]) -> str:
    try:
        import tomli_w
    except ImportError as err:  # a dependency of flwr, so present wherever flwr is
        raise ConfigError("tomli_w is missing; install flwr (it depends on tomli_w)") from err
    return tomli_w.dumps(obj)


def _check_config(config: Mapping[str, Any], what: str) -> dict[str, ConfigValue]:
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
    checked = _check_config(config, what)
    parts = []
    for key, value in checked.items():
        inline = _inline_value(value)
        if inline is None:
            write_atomic(spill, _toml_dumps(checked).encode())
            return str(spill.resolve())
        parts.append(f"{key}={inline}")
    return " ".join(parts)


# ----------------------------------------------------------------------------------------------
# TLS and node keys


@dataclass
class TlsFiles:
    """The SuperLink's TLS material: the CA that clients trust, and the server cert and key."""

    ca: Path
    cert: Path
    key: Path


def _san_matches(cert: x509.Certificate, hosts: Sequence[str]) -> bool:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    ips = {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
    names = set(san.get_values_for_type(x509.DNSName))
    for host in hosts:
        try:
            if str(ipaddress.ip_address(host)) not in ips:
                return False
        except ValueError:
            if host not in names:
                return False
    return True


def _still_valid(cert: x509.Certificate) -> bool:
    now = dt.datetime.now(dt.UTC)
    return cert.not_valid_before_utc <= now < cert.not_valid_after_utc - dt.timedelta(days=1)


def make_tls(folder: Path, hosts: Sequence[str] = ("127.0.0.1", "localhost")) -> TlsFiles:
    """A self-signed CA and a server certificate for ``hosts``, reusing valid existing files.

    SuperNode authentication in Flower 1.41 only works over TLS, so even a loopback federation
    needs this. The server certificate is re-issued (by the same CA) if it does not cover
    ``hosts`` or is about to expire.
    """
    if not hosts:
        raise ConfigError("make_tls: at least one host is needed for the certificate")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ca_pem, ca_key_pem = folder / "ca.pem", folder / "ca.key"
    cert_pem, key_pem = folder / "server.pem", folder / "server.key"
    now = dt.datetime.now(dt.UTC)

    ca_cert: x509.Certificate | None = None
    ca_key: Any = None
    if ca_pem.exists() and ca_key_pem.exists():
        try:
            ca_cert = x509.load_pem_x509_certificate(ca_pem.read_bytes())
            ca_key = serialization.load_pem_private_key(ca_key_pem.read_bytes(), None)
        except ValueError as err:
            raise ConfigError(f"make_tls: cannot read {ca_pem} / {ca_key_pem}: {err}") from err
        if not _still_valid(ca_cert):
            ca_cert = None
    if ca_cert is None:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dipaco flower CA")])
        ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
        ca_cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=1))
            .not_valid_after(now + dt.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(ski, critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        _write_private(
            ca_key_pem,
            ca_key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
        )
        write_atomic(ca_pem, ca_cert.public_bytes(serialization.Encoding.PEM))
        cert_pem.unlink(missing_ok=True)  # a new CA invalidates the old server cert

    if cert_pem.exists() and key_pem.exists():
        try:
            cert = x509.load_pem_x509_certificate(cert_pem.read_bytes())
            if cert.issuer == ca_cert.subject and _san_matches(cert, hosts) and _still_valid(cert):
                return TlsFiles(ca=ca_pem, cert=cert_pem, key=key_pem)
        except ValueError:
            pass  # unreadable: issue a fresh one below

    key = ec.generate_private_key(ec.SECP256R1())
    alt: list[x509.GeneralName] = []
    for host in hosts:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alt.append(x509.DNSName(host))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=825))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()),  # type: ignore[arg-type]
            critical=False,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _write_private(
        key_pem,
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )
    write_atomic(cert_pem, cert.public_bytes(serialization.Encoding.PEM))
    return TlsFiles(ca=ca_pem, cert=cert_pem, key=key_pem)


def _public_line(public_key: ec.EllipticCurvePublicKey) -> str:
    return public_key.public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    ).decode()


def make_node_key(path: Path) -> str:
    """An ECDSA P-384 SuperNode key (OpenSSH format, 0600) and its ``.pub``; returns the line.

    Flower 1.41 only accepts SECP384R1 keys for SuperNode authentication. An existing key is
    reused (and its ``.pub`` rewritten if missing or stale), so restarts keep the node identity.
    """
    path = Path(path)
    pub_path = path.with_suffix(".pub")
    if pub_path == path:
        raise ConfigError(f"make_node_key: {path} must not end in .pub")
    if path.exists():
        try:
            key = serialization.load_ssh_private_key(path.read_bytes(), password=None)
        except (ValueError, TypeError) as err:
            raise ConfigError(
                f"make_node_key: {path} is not an OpenSSH private key: {err}"
            ) from err
        if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name != "secp384r1":
            raise ConfigError(f"make_node_key: {path} is not an ECDSA SECP384R1 key")
        if path.stat().st_mode & 0o077:
            os.chmod(path, 0o600)
    else:
        key = ec.generate_private_key(ec.SECP384R1())
        _write_private(
            path,
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.OpenSSH,
                serialization.NoEncryption(),
            ),
        )
    line = _public_line(key.public_key())
    if not pub_path.exists() or pub_path.read_text().strip() != line:
        write_atomic(pub_path, (line + "\n").encode())
    return line


def read_public_key(text_or_path: str | Path) -> str:
    """Validate a SuperNode public key given as a ``.pub`` path or as the key line itself."""
    text = str(text_or_path).strip()
    if not text.startswith(("ecdsa-", "ssh-")):
        path = Path(text).expanduser()
        if not path.is_file():
            raise ConfigError(f"public key: {text!r} is neither a key line nor a file")
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines()]
        text = next((ln for ln in lines if ln and not ln.startswith("#")), "")
    try:
        key = serialization.load_ssh_public_key(text.encode())
    except (ValueError, TypeError, UnsupportedAlgorithm) as err:
        raise ConfigError(f"public key: not an OpenSSH public key ({err}): {text[:60]!r}") from err
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp384r1":
        raise ConfigError(
            "public key: Flower SuperNode keys must be ECDSA SECP384R1 (ecdsa-sha2-nistp384), "
            f"got {text.split()[0]!r}"
        )
    return _public_line(key)


# ----------------------------------------------------------------------------------------------
# App folder and CLI config


def write_app(
    folder: Path,
    *,
    server: str,
    client: str,
    config: Mapping[str, ConfigValue],
    name: str = "dipaco-flower",
    version: str = "1.0.0",
    publisher: str = "dipaco",
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
    if not _APP_NAME.match(name):
        raise ConfigError(f"write_app: name {name!r} must start with a letter; letters, digits, -")
    if not _APP_NAME.match(publisher):
        raise ConfigError(f"write_app: publisher {publisher!r}: letters, digits, '-' only")
    doc = {
        "build-system": {"requires": ["hatchling"], "build-backend": "hatchling.build"},
        "project": {
            "name": name,
            "version": version,
            "description": "dipaco as a Flower app",  # flwr warns when these two are missing
            "license": "Apache-2.0",
            "dependencies": [],
        },
        "tool": {
            "flwr": {
                "app": {
                    "publisher": publisher,
                    "components": {"serverapp": server, "clientapp": client},
                    "config": _check_config(config, "write_app config"),
                }
            }
        },
    }
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / "pyproject.toml", _toml_dumps(doc).encode())
    return folder


def write_cli_config(home: Path, name: str, address: str, ca: Path | None) -> None:
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
    conn: dict[str, Any] = {"address": address}
    if ca is None:
        conn["insecure"] = True
    else:
        ca = Path(ca).resolve()  # flwr requires an absolute path here
        if not ca.is_file():
            raise ConfigError(f"root certificates {ca} do not exist")
        conn["root-certificates"] = str(ca)
    links[name] = conn
    links["default"] = name
    write_atomic(path, _toml_dumps(doc).encode())


# ----------------------------------------------------------------------------------------------
# Processes


def _children_map() -> dict[int, list[int]]:
    """ppid -> pids from /proc, to find SuperExec (Flower starts it in a session of its own)."""
    kids: dict[int, list[int]] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return kids
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        try:
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (Linux; empty elsewhere)."""
    kids = _children_map()
    out: list[int] = []
    todo = list(kids.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def _pgids(pids: Sequence[int]) -> set[int]:
    out = set()
    for p in pids:
        try:
            out.add(os.getpgid(p))
        except ProcessLookupError:
            pass
    return out


def _signal_groups(pgids: set[int], sig: int) -> None:
    for pgid in pgids:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _groups_alive(pgids: set[int]) -> bool:
    for pgid in pgids:
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            continue
    return False


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal a process's group and the groups of all its descendants (Flower's SuperExec
    detaches into a session of its own)."""
    _signal_groups(_pgids([pid, *descendants(pid)]) | {pid}, sig)


class _Managed:
    """A Flower program in its own process group, logging to a file."""

    name = "flower"

    def __init__(self, home: Path, log_file: Path | None, env: Mapping[str, str] | None) -> None:
        self.home = Path(home)
        self.log_file = Path(log_file) if log_file is not None else None
        self.extra_env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: TextIO | None = None
        self._pgids: set[int] = set()

    def _command(self) -> list[str]:
        raise NotImplementedError

    def start(self) -> None:
        if self.proc is not None:
            raise TransportError(f"{self.name} already started")
        self.home.mkdir(parents=True, exist_ok=True)
        cmd = self._command()
        env = flower_env(self.home)
        env.update(self.extra_env)
        log_path = self.log_file or self.home / f"{self.name}.log"
        self.log_file = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")  # noqa: SIM115  (closed in stop/wait)
        try:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        except OSError as err:
            self._log.close()
            raise TransportError(f"cannot start {cmd[0]}: {err}") from err
        self._pgids = {self.proc.pid}

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def log_tail(self, lines: int = 40) -> str:
        return _tail(self.log_file, lines)

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code, or None if still running after ``timeout`` seconds."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def _collect_groups(self) -> set[int]:
        """Our group plus the groups of every descendant (SuperExec detaches into its own)."""
        if self.proc is not None and self.proc.poll() is None:
            self._pgids |= _pgids(descendants(self.proc.pid))
        return set(self._pgids)

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM to every group we started, SIGKILL whatever survives ``grace`` seconds."""
        if self.proc is None:
            return None
        groups = self._collect_groups()
        _signal_groups(groups, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _groups_alive(groups):
            time.sleep(0.05)
            self.proc.poll()
        if _groups_alive(groups):
            _signal_groups(groups, signal.SIGKILL)
        return self._reap()

    def kill(self) -> int | None:
        """SIGKILL to the whole process group(s) at once: a crash, as tests want it."""
        if self.proc is None:
            return None
        _signal_groups(self._collect_groups(), signal.SIGKILL)
        return self._reap()

    def _reap(self) -> int | None:
        assert self.proc is not None
        try:
            code = self.proc.wait(10)
        except subprocess.TimeoutExpired:
            code = None
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    def __enter__(self) -> _Managed:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class SuperLink(_Managed):
    """``flower-superlink``: Fleet, Control and Runtime APIs all on one HTTP(S) port."""

    name = "superlink"

    def __init__(
        self,
        home: Path,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        tls: TlsFiles | None,
        node_auth: bool = True,
        log_file: Path | None = None,
        env: Mapping[str, str] | None = None,
        database: Path | None = None,
    ) -> None:
        super().__init__(home, log_file, env)
        if node_auth and tls is None:
            raise ConfigError("SuperNode authentication needs TLS in Flower 1.41 (exit code 104)")
        self.host = host
        self.port = port
        self.tls = tls
        self.node_auth = node_auth
        self.database = database

    @property
    def address(self) -> str:
        return _hostport(self.host, self.port)

    def _command(self) -> list[str]:
        if self.port == 0:
            self.port = free_port(self.host)
        cmd = [
            _bin("flower-superlink"),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--disable-runtime-dependency-installation",
        ]
        if self.tls is None:
            cmd.append("--insecure")
        else:
            for path in (self.tls.ca, self.tls.cert, self.tls.key):
                if not Path(path).is_file():
                    raise ConfigError(f"SuperLink TLS file {path} does not exist")
            cmd += [
                "--ssl-certfile",
                str(self.tls.cert),
                "--ssl-keyfile",
                str(self.tls.key),
                "--ssl-ca-certfile",
                str(self.tls.ca),
            ]
        if self.node_auth:
            cmd.append("--enable-supernode-auth")
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

    def __enter__(self) -> SuperLink:
        self.start()
        return self


class SuperNode(_Managed):
    """``flower-supernode``: one node; its SuperExec and ClientApps share its process group."""

    name = "supernode"

    def __init__(
        self,
        home: Path,
        superlink: str,
        *,
        ca: Path | None,
        node_key: Path | None,
        port: int = 0,
        node_config: Mapping[str, ConfigValue] | None = None,
        log_file: Path | None = None,
        env: Mapping[str, str] | None = None,
        max_retries: int | None = None,
        max_wait_time: float | None = None,
    ) -> None:
        super().__init__(home, log_file, env)
        self.superlink = superlink
        self.ca = ca
        self.node_key = node_key
        self.port = port
        self.node_config = dict(node_config or {})
        self.max_retries = max_retries
        self.max_wait_time = max_wait_time

    def _command(self) -> list[str]:
        if self.port == 0:
            self.port = free_port()
        cmd = [
            _bin("flower-supernode"),
            "--superlink",
            self.superlink,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),  # each node on a host needs its own Runtime API port
        ]
        if self.ca is None:
            cmd.append("--insecure")
        else:
            if not Path(self.ca).is_file():
                raise ConfigError(f"root certificates {self.ca} do not exist")
            cmd += ["--root-certificates", str(self.ca)]
        if self.node_key is not None:
            if not Path(self.node_key).is_file():
                raise ConfigError(f"SuperNode key {self.node_key} does not exist")
            cmd += ["--auth-supernode-private-key", str(self.node_key)]
        if self.node_config:
            spill = self.home / f"node-config-{self.port}.toml"
            cmd += ["--node-config", config_arg(self.node_config, spill, "node_config")]
        if self.max_retries is not None:
            cmd += ["--max-retries", str(self.max_retries)]
        if self.max_wait_time is not None:
            cmd += ["--max-wait-time", str(self.max_wait_time)]
        return cmd

    def __enter__(self) -> SuperNode:
        self.start()
        return self


# ----------------------------------------------------------------------------------------------
# flwr CLI


def _flwr(home: Path, args: Sequence[str], timeout: float = 60.0) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            [_bin("flwr"), *args],
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
    stream: bool = True,
    log_file: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen:
    """Start ``flwr run`` in its own process group; with ``stream`` it lives as long as the run.

    Run-config keys must already exist in the app's ``[tool.flwr.app.config]``. The values go
    through a TOML file, so any string survives. stdout+stderr go to ``log_file`` (default
    ``home/flwr-run.log``). ``flwr run`` checks that the ``module:attr`` components can be found
    from its own process (app folder + ``sys.path``), so a module outside the installed
    environment needs ``PYTHONPATH`` in ``env`` here as well as in the SuperLink/SuperNode's.
    """
    app_dir = Path(app_dir).resolve()
    if not (app_dir / "pyproject.toml").is_file():
        raise ConfigError(f"{app_dir} is not a Flower app folder (no pyproject.toml)")
    cmd = [_bin("flwr"), "run", str(app_dir), superlink_name]
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
        write_atomic(tmp, _toml_dumps(_check_config(run_config, "run_config")).encode())
        cmd += ["--run-config", tmp]
    if stream:
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
