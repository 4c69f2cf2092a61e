"""The checks ``dipaco-peer doctor`` runs before joining: can this machine take part in a run?

Each check returns a plain :class:`Check` (name, ok, detail, advice, skipped); printing them is
the command's job (``dipaco.cli.doctor``). Checks: the training device, its free memory against
what one path of the run's model needs, whether the coordinator's address is reachable over
TCP, the round trip time, and the clock skew against the coordinator's clock (signed requests
further off than ``security.clock_skew_seconds`` are refused). The loopback protocol tells no
time before a peer authenticates, so the clock is only compared when ``time_url`` names an HTTP
endpoint of the coordinator (its dashboard: its ``Date`` header); otherwise the check is
skipped, not passed.
"""

from __future__ import annotations

import dataclasses
import email.utils
import re
import socket
import statistics
import time
import urllib.request
from dataclasses import asdict, dataclass

from dipaco import faults
from dipaco.config import RunConfig
from dipaco.protocols import messages as m
from dipaco.protocols.transport import Transport

_GIB = 2**30
_RTT_WARN_MS = 500.0
_MULTIADDR = re.compile(r"^/(ip4|ip6|dns|dns4|dns6)/([^/]+)/tcp/(\d+)(/.*)?$")


@dataclass
class Check:
    """One check's outcome; ``advice`` says what to do about a failure (or a concern)."""

    name: str
    ok: bool
    detail: str
    advice: str = ""
    skipped: bool = False  # nothing could be compared: neither passed nor failed

    @property
    def outcome(self) -> str:
        return "skipped" if self.skipped else ("passed" if self.ok else "failed")

    def to_dict(self) -> dict:
        """JSON's form: ``ok`` is true or false for a check that ran and null for a skipped
        one (neither passed nor failed); ``outcome`` says it in a word."""
        return {**asdict(self), "ok": None if self.skipped else self.ok, "outcome": self.outcome}


def all_passed(checks: list[Check]) -> bool:
    """Every check that ran passed (skipped checks do not count either way)."""
    return all(c.ok for c in checks if not c.skipped)


def parse_address(address: str) -> tuple[str, int]:
    """``host:port``, ``[v6]:port`` or a TCP multiaddr (``/ip4/H/tcp/P/p2p/...``) as (host, port).

    Raises ``ValueError`` with what is allowed when it is none of these.
    """
    address = address.strip()
    m = _MULTIADDR.match(address)
    if m:
        return m.group(2), int(m.group(3))
    if address.startswith("/"):
        raise ValueError(
            f"{address!r} is not a TCP multiaddr (/ip4|/ip6|/dns.../HOST/tcp/PORT/...)"
        )
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not HOST:PORT (e.g. 127.0.0.1:31337) nor a multiaddr")
    return host, int(port)


def _connect_ms(host: str, port: int, timeout: float) -> float:
    began = time.perf_counter()
    with socket.create_connection((host, port), timeout=timeout):
        return (time.perf_counter() - began) * 1000


def _sends_challenge(host: str, port: int, timeout: float) -> bool:
    """Whether the listener opens with multiprocessing's authkey challenge, as a loopback
    coordinator does (the coordinator logs one refused connection for it)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as conn:
            conn.settimeout(timeout)
            head = b""
            while len(head) < 15:
                more = conn.recv(64)
                if not more:
                    break
                head += more
    except OSError:
        return False
    return b"#CHALLENGE#" in head[:32]


def check_device(device: str) -> tuple[Check, str]:
    """The device that ``device`` (``auto``, ``cpu``, ``cuda:0``...) resolves to."""
    import torch

    from dipaco.peer.device import device_memory_bytes, resolve_device

    name = resolve_device(device)
    try:
        dev = torch.device(name)
    except RuntimeError as exc:
        return Check("device", False, f"{name!r}: {exc}", "use auto, cpu or cuda:N"), name
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return (
                Check(
                    "device",
                    False,
                    f"{name}: no CUDA GPU is usable here",
                    "install a CUDA build of torch and the NVIDIA driver, or use --device cpu",
                ),
                name,
            )
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            return (
                Check(
                    "device",
                    False,
                    f"{name}: there are {torch.cuda.device_count()} GPUs",
                    "pick an existing GPU (cuda:0...)",
                ),
                name,
            )
        props = torch.cuda.get_device_properties(index)
        free = device_memory_bytes(name)
        detail = f"{name}: {props.name}, {props.total_memory / _GIB:.1f} GiB"
        if free is not None:
            detail += f" ({free / _GIB:.1f} GiB free)"
        return Check("device", True, detail), name
    if dev.type == "cpu":
        import os

        free = device_memory_bytes("cpu")
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        detail = f"cpu: {cores} cores, torch {torch.get_num_threads()} threads"
        if free is not None:
            detail += f", {free / _GIB:.1f} GiB RAM available"
        advice = "" if torch.cuda.is_available() else "training on CPU is slow; a GPU helps"
        return Check("device", True, detail, advice), name
    return Check("device", True, f"{name} (its memory cannot be told)"), name


def check_memory(config: RunConfig | None, device: str, memory_bytes: int | None) -> Check:
    """Free memory against one path's training estimate (fp32 params, grads, AdamW moments:
    ~16 bytes a parameter, plus one micro-batch's activations)."""
    import torch

    from dipaco.peer.device import (
        device_memory_bytes,
        path_memory_bytes,
        path_parameter_count,
        pick_micro_batch,
        training_features,
    )

    have = memory_bytes if memory_bytes is not None else device_memory_bytes(device)
    where = "given" if memory_bytes is not None else f"free on {device}"
    if config is None:
        detail = "no run config (--config/--preset): nothing to compare the memory with"
        if have is not None:
            detail += f"; {have / _GIB:.2f} GiB {where}"
        return Check("memory", False, detail, skipped=True)
    if have is None:
        return Check(
            "memory",
            False,
            f"the free memory of {device} cannot be told",
            "pass --memory-gb to plan with a known amount",
            skipped=True,
        )
    model, seq, batch = config.build_model_config(), config.train.seq_len, config.train.batch_size
    params = path_parameter_count(model)
    budget = have * 0.8
    # The precision a peer trains in on this device by default (bf16 autocast on a GPU).
    bf16 = training_features(device)["autocast"] == torch.bfloat16
    full = path_memory_bytes(model, batch, seq, bf16=bf16)
    least = path_memory_bytes(model, 1, seq, bf16=bf16)
    head = (
        f"one path: {params:,} parameters; needs {full / _GIB:.2f} GiB at batch {batch} "
        f"(seq {seq}, {'bf16' if bf16 else 'fp32'}), {least / _GIB:.2f} GiB at micro-batch 1; "
        f"{have / _GIB:.2f} GiB {where}"
    )
    if full <= budget:
        return Check("memory", True, head)
    if least <= budget:
        mb = pick_micro_batch(model, batch, seq, device, memory_bytes=have, bf16=bf16)
        return Check(
            "memory",
            True,
            head,
            f"batch {batch} does not fit at once: the peer will accumulate micro-batches of "
            f"{mb} (or pass a smaller --memory-gb to plan for less)",
        )
    return Check(
        "memory",
        False,
        head,
        "not even micro-batch 1 fits: use a device with more memory, or a run with a smaller "
        "model (model.dim / n_layers / vocab_size) or train.seq_len",
    )


def check_reach(address: str | None, timeout: float, tries: int = 3) -> tuple[Check, Check]:
    """Reachability (a TCP connect) and round trip time (median TCP connect time)."""
    if not address:
        skip = "no coordinator address given"
        return (
            Check("reachability", False, skip, "pass the address the coordinator printed", True),
            Check("round trip", False, skip, skipped=True),
        )
    try:
        host, port = parse_address(address)
    except ValueError as exc:
        return (
            Check(
                "reachability",
                False,
                str(exc),
                "wrong address? copy it exactly as `dipaco-coordinator start` printed it",
            ),
            Check("round trip", False, "address not understood", skipped=True),
        )
    times = []
    try:
        for _ in range(tries):
            times.append(_connect_ms(host, port, timeout))
    except OSError as exc:
        if times:  # it answered once: the connection, not the address, is flaky
            advice = "the coordinator answered then stopped: a flaky link or an overloaded host"
        elif isinstance(exc, ConnectionRefusedError):
            advice = (
                f"nothing listens on {host}:{port}: the coordinator is not running, or this "
                "is the wrong address/port (or a firewall rejects the connection)"
            )
        else:
            advice = (
                f"no answer from {host}:{port} within {timeout:g} s: a firewall blocks the "
                "port, the address is wrong, or the coordinator is not running"
            )
        what = type(exc).__name__ if not str(exc) else str(exc)
        return (
            Check("reachability", False, f"TCP {host}:{port}: {what}", advice),
            Check("round trip", False, "not reachable", skipped=True),
        )
    rtt = statistics.median(times)
    reach = Check("reachability", True, f"TCP {host}:{port} accepts connections")
    if not address.startswith("/"):  # a loopback coordinator greets with its key challenge
        if _sends_challenge(host, port, min(timeout, 1.0)):
            reach.detail += " and greets like a dipaco loopback coordinator"
        else:
            reach.advice = (
                "it does not greet like a dipaco loopback coordinator (no key challenge): "
                "is this the address `dipaco-coordinator start` printed?"
            )
    detail = f"{rtt:.1f} ms (median TCP connect of {tries})"
    if rtt > _RTT_WARN_MS:
        return reach, Check(
            "round trip",
            False,
            detail,
            "a slow link: requests and deltas will be slow; join from closer to the "
            "coordinator, or pass --max-mbps to join to avoid saturating it",
        )
    return reach, Check("round trip", True, detail)


def coordinator_time(url: str, timeout: float) -> tuple[float, float]:
    """(the coordinator's time from an HTTP Date header, our time at the reply's midpoint)."""
    began = time.time()
    request = urllib.request.Request(url, method="HEAD")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            date = reply.headers.get("Date")
    except urllib.error.HTTPError as exc:  # a refusal (no token) still carries a Date
        date = exc.headers.get("Date")
    ended = time.time()
    if not date:
        raise ValueError(f"{url} sent no Date header")
    return email.utils.parsedate_to_datetime(date).timestamp(), (began + ended) / 2


def check_clock(time_url: str | None, limit: float, timeout: float) -> Check:
    if not time_url:
        return Check(
            "clock skew",
            False,
            "not compared: the coordinator's address tells no time before a peer "
            "authenticates; pass --time-url with the run's dashboard URL to compare",
            skipped=True,
        )
    try:
        theirs, ours = coordinator_time(time_url, timeout)
    except (OSError, ValueError) as exc:
        return Check(
            "clock skew",
            False,
            f"cannot read the time at {time_url}: {exc}",
            "check --time-url (the dashboard `dipaco-coordinator start` printed)",
            skipped=True,
        )
    # Date has 1 s resolution: +-1 s is noise
    return clock_check(ours - theirs, limit, "HTTP Date, +-1 s")


def clock_check(skew: float, limit: float, how: str) -> Check:
    """The clock-skew check from a measured offset (this clock minus the coordinator's):
    failed past half the window the coordinator allows, so that the user hears before drift
    takes the peer past it."""
    detail = f"this clock is {skew:+.1f} s from the coordinator's ({how})"
    if abs(skew) > limit / 2:
        return Check(
            "clock skew",
            False,
            detail,
            f"signed requests more than {limit:g} s off are refused: sync this clock "
            "(e.g. `timedatectl set-ntp true`, or chrony/ntpd)",
        )
    return Check("clock skew", True, detail)


def run_checks(
    address: str | None,
    *,
    config: RunConfig | None = None,
    device: str = "auto",
    memory_bytes: int | None = None,
    timeout: float = 3.0,
    time_url: str | None = None,
) -> list[Check]:
    """Every check, in order: device, memory, reachability, round trip, clock skew.

    ``memory_bytes`` replaces the probe of the device's free memory.
    """
    dev_check, dev = check_device(device)
    checks = [dev_check]
    checks.append(check_memory(config, dev if dev_check.ok else "cpu", memory_bytes))
    checks.extend(check_reach(address, timeout))
    limit = config.security.clock_skew_seconds if config is not None else 300.0
    checks.append(check_clock(time_url, limit, timeout))
    return checks


def hello_with_clock(
    transport: Transport, hello: m.Hello
) -> tuple[m.Welcome, tuple[float, float] | None]:
    """Send ``hello`` asking for the coordinator's clock, and saying this peer's protocol
    number; its Welcome, and this clock (as it stamps requests) minus the coordinator's at the
    middle of the exchange with the window the coordinator allows (None from a coordinator that
    does not tell its clock)."""
    sent = faults.now()
    asking = dataclasses.replace(
        hello, capabilities={**hello.capabilities, "clock": 1, "protocol": m.PROTOCOL}
    )
    welcome = transport.request(asking)
    now, window = welcome.clock.get("now"), welcome.clock.get("window")
    if not isinstance(now, int | float) or not isinstance(window, int | float):
        return welcome, None
    return welcome, ((sent + faults.now()) / 2 - now, float(window))
