"""The internet on one machine: network namespaces with a public switch, home routers with NAT,
rate limits and random loss in the kernel, and the kernel's own byte counters.

Linux only, as root, with ``ip`` (iproute2) and ``iptables``. Everything it makes lives in
namespaces named ``dnb-<pid>-<host>`` (``<pid>``: the process that made them); ``close()``
kills what runs in them and removes them, and ``sweep()`` removes those of a process that no
longer runs (a crashed test's), so that a stale namespace never meets the next run.

    with Netbed() as net:
        coord = net.public("coord")                  # 198.18.0.2 on the public switch
        home = net.home("home")                      # a router: 198.18.0.x outside, NAT inside
        peer = home.host("peer0", up_mbit=20)        # 192.168.<k>.2, reachable from nowhere
        proc = peer.popen(["python", "-c", "..."])   # a process inside the peer's namespace
        home.loss(0.05)                              # 5% of forwarded packets dropped
        with home.cut():                             # nothing crosses the router meanwhile
            ...
        sent, received = peer.counters()             # bytes on its interface, by the kernel

The public side mimics the internet: a "core" namespace routes between public hosts and
silently drops what is sent to a private address (no ICMP answer), so dialling a host behind
NAT from outside hangs until its timeout, as it does on a real link. ``netem`` (added delay) is
not in every kernel (not in this machine's): there is no added latency here.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

PREFIX = "dnb-"
# The public switch: .1 is the core, hosts from .2. RFC 2544's benchmarking range, which no
# one routes on the internet, and not one of the networks a home keeps behind its router.
PUBLIC = "198.18.0"


class NetbedError(RuntimeError):
    """The testbed cannot be built here (not root, no iproute2 / iptables, no namespaces)."""


def missing() -> str | None:
    """Why a testbed cannot be built on this machine, or None when it can."""
    if os.name != "posix" or not Path("/proc/self/ns/net").exists():
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc", "iptables"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install iproute2 iptables)"
    return None


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise NetbedError(f"{' '.join(args)}: {done.stderr.strip() or done.stdout.strip()}")
    return done


def namespaces() -> list[str]:
    out = sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def pids_in(ns: str) -> list[int]:
    out = sh("ip", "netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove(ns: str) -> None:
    """Kill whatever runs in ``ns``, then remove it."""
    for _ in range(50):
        pids = pids_in(ns)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    sh("ip", "netns", "del", ns, check=False)


def sweep() -> list[str]:
    """Remove the namespaces of testbeds whose process is gone; the names removed."""
    gone = []
    for ns in namespaces():
        if not ns.startswith(PREFIX):
            continue
        try:
            owner = int(ns[len(PREFIX) :].split("-", 1)[0])
        except ValueError:
            continue
        if owner != os.getpid() and not _alive(owner):
            remove(ns)
            gone.append(ns)
    return gone


def ours() -> list[str]:
    """This process's namespaces."""
    mine = f"{PREFIX}{os.getpid()}-"
    return [ns for ns in namespaces() if ns.startswith(mine)]


def _tbf(ns: str, dev: str, mbit: float) -> None:
    """Limit what ``dev`` sends to ``mbit`` megabits/s (a token bucket in the kernel)."""
    burst = max(int(mbit * 1e6 / 8 / 100), 16_000)  # 10 ms of the rate, at least 16 kB
    sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
       "rate", f"{mbit}mbit", "burst", str(burst), "latency", "200ms")  # fmt: skip


class Host:
    """One machine: a namespace with ``eth0`` at ``address`` (and loopback)."""

    def __init__(self, net: Netbed, ns: str, name: str, address: str, far: tuple[str, str]):
        self.net, self.ns, self.name, self.address = net, ns, name, address
        self._far = far  # (namespace, device): the other end of eth0, what sends to this host

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return sh("ip", "netns", "exec", self.ns, *args, check=check)

    def command(self, args: Sequence[str]) -> list[str]:
        """``args`` as a command that runs inside this host's namespace."""
        return ["ip", "netns", "exec", self.ns, *map(str, args)]

    def popen(self, args: Sequence[str], **kwargs) -> subprocess.Popen:
        """``args`` started inside this host's namespace, in a session of its own."""
        kwargs.setdefault("start_new_session", True)
        return subprocess.Popen(self.command(args), **kwargs)

    def limit(self, up_mbit: float | None = None, down_mbit: float | None = None) -> None:
        """Rate limits in the kernel: what this host sends (``up``) and receives (``down``)."""
        if up_mbit:
            _tbf(self.ns, "eth0", up_mbit)
        if down_mbit:
            _tbf(*self._far, down_mbit)

    def counters(self) -> tuple[int, int]:
        """Bytes sent and received on ``eth0``, as the kernel counted them (frames, with every
        header from Ethernet up)."""
        out = sh("ip", "-n", self.ns, "-j", "-s", "link", "show", "dev", "eth0").stdout
        stats = json.loads(out)[0]["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])

    def listening(self) -> list[str]:
        """The TCP sockets listening in this namespace (``ss``), one line each."""
        out = self.run("ss", "-H", "-tln", check=False).stdout
        return [line for line in out.splitlines() if line.strip()]


class Router(Host):
    """A home router: ``wan`` on the public switch, a LAN behind NAT (``MASQUERADE``). Hosts on
    the LAN reach the internet; nothing outside can open a connection to them."""

    def __init__(self, net: Netbed, ns: str, name: str, address: str, far, lan: str):
        super().__init__(net, ns, name, address, far)
        self.lan = lan  # e.g. 192.168.3
        self.hosts: list[Host] = []

    def host(self, name: str, up_mbit: float | None = None, down_mbit: float | None = None) -> Host:
        """A machine behind this router (``<lan>.2`` onwards), default route through it."""
        ns = self.net._namespace(name)
        dev = f"l{len(self.hosts)}"
        address = f"{self.lan}.{len(self.hosts) + 2}"
        sh("ip", "-n", self.ns, "link", "add", dev, "type", "veth", "peer", "name", "eth0",
           "netns", ns)  # fmt: skip
        sh("ip", "-n", self.ns, "link", "set", dev, "master", "lan", "up")
        sh("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "route", "add", "default", "via", f"{self.lan}.1")
        host = Host(self.net, ns, name, address, (self.ns, dev))
        self.hosts.append(host)
        host.limit(up_mbit, down_mbit)
        return host

    def loss(self, fraction: float) -> None:
        """Drop ``fraction`` of the packets the router forwards, each way, at random (0: none)."""
        self.run("iptables", "-F", "DNB-LOSS")
        if fraction > 0:
            self.run("iptables", "-A", "DNB-LOSS", "-m", "statistic", "--mode", "random",
                     "--probability", f"{fraction:.4f}", "-j", "DROP")  # fmt: skip

    @contextmanager
    def cut(self) -> Iterator[None]:
        """The link down: every packet the router would forward is dropped, until the block ends
        (connections are not reset: they stall, as behind a dead line)."""
        self.run("iptables", "-I", "FORWARD", "1", "-j", "DROP")
        try:
            yield
        finally:
            self.run("iptables", "-D", "FORWARD", "1")


class Netbed:
    """A testbed: the public switch and core, and what the test adds to it. Use as a context
    manager (or call ``close``): everything it made is removed, whatever happened."""

    def __init__(self) -> None:
        why = missing()
        if why is not None:
            raise NetbedError(why)
        sweep()
        self.names: list[str] = []
        self.publics: list[Host] = []
        self.routers: list[Router] = []
        try:
            self.core = self._namespace("core")
            sh("ip", "-n", self.core, "link", "add", "br0", "type", "bridge")
            sh("ip", "-n", self.core, "addr", "add", f"{PUBLIC}.1/24", "dev", "br0")
            sh("ip", "-n", self.core, "link", "set", "br0", "up")
            # What is sent to a private address from the public side disappears, unanswered.
            sh("ip", "netns", "exec", self.core, "iptables", "-A", "INPUT", "-i", "br0",
               "!", "-d", f"{PUBLIC}.1", "-j", "DROP")  # fmt: skip
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Netbed:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _namespace(self, name: str) -> str:
        ns = f"{PREFIX}{os.getpid()}-{name}"
        if ns in namespaces():
            remove(ns)  # left by this very process (a test that failed before closing)
        sh("ip", "netns", "add", ns)
        self.names.append(ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        return ns

    def _on_switch(self, name: str) -> tuple[str, str, str]:
        """A namespace with ``dev`` plugged into the switch: (namespace, address, switch port)."""
        ns = self._namespace(name)
        number = len(self.publics) + len(self.routers) + 2
        port = f"s{number}"
        address = f"{PUBLIC}.{number}"
        return ns, address, port

    def _plug(self, ns: str, dev: str, address: str, port: str) -> None:
        sh("ip", "-n", self.core, "link", "add", port, "type", "veth", "peer", "name", dev,
           "netns", ns)  # fmt: skip
        sh("ip", "-n", self.core, "link", "set", port, "master", "br0", "up")
        sh("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "-n", ns, "route", "add", "default", "via", f"{PUBLIC}.1")

    def public(self, name: str, up_mbit: float | None = None, down_mbit=None) -> Host:
        """A machine with a public address on the switch."""
        ns, address, port = self._on_switch(name)
        self._plug(ns, "eth0", address, port)
        host = Host(self, ns, name, address, (self.core, port))
        self.publics.append(host)
        host.limit(up_mbit, down_mbit)
        return host

    def home(self, name: str, up_mbit: float | None = None, down_mbit=None) -> Router:
        """A home router with a public address and a LAN of its own behind NAT. ``up``/``down``
        limit the whole home's line (shared by the hosts behind it)."""
        ns, address, port = self._on_switch(name)
        self._plug(ns, "wan", address, port)
        lan = f"192.168.{len(self.routers) + 1}"
        sh("ip", "-n", ns, "link", "add", "lan", "type", "bridge")
        sh("ip", "-n", ns, "addr", "add", f"{lan}.1/24", "dev", "lan")
        sh("ip", "-n", ns, "link", "set", "lan", "up")
        sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        sh("ip", "netns", "exec", ns, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "wan",
           "-j", "MASQUERADE")  # fmt: skip
        sh("ip", "netns", "exec", ns, "iptables", "-N", "DNB-LOSS")
        sh("ip", "netns", "exec", ns, "iptables", "-A", "FORWARD", "-j", "DNB-LOSS")
        router = Router(self, ns, name, address, (self.core, port), lan)
        # The home's line: "up" is what the router sends out on wan.
        if up_mbit:
            _tbf(ns, "wan", up_mbit)
        if down_mbit:
            _tbf(self.core, port, down_mbit)
        self.routers.append(router)
        return router

    def close(self) -> list[int]:
        """Kill what still runs in the testbed and remove its namespaces; the pids that were
        still running (a test that stopped its processes leaves none)."""
        left = []
        for ns in reversed(self.names):
            left += pids_in(ns)
            remove(ns)
        self.names = []
        return left


def counters_delta(before: tuple[int, int], after: tuple[int, int]) -> tuple[int, int]:
    """Bytes sent and received between two readings of ``Host.counters``."""
    return after[0] - before[0], after[1] - before[1]


def _main() -> None:  # pragma: no cover - a quick look: python bench/netbed.py
    with Netbed() as net:
        coord = net.public("coord")
        home = net.home("home")
        peer = home.host("peer0", up_mbit=20)
        print("namespaces:", ", ".join(ours()))
        print("coord", coord.address, "peer", peer.address, "behind", home.address)
        print("kernel counters of peer0:", peer.counters())
    print("left:", ours())


if __name__ == "__main__":  # pragma: no cover
    _main()
