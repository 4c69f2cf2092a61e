"""Addresses a person types: what a join address is, and whether a port is free to listen on.

Checked before any work starts, so that a mistake is one line saying what was expected (and a
busy port is refused at once: hivemind's daemon would share it with whatever is there)."""

from __future__ import annotations

import errno
import functools
import ipaddress
import socket
import struct
import time

from dipaco.errors import ConfigError


def split_hostport(listen: str, option: str = "--listen") -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        raise ConfigError(f"{option} wants host:port, got {listen!r}") from None
    if not 0 <= number <= 65535:
        raise ConfigError(f"{option}: port {number} is outside 0-65535")
    return host or "127.0.0.1", number


def check_port_free(listen: str, option: str, patience: float = 3.0) -> None:
    """ConfigError within ``patience`` seconds if ``listen``'s port is taken (hivemind's daemon
    would otherwise share it with the process already there, and peers would reach either at
    random). The patience lets the helpers of a coordinator that just died (its p2p daemon
    exits within a second) let go of the port before a restart."""
    host, port = split_hostport(listen, option)
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    deadline = time.monotonic() + patience
    while True:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            # As servers bind: connections of a process that just died (TIME_WAIT) do not hold
            # the port, a listening socket does.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
                return
            except OSError as exc:
                error = exc
        if error.errno == errno.EADDRINUSE and time.monotonic() < deadline:
            time.sleep(0.25)
            continue
        busy = error.errno == errno.EADDRINUSE
        why = "is in use" if busy else f"cannot be used ({error.strerror})"
        raise ConfigError(
            f"{option} {listen}: port {port} on {host} {why}; another coordinator or "
            f"dashboard may be running there: stop it, or pick another port (port 0 picks "
            f"a free one)"
        )


def join_address(text: str, authkey_file: str | None) -> str:
    """What kind of address the user gave: "hivemind" or "loopback"; a ConfigError that says
    what was expected when it is neither, or is one with a part missing."""
    expected = (
        "expected the address `dipaco-coordinator start` printed: a multiaddr such as "
        "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooW... (over the internet), or HOST:PORT with "
        "--authkey-file (a loopback run on this machine)"
    )
    if text.startswith(("http://", "https://")):
        raise ConfigError(f"{text} is a web address (the dashboard's?), not a run's: {expected}")
    if text.startswith("/"):
        from hivemind.utils.multiaddr import Multiaddr

        try:
            maddr = Multiaddr(text)
            protocols = [p.name for p in maddr.protocols()]
        except Exception as exc:
            raise ConfigError(f"{text} is not a valid multiaddr ({exc}): {expected}") from None
        if "p2p" not in protocols:
            raise ConfigError(
                f"{text} lacks the coordinator's peer id: copy the whole address it printed, "
                "ending in /p2p/12D3KooW..."
            )
        if "tcp" not in protocols and "udp" not in protocols:
            raise ConfigError(f"{text} has no /tcp/PORT part: {expected}")
        return "hivemind"
    if text.startswith(("12D3KooW", "Qm")):
        raise ConfigError(f"{text} is a peer id alone: {expected} (the id is its /p2p/... part)")
    host, colon, port = text.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{text!r} is not an address: {expected}")
    if not authkey_file:
        raise ConfigError(
            f"{text} is a loopback address: it needs --authkey-file (the run's "
            "<run-dir>/coordinator/authkey)"
        )
    return "loopback"


RELAYED = "/p2p-circuit/p2p/"  # RELAY_ADDRESS/p2p-circuit/p2p/TARGET: TARGET through a relay


def relayed_address(relay: str, target: str) -> str:
    """How a node that cannot be dialled is reached: through ``relay`` (a whole multiaddr, with
    its ``/p2p/`` part), which it keeps a connection to."""
    return f"{relay.rstrip('/')}{RELAYED}{target}"


def split_relayed(address: str) -> tuple[str, str, str] | None:
    """(relay address, relay's peer id, target) of a relayed address; None for another one."""
    relay, found, target = address.partition(RELAYED)
    if not found:
        return None
    relay_id = relay.rsplit("/p2p/", 1)[-1] if "/p2p/" in relay else ""
    if not relay_id or not target or "/" in target:
        raise ValueError(f"{address} is not RELAY/p2p/RELAY_ID{RELAYED}TARGET")
    return relay, relay_id, target


# Networks a home or a lab keeps behind its router (RFC 1918, carrier-grade NAT, link-local,
# loopback, IPv6 unique-local and link-local): an address in one is dialled only from its own
# network. Any other address is taken as routable from anywhere.
LOCAL_NETWORKS = tuple(
    ipaddress.ip_network(n)
    for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10",
              "169.254.0.0/16", "127.0.0.0/8", "fc00::/7", "fe80::/10", "::1/128")
)  # fmt: skip


def _ip_of(maddr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address a multiaddr dials first (``/ip4/A/...`` or ``/ip6/A/...``), else None."""
    parts = maddr.split("/")
    if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
        try:
            return ipaddress.ip_address(parts[2])
        except ValueError:
            return None
    return None


def is_local(maddr: str) -> bool:
    """True for a multiaddr on a network kept behind a router (``LOCAL_NETWORKS``)."""
    ip = _ip_of(maddr)
    return ip is not None and any(ip in net for net in LOCAL_NETWORKS)


def announceable(maddrs: list[str]) -> list[str]:
    """What a node that listens tells others: its addresses without loopback ones, unless it
    listens on loopback only (a run on one machine). A peer elsewhere that dials 127.0.0.1 dials
    itself."""
    outside = [a for a in maddrs if (ip := _ip_of(a)) is None or not ip.is_loopback]
    return outside or list(maddrs)


def reachable(maddr: str) -> bool:
    """Whether this machine can dial ``maddr``: a routable address (or a name) always; an
    address on a network behind a router (``LOCAL_NETWORKS``) only when
    this machine is on that network itself (the address is on-link: the kernel's route to it
    leaves from an interface whose subnet holds it). A peer behind one home's NAT is thus never
    dialled from outside it, where its 192.168.x.y is someone else's network or none. A
    relayed address is judged by its relay's, the address it dials first. Never raises: the
    addresses come from anyone's DHT record."""
    ip = _ip_of(maddr)
    if ip is None or not is_local(maddr):
        return True
    return _on_link(str(ip))


@functools.lru_cache(maxsize=1024)
def _on_link(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))  # no packet leaves: the kernel only picks a route
            source = ipaddress.ip_address(probe.getsockname()[0].split("%")[0])
    except OSError:  # no route at all
        return False
    if source == ip:
        return True
    prefix = _prefix_of(str(source)) if ip.version == 4 else 64
    return ip in ipaddress.ip_network(f"{source}/{prefix}", strict=False)


def _prefix_of(address: str) -> int:
    """The prefix length of this machine's interface that holds ``address`` (Linux: asked of the
    kernel per interface), else 24."""
    try:
        import fcntl

        packed = socket.inet_aton(address)
        for _, name in socket.if_nameindex():
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                request = struct.pack("256s", name.encode()[:15])
                try:
                    mine = fcntl.ioctl(s.fileno(), 0x8915, request)[20:24]  # SIOCGIFADDR
                except OSError:
                    continue
                if mine != packed:
                    continue
                mask = fcntl.ioctl(s.fileno(), 0x891B, request)[20:24]  # SIOCGIFNETMASK
                return bin(int.from_bytes(mask, "big")).count("1")
    except (ImportError, OSError):
        pass
    return 24
