"""A peer's own Prometheus ``/metrics`` (``dipaco-peer join --metrics-port``), on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Callable
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server


class PeerMetrics:
    """What the join panel shows, as metrics: the task's progress, rate, tasks done, traffic."""

    def __init__(self, peer_id: str, device: str, traffic: Callable[[], tuple[int, int]]) -> None:
        self.registry = CollectorRegistry()
        labels = {"peer": peer_id, "device": device}
        info = Gauge("dipaco_peer_info", "This peer", list(labels), registry=self.registry)
        info.labels(**labels).set(1)
        self.step = Gauge(
            "dipaco_peer_step", "Inner step of the current task", registry=self.registry
        )
        self.steps = Gauge(
            "dipaco_peer_task_steps", "Inner steps of the current task", registry=self.registry
        )
        self.path = Gauge("dipaco_peer_path", "Path of the current task", registry=self.registry)
        self.loss = Gauge("dipaco_peer_loss", "Last inner-step loss", registry=self.registry)
        self.rate = Gauge(
            "dipaco_peer_tokens_per_second",
            "Training rate of the current task",
            registry=self.registry,
        )
        self.tasks = Counter("dipaco_peer_tasks", "Tasks acknowledged", registry=self.registry)
        moved = Gauge(
            "dipaco_peer_bytes",
            "Bytes moved (hivemind links)",
            ["direction"],
            registry=self.registry,
        )
        moved.labels("up").set_function(lambda: traffic()[0])
        moved.labels("down").set_function(lambda: traffic()[1])
        self.server: WSGIServer | None = None  # serve() starts it

    def progress(self, info: dict, rate: float) -> None:
        self.step.set(info["step"])
        self.steps.set(info["steps"])
        self.path.set(info["path"])
        self.loss.set(info["loss"])
        self.rate.set(rate)

    def serve(self, port: int) -> int:
        """Listen on 127.0.0.1:``port`` (0 picks one); returns the port."""
        server, _ = start_http_server(port, addr="127.0.0.1", registry=self.registry)
        self.server = server
        return server.server_port

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
