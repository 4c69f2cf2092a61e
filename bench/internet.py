"""The internet on one machine: real runs over hivemind between network namespaces (bench/netbed).

Each scenario builds a testbed (a public switch, home routers with NAT, rate limits and loss in
the kernel), starts a real ``dipaco-coordinator`` and ``dipaco-peer`` process per namespace on
the tiny preset, and reports what a user would notice: whether the run finished, whether every
acknowledged delta was applied exactly once, how long transfers took against bytes / rate, and
the bytes the kernel counted on each peer's interface next to the peer's own count.

    python bench/internet.py                       # every scenario's short form (~5 min)
    python bench/internet.py --long                # longer runs, 20 Mbit/s, 16-peer crowd
    python bench/internet.py --scenarios nat cut   # some of them

Scenarios: ``nat`` (peers behind one NAT, an owner behind another reached through the
scheduler's relay, module servers behind NAT and on the public side), ``thin`` (an uplink limited
in the kernel, with and without ``--max-mbps`` on top), ``loss`` (random loss on the router),
``cut`` (the router drops everything for 30 s in the middle of an upload), ``crowd`` (peers
behind one NAT all starting within a second). Needs root, ``ip``, ``tc`` and ``iptables``.
The tests (tests/integration/test_internet.py) run the short forms and assert on their results.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from netbed import Host, Netbed, Router, counters_delta, ours, pids_in

BIN = Path(sys.executable).parent
# What the tests hold the scenarios to (the figures measured are in docs/operations.md):
WIRE_OVERHEAD_MAX = 2.0  # the kernel's bytes on a peer's interface over the program's count
THIN_FACTOR = 1.5  # push time a task over (bytes it sent / the uplink's rate)
CUT_RECOVERY_MAX = 60.0  # seconds from a 30 s cut's end to the delta's acknowledgement
SECOND = "L1.M0,L1.M1"  # the modules the owner behind NAT takes over
MODULES = 6  # the tiny preset's 2x2: S.embed, S.head and four level modules


class Proc:
    """A command inside a namespace, in its own session; its output collected line by line (and
    copied to ``<log_dir>/<name>.log``)."""

    def __init__(self, host: Host, args: Sequence[Any], name: str, log_dir: Path, env=None):
        self.name, self.host = name, host
        self.log = open(log_dir / f"{name}.log", "a")
        self.started = time.monotonic()
        self.p = host.popen(
            [str(a) for a in args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self.stamps: list[float] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.append(line)
            self.stamps.append(time.monotonic())
            self.log.write(line)
            self.log.flush()

    def saw(self, text: str) -> bool:
        return any(text in line for line in self.lines)

    def when(self, text: str) -> float | None:
        """``time.monotonic()`` when it first printed ``text``, or None."""
        for line, stamp in zip(self.lines, self.stamps, strict=False):
            if text in line:
                return stamp
        return None

    def until(self, text: str, timeout: float) -> None:
        wait(lambda: self.saw(text) or self.p.poll() is not None, timeout, f"{self.name}: {text}")
        if not self.saw(text):
            raise RuntimeError(f"{self.name} exited before printing {text!r}:\n{self.tail()}")

    def finish(self, timeout: float) -> int:
        try:
            return self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(
                f"{self.name} still running after {timeout} s:\n{self.tail()}"
            ) from None

    def tail(self, n: int = 40) -> str:
        return "".join(self.lines[-n:])

    def kill(self) -> None:
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.p.wait()
        self.log.close()


def wait(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise RuntimeError(f"timed out after {timeout} s waiting for {what}")


def events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass
class Run:
    """One run in a testbed: the scheduler on the public switch (and an owner behind NAT, when
    asked), the peers the scenario adds, each a real process in its namespace."""

    net: Netbed
    work: Path
    rounds: int = 2
    steps: int = 8
    model: str = ""  # extra [model] settings, e.g. "dim = 128"
    procs: list[Proc] = field(default_factory=list)
    peers: dict[str, Proc] = field(default_factory=dict)
    owner: Proc | None = None
    owner_dir: Path | None = None

    def __post_init__(self) -> None:
        self.root = self.work / "run"
        self.config = self.work / "run.toml"
        model = f"[model]\n{self.model}\n" if self.model else ""
        self.config.write_text(
            f'preset = "tiny"\n{model}[train]\ninner_steps = {self.steps}\nrounds = {self.rounds}\n'
        )

    def start(self, *, relay: bool = False, owner_behind: Router | None = None) -> str:
        """Start the scheduler (``--relay``), and an owner of SECOND behind ``owner_behind``
        (``--via-relay``) when given; the address peers join with."""
        host = self.net.public("coord")
        if owner_behind is not None:
            self.owner_dir = self.work / "owner"
            key = subprocess.run([BIN / "dipaco-coordinator", "key", "--run-dir", self.owner_dir],
                                 capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
        coordinator = self.proc(host, "coordinator", BIN / "dipaco-coordinator", "-v", "start",
                                "--config", self.config, "--run-dir", self.root, "--no-eval",
                                "--publish-seconds", "2", "--listen", f"{host.address}:31337",
                                *(["--relay"] if relay else []))  # fmt: skip
        self.coordinator = coordinator
        address_file = self.root / "coordinator" / "address"
        self.address = wait(
            lambda: (
                (coordinator.saw("another module owner") or coordinator.p.poll() is not None)
                and address_file.exists()
                and address_file.read_text().strip()
            ),
            300,
            "the coordinator's address",
        )
        if owner_behind is not None:
            assert self.owner_dir is not None
            subprocess.run([BIN / "dipaco-coordinator", "allow", "--owner", key, "--run-dir",
                            self.root], check=True, capture_output=True)  # fmt: skip
            self.owner = self.proc(owner_behind.host("owner"), "owner",
                                   BIN / "dipaco-coordinator", "-v", "start", "--join",
                                   self.address, "--owns", SECOND, "--run-dir", self.owner_dir,
                                   "--report-seconds", "0.5", "--publish-seconds", "2",
                                   "--via-relay")  # fmt: skip
            self.owner.until("took over", 240)
            self.owner.until("reachable through the scheduler's relay", 60)
        return self.address

    def proc(self, host: Host, name: str, *args: Any, env=None) -> Proc:
        proc = Proc(host, args, name, self.work, env)
        self.procs.append(proc)
        return proc

    def peer(self, host: Host, name: str, *extra: Any) -> Proc:
        proc = self.proc(host, name, BIN / "dipaco-peer", "-v", "join", self.address,
                         "--peer-id", name, "--state-dir", self.work / name, *extra)  # fmt: skip
        self.peers[name] = proc
        return proc

    def finish(self, timeout: float = 600) -> list[str]:
        """Wait for every process to exit; what went wrong (empty when the run finished and
        nothing was left running or listening in the testbed)."""
        problems = []
        if self.coordinator.finish(timeout) != 0:
            problems.append(f"the coordinator exited {self.coordinator.p.returncode}")
        for proc in self.procs:
            if proc.finish(180) != 0:
                problems.append(f"{proc.name} exited {proc.p.returncode}:\n{proc.tail()}")
        if not self.coordinator.saw("run finished"):
            problems.append(f"the run did not finish:\n{self.coordinator.tail()}")
        return problems + self.leftovers()

    def log(self) -> list[dict]:
        out = events(self.root / "metrics.jsonl")
        if self.owner_dir is not None:
            out += events(self.owner_dir / "metrics.jsonl")
        return out

    def exactly_once(self) -> list[str]:
        """Each module version made once, from deltas no task gave twice, and every delta a peer
        saw acknowledged in exactly one outer step of its module."""
        steps = [e for e in self.log() if e["event"] == "outer_step"]
        made = [(e["module"], e["version"]) for e in steps]
        problems = []
        if len(made) != len(set(made)) or len(made) != MODULES * self.rounds:
            problems.append(f"module versions made: {sorted(made)}")
        applied: dict[str, list[str]] = {}
        for e in steps:
            applied.setdefault(e["module"], []).extend(e["tasks"])
        for mid, tasks in applied.items():
            if len(tasks) != len(set(tasks)):
                problems.append(f"{mid} applied a task twice: {tasks}")
        acks = [ack for name in self.peers for ack in events(self.work / name / "acks.jsonl")]
        if not acks:
            problems.append("no peer saw a delta acknowledged")
        for ack in acks:
            if ack["task"] not in applied.get(ack["module"], []):
                problems.append(f"acknowledged, never applied: {ack}")
        return problems

    def timings(self, name: str) -> dict:
        return json.loads((self.work / name / "timings.json").read_text())

    def leftovers(self) -> list[str]:
        """Processes still running in the testbed's namespaces once every process it started
        has exited (a p2pd daemon that outlived its node, say), and sockets still listening."""

        def left() -> list[str]:
            out = []
            for ns in self.net.names:
                for pid in pids_in(ns):
                    try:
                        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                    except OSError:
                        continue
                    out.append(f"{ns}: pid {pid} still running: {cmd.decode()[:200]}")
            return out

        deadline = time.monotonic() + 10.0  # a helper may take a moment to follow its parent
        while (found := left()) and time.monotonic() < deadline:
            time.sleep(0.5)
        hosts = self.net.publics + self.net.routers + [h for r in self.net.routers for h in r.hosts]
        return found + [f"{h.ns}: still listening: {line}" for h in hosts for line in h.listening()]

    def stop(self) -> None:
        for proc in self.procs:
            if proc.p.poll() is None:
                proc.kill()


def wire(host: Host, timings: dict, before: tuple[int, int]) -> dict:
    """The kernel's bytes on ``host``'s interface since ``before`` next to the program's own."""
    sent, received = counters_delta(before, host.counters())
    return {
        "kernel_up": sent,
        "kernel_down": received,
        "program_up": timings["bytes_sent"],
        "program_down": timings["bytes_received"],
        "up_ratio": sent / max(timings["bytes_sent"], 1),
        "down_ratio": received / max(timings["bytes_received"], 1),
        "tokens": timings["tokens"],
    }


# -- scenarios ------------------------------------------------------------------------------


def scenario_nat(net: Netbed, work: Path, long: bool = False) -> dict:
    """Peers behind one home router's NAT (one in client mode, two serving modules to their
    LAN), a peer with a public address serving modules, and an owner behind a second NAT that
    only the scheduler's relay reaches. Everyone joins by the printed address."""
    run = Run(net, work, rounds=4 if long else 3)
    home, lab = net.home("home"), net.home("lab")
    try:
        run.start(relay=True, owner_behind=lab)
        hosts = {name: home.host(name) for name in ("nat0", "nat1", "nat2")}
        hosts["pub"] = net.public("pub")
        before = {name: host.counters() for name, host in hosts.items()}
        run.peer(hosts["nat0"], "nat0")
        run.peer(hosts["nat1"], "nat1", "--serve-modules")
        run.peer(hosts["nat2"], "nat2", "--serve-modules")
        run.peer(hosts["pub"], "pub", "--serve-modules", hosts["pub"].address)
        problems = run.finish()
    finally:
        run.stop()
    problems += run.exactly_once()
    relayed = re.findall(r"relayed (\d+) requests to module owners", "".join(run.coordinator.lines))
    # Where the public peer took module versions from: never a peer behind the home's NAT.
    from_nat = [line.strip() for line in run.peers["pub"].lines
                if re.search(r" from peer nat\d", line)]  # fmt: skip
    undialled = [
        line.strip()
        for line in run.peers["pub"].lines
        if "cannot be dialled" in line or "did not serve" in line
    ]
    skipped = re.findall(r"(\d+) serving peer\(s\) behind another NAT skipped",
                         "".join(run.peers["pub"].lines))  # fmt: skip
    seeds = {
        name: re.findall(r"modules: (\d+) from peers .*?, (\d+) from owners", "".join(p.lines))
        for name, p in run.peers.items()
    }
    return {
        "problems": problems,
        "relayed": int(relayed[0]) if relayed else 0,
        "public_peer_dial_failures": undialled,
        "public_peer_from_nat": from_nat,
        "lan_fetches": sum(
            1
            for name in ("nat0", "nat1", "nat2")
            for line in run.peers[name].lines
            if re.search(r" from peer nat\d", line)
        ),
        "seeds": {k: [int(x) for x in v[0]] if v else None for k, v in seeds.items()},
        "skipped_by_public_peer": int(skipped[0]) if skipped else 0,
        "wire": {name: wire(hosts[name], run.timings(name), before[name]) for name in hosts},
        "seconds": time.monotonic() - run.coordinator.started,
    }


def scenario_thin(net: Netbed, work: Path, long: bool = False) -> dict:
    """Two peers, each behind its own home router, each on an uplink the kernel limits to the
    same rate; one also runs ``--max-mbps`` at that rate. Time spent pushing a task's deltas
    against the bytes it sent divided by the rate."""
    mbit = 20.0 if long else 4.0
    run = Run(net, work, rounds=3 if long else 2, model="dim = 128" if long else "")
    hosts = {"kernel": net.home("h1").host("kernel", up_mbit=mbit),
             "kernel+cap": net.home("h2").host("capped", up_mbit=mbit)}  # fmt: skip
    try:
        run.start()
        before = {name: host.counters() for name, host in hosts.items()}
        run.peer(hosts["kernel"], "kernel")
        run.peer(hosts["kernel+cap"], "capped", "--max-mbps", mbit)
        problems = run.finish()
    finally:
        run.stop()
    problems += run.exactly_once()
    rows = {}
    for label, name in (("kernel", "kernel"), ("kernel+cap", "capped")):
        timings = run.timings(name)
        sent, _ = counters_delta(before[label], hosts[label].counters())
        tasks = max(timings["tasks"], 1)
        push = timings["seconds"]["push"] / tasks
        floor = timings["bytes_sent"] / tasks * 8 / (mbit * 1e6)  # the messages alone
        rows[label] = {
            "tasks": timings["tasks"],
            "push_s_per_task": push,
            "bytes_over_rate_s": floor,
            "wire_bytes_over_rate_s": sent / tasks * 8 / (mbit * 1e6),
            "ratio": push / max(floor, 1e-9),
        }
    return {"problems": problems, "mbit": mbit, "rows": rows}


def scenario_loss(net: Netbed, work: Path, long: bool = False, fraction: float = 0.05) -> dict:
    """Two peers behind a router that drops ``fraction`` of what it forwards, both ways."""
    run = Run(net, work, rounds=3 if long else 2)
    home = net.home("home")
    home.loss(fraction)
    try:
        run.start()
        began = time.monotonic()
        for name in ("lossy0", "lossy1"):
            run.peer(home.host(name), name)
        problems = run.finish()
        seconds = time.monotonic() - began
    finally:
        run.stop()
    log = run.log()
    expired = [e for e in log if e["event"] == "lease_expired"]
    problems += run.exactly_once() + [f"lease expired: {e}" for e in expired]
    return {"problems": problems, "loss": fraction, "seconds": seconds, "expired": len(expired)}


def scenario_cut(net: Netbed, work: Path, long: bool = False, outage: float = 30.0) -> dict:
    """A peer on a 1 Mbit/s uplink; when it starts pushing a task's deltas, the router drops
    everything for ``outage`` seconds. The delta must be acknowledged after the link returns
    and applied once."""
    run = Run(net, work, rounds=3 if long else 2)
    home = net.home("home")
    host = home.host("cut", up_mbit=1.0)
    try:
        run.start()
        peer = run.peer(host, "cut")
        peer.until("pushing the deltas", 300)
        pushing = next(line for line in peer.lines if "pushing the deltas" in line)
        task = re.search(r"deltas of (\S+)", pushing).group(1)  # type: ignore[union-attr]
        time.sleep(0.3)  # a few pieces of it sent
        acked_before = sum(1 for _ in events(run.work / "cut" / "acks.jsonl"))
        with home.cut():
            time.sleep(outage)
        back = time.monotonic()
        wait(
            lambda: any(a["task"] == task for a in events(run.work / "cut" / "acks.jsonl")),
            300,
            f"{task} acknowledged after the cut",
        )
        after = time.monotonic() - back
        problems = run.finish()
    finally:
        run.stop()
    problems += run.exactly_once()
    expired = [e for e in run.log() if e["event"] == "lease_expired"]
    return {
        "problems": problems,
        "task": task,
        "acked_before_cut": acked_before,
        "ack_after_link_back_s": after,
        "expired": len(expired),
    }


def scenario_crowd(net: Netbed, work: Path, long: bool = False, peers: int | None = None) -> dict:
    """``peers`` peers behind one NAT, all started within a second."""
    count = peers or (16 if long else 8)
    run = Run(net, work, rounds=2)
    home = net.home("home")
    try:
        run.start()
        hosts = [home.host(f"c{i}") for i in range(count)]
        began = time.monotonic()
        for i, host in enumerate(hosts):
            run.peer(host, f"c{i}")
        started = time.monotonic() - began
        problems = run.finish()
    finally:
        run.stop()
    problems += run.exactly_once()
    joined = [p.when("joined") for p in run.peers.values()]
    late = [p.name for p, t in zip(run.peers.values(), joined, strict=True) if t is None]
    finished = [p.name for p in run.peers.values() if p.saw("the run has finished")]
    return {
        "problems": problems + [f"never joined: {late}"] * bool(late),
        "peers": count,
        "started_within_s": started,
        "slowest_join_s": max(
            (t - p.started for p, t in zip(run.peers.values(), joined, strict=True) if t),
            default=0.0,
        ),
        "finished": len(finished),
        "trained": sum(run.timings(name)["tasks"] for name in run.peers),
    }


SCENARIOS: dict[str, Callable[..., dict]] = {
    "nat": scenario_nat,
    "thin": scenario_thin,
    "loss": scenario_loss,
    "cut": scenario_cut,
    "crowd": scenario_crowd,
}


def run_scenario(name: str, work: Path, long: bool = False, **kwargs: Any) -> dict:
    """One scenario in a testbed of its own, removed afterwards; its result, with ``left``: the
    testbed's namespaces still there after it was removed."""
    work.mkdir(parents=True, exist_ok=True)
    with Netbed() as net:
        result = SCENARIOS[name](net, work, long, **kwargs)
    result["left"] = ours()
    return result


def summary(name: str, result: dict, baseline: dict | None = None) -> str:
    """One line of what a scenario showed."""
    if result["problems"]:
        return f"PROBLEMS: {result['problems'][0][:300]}"
    if name == "nat":
        wire = result["wire"].values()
        ups = [w["up_ratio"] for w in wire]
        downs = [w["down_ratio"] for w in wire]
        return (
            f"finished, every ack applied once; {result['relayed']} requests relayed to the "
            f"owner behind NAT; the public peer took {len(result['public_peer_from_nat'])} "
            f"modules from servers behind NAT (skipped {result['skipped_by_public_peer']}), "
            f"the NAT'ed peers {result['lan_fetches']} from one another; kernel / program bytes "
            f"up {min(ups):.2f}-{max(ups):.2f}x, down {min(downs):.2f}-{max(downs):.2f}x"
        )
    if name == "thin":
        k, c = result["rows"]["kernel"], result["rows"]["kernel+cap"]
        return (
            f"{result['mbit']:g} Mbit/s uplink (tbf): push {k['push_s_per_task']:.2f} s a task, "
            f"{k['ratio']:.2f}x bytes / rate; with --max-mbps {result['mbit']:g} on top "
            f"{c['push_s_per_task']:.2f} s, {c['ratio']:.2f}x"
        )
    if name == "loss":
        ratio = (
            f" ({result['seconds'] / baseline['seconds']:.2f}x the run without loss)"
            if baseline and baseline is not result
            else ""
        )
        return (
            f"{result['loss']:.0%} loss: finished in {result['seconds']:.0f} s{ratio}, "
            f"{result['expired']} leases expired, every ack applied once"
        )
    if name == "cut":
        return (
            f"30 s cut mid-upload: delta acknowledged {result['ack_after_link_back_s']:.1f} s "
            f"after the link came back, {result['expired']} leases expired, applied once"
        )
    return (
        f"{result['peers']} peers behind one NAT started within "
        f"{result['started_within_s']:.1f} s: all joined (slowest {result['slowest_join_s']:.0f} s"
        f" after its start, on 2 cores), {result['finished']} left at the run's end, "
        f"{result['trained']} tasks trained, every ack applied once"
    )


def main(argv: list[str] | None = None) -> int:
    from _report import add_report_args, record
    from rich.console import Console
    from rich.table import Table

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    ap.add_argument("--long", action="store_true", help="the long forms")
    ap.add_argument("--work", type=Path, help="keep the runs' folders, logs and results here")
    add_report_args(ap)
    args = ap.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="dipaco-internet-"))
    table = Table(title="the internet on one machine" + (" (long form)" if args.long else ""))
    for column in ("scenario", "seconds", "what it showed"):
        table.add_column(column)
    failed = 0
    for name in args.scenarios:
        variants: list[dict] = (
            [{"fraction": f} for f in (0.0, 0.01, 0.05)] if name == "loss" else [{}]
        )
        baseline = None
        for kwargs in variants:
            began = time.monotonic()
            label = name + "".join(f" {k}={v}" for k, v in kwargs.items())
            print(f"== {label}", flush=True)
            result = run_scenario(name, work / label.replace(" ", "_"), args.long, **kwargs)
            (work / f"{label.replace(' ', '_')}.json").write_text(json.dumps(result, indent=1))
            baseline = baseline or result
            line = summary(name, result, baseline)
            seconds = time.monotonic() - began
            print(f"== {label}: {seconds:.0f} s: {line}", flush=True)
            table.add_row(label, f"{seconds:.0f}", line)
            failed += bool(result["problems"])
            if not result["problems"]:
                record(args, f"internet ({label}{', long' if args.long else ''})", line)
    Console(width=160).print(table)
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
