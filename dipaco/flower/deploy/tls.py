"""TLS for the SuperLink and the SuperNodes' authentication keys.

SuperNode authentication in Flower 1.41 only works over TLS, so even a loopback federation needs
a certificate: :func:`make_tls` makes a self-signed CA and a server certificate. Every SuperNode
has an ECDSA P-384 key (:func:`make_node_key`) whose public line the SuperLink registers.
Secrets are written with mode 0600 from the first byte on, and valid existing files are reused.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from dipaco.errors import ConfigError
from dipaco.fileio import write_atomic, write_private


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
        write_private(
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
    write_private(
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
        write_private(
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
