"""A loopback TCP proxy that drops and delays connections, put between peers and a coordinator.

It forwards bytes unchanged (the loopback transport's HMAC handshake and signed frames pass
through), so what a peer sees is a bad network: each forwarded chunk may be delayed, a
connection may be cut at a random chunk (``drop_prob``), and every ``blip_every`` seconds all
live connections are cut at once. Threads, not asyncio: the peers are other processes, and the
proxy must keep working while the test thread sleeps or waits on them.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Callable


class Proxy:
    def __init__(
        self,
        target: tuple[str, int] | Callable[[], tuple[str, int]],
        *,
        delay: float = 0.0,
        drop_prob: float = 0.0,
        blip_every: float | None = None,
        seed: int = 0,
        port: int = 0,
    ) -> None:
        self.target = target
        self.delay, self.drop_prob, self.blip_every = delay, drop_prob, blip_every
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._live: set[socket.socket] = set()
        self.connections = self.dropped = self.bytes = 0
        self._closed = threading.Event()
        self._server = socket.create_server(("127.0.0.1", port))
        self._server.settimeout(0.5)
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()
        if blip_every:
            threading.Thread(target=self._blips, name="proxy-blips", daemon=True).start()

    @property
    def address(self) -> str:
        host, port = self._server.getsockname()[:2]
        return f"{host}:{port}"

    def upstream(self) -> tuple[str, int]:
        """Where connections go: ``target``, or what it returns when it is a function (a
        coordinator's address, known once it listens)."""
        return self.target() if callable(self.target) else self.target

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.upstream(), timeout=5)
            except OSError:  # the coordinator is down (restarting): the peer sees a cut
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self.connections += 1
                self._live |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if self.delay:
                    time.sleep(self.delay)
                with self._lock:
                    drop = self._random.random() < self.drop_prob
                if drop:
                    self._cut(src, dst)
                    return
                dst.sendall(data)
                with self._lock:
                    self.bytes += len(data)
        except OSError:
            pass
        self._close_pair(src, dst)

    def _cut(self, *socks: socket.socket) -> None:
        with self._lock:
            self.dropped += 1
        self._close_pair(*socks)

    def _close_pair(self, *socks: socket.socket) -> None:
        for s in socks:
            with self._lock:
                self._live.discard(s)
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def drop_all(self) -> int:
        """Cut every live connection now (a network blip); returns how many sockets were cut."""
        with self._lock:
            live = list(self._live)
            if live:
                self.dropped += 1
        self._close_pair(*live)
        return len(live)

    def _blips(self) -> None:
        while not self._closed.wait(self.blip_every):
            self.drop_all()

    def close(self) -> None:
        self._closed.set()
        self._server.close()
        self.drop_all()

    def __enter__(self) -> Proxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
