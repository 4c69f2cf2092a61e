"""Capacity planning by simulation: how many peers one scheduler and K module owners serve.

Runs the real coordinator code (bench/sim: one scheduler, K owners, every request through the
real handler, on a virtual clock) with simulated peers and links, for each combination of
``--peers`` and ``--owners``, and prints per configuration: the rounds' median virtual wall
time, how busy the peers were, the utilization of the scheduler's CPU and of the busiest
owner's CPU and NIC, the first resource to saturate, and the deltas acknowledged, applied and
lost (from the coordinators' own metrics events). See docs/operations.md, "Capacity planning
(simulated)".

    python bench/simulate.py --peers 200 500 1000 --owners 1 4 16 --rounds 2
    python bench/simulate.py --peers 1000 --owners 4 --doc   # appends the table to docs/operations.md
"""

from __future__ import annotations

import argparse
import logging
import platform
import sys
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sim import costs, peers, simulate  # noqa: E402

DOC = REPO / "docs" / "operations.md"
HEADER = (
    "| peers | owners | paths | schedule | round (median s) | rounds (s) | peers training "
    "| datacenter / consumer / slow tail | middle rounds: training, by class | of it wasted "
    "| scheduler CPU | owner CPU | owner NIC in | owner NIC out | first bottleneck "
    "| acked / applied / lost | sim wall (s) |"
)
COLUMNS = HEADER.count("|") - 1
STATE_HEADER = "| peers | schedule | class | " + " | ".join(peers.STATES) + " | wasted |"


def schedule(s: costs.Settings) -> str:
    """The scheduling settings of a row, in words."""
    parts = [f"{s.paths_per_peer:g} paths/peer"]
    flags = (
        ("overlap", s.overlap),
        ("hedge" if s.hedge is True else "hedge in the last round", s.hedge),
        ("push behind", s.push_behind),
        ("fetch ahead", s.fetch_ahead),
    )
    parts += [name for name, on in flags if on]
    if s.owner_cores > 1:
        parts.append(f"{s.owner_cores} cores per owner")
    parts += [f"{k} {v}" for k, v in s.policy.items()]
    return ", ".join(parts) or "synchronous"


def states(r: simulate.Result) -> list[str]:
    """Where each class's time went (peers.STATES), one row per class."""
    out = []
    for when, shares in (("", r.shares), (" (middle rounds)", r.steady)):
        for kind, share in shares.items():
            cells = " | ".join(f"{share.get(x, 0):.0%}" for x in (*peers.STATES, "wasted"))
            out.append(
                f"| {r.settings.peers:,} | {schedule(r.settings)} | {kind}{when} | {cells} |"
            )
    return out


def row(r: simulate.Result) -> str:
    u = r.utilization
    rounds = ", ".join(f"{x:,.0f}" for x in r.round_seconds)
    name, util = r.busiest
    classes = " / ".join(f"{r.training(k.name):.0%}" for k in r.settings.peer_kinds)
    middle = (
        f"{r.training(steady=True):.0%}: "
        + " / ".join(f"{r.training(k.name, steady=True):.0%}" for k in r.settings.peer_kinds)
        if r.steady
        else "(under 3 rounds)"
    )
    neck = r.bottleneck if r.bottleneck == name else f"{r.bottleneck}; busiest {name}"
    return (
        f"| {r.settings.peers:,} | {r.settings.owners} | {r.paths:,} | {schedule(r.settings)} "
        f"| {r.median_round:,.0f}"
        f"{'' if r.rounds_done >= r.settings.rounds else f' (STALLED at round {r.rounds_done})'} "
        f"| {rounds} | {r.training():.0%} | {classes} | {middle} "
        f"| {r.shares['all'].get('wasted', 0):.0%} "
        f"| {u.get('scheduler cpu', 0):.0%} | {u.get('owner cpu', 0):.0%} "
        f"| {u.get('owner nic in', 0):.0%} | {u.get('owner nic out', 0):.0%} "
        f"| {neck} ({util:.0%}) | {r.acked:,} / {r.applied:,} / {r.lost} "
        f"| {r.wall_seconds:,.0f} |"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, nargs="+", default=[200])
    ap.add_argument("--owners", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--inner-steps", type=int, default=500)
    ap.add_argument("--owner-gbps", type=float, default=10.0, help="each owner's NIC, each way")
    ap.add_argument(
        "--owner-cores",
        type=int,
        default=1,
        help="cores each owner serves requests on (an outer step holds one of them)",
    )
    ap.add_argument("--churn", type=float, default=0.05)
    ap.add_argument("--quorum", type=float, default=0.5, help="scheduler.quorum (0.5: default)")
    ap.add_argument(
        "--paths-per-peer",
        type=float,
        default=1.0,
        help="the topology: W x W with at least this many paths per peer (1: W = ceil(sqrt(peers)))",
    )
    ap.add_argument("--overlap", action="store_true", help="scheduler.overlap")
    ap.add_argument(
        "--hedge",
        nargs="?",
        const=True,
        default=False,
        choices=["last"],
        help='scheduler.hedge ("--hedge last": in the run\'s last round only)',
    )
    ap.add_argument(
        "--push-behind",
        action="store_true",
        help="peers send a task's deltas while they train the next (dipaco-peer --push-behind)",
    )
    ap.add_argument(
        "--fetch-ahead",
        action="store_true",
        help="peers claim and fetch the next task while they train one (dipaco-peer --fetch-ahead)",
    )
    ap.add_argument(
        "--no-cache-topology",
        action="store_true",
        help="run the coordinator's Topology as it is (module lists recomputed per call)",
    )
    ap.add_argument(
        "--cpu-seconds",
        type=float,
        default=None,
        help="charge each coordinator call this many CPU seconds instead of measuring it "
        "(a run that repeats whatever the machine's load)",
    )
    ap.add_argument("--doc", action="store_true", help=f"append the table to {DOC.name}")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    rows: list[str] = []
    state_rows: list[str] = []
    for n in args.peers:
        for owners in args.owners:
            settings = costs.Settings(
                peers=n,
                owners=owners,
                rounds=args.rounds,
                inner_steps=args.inner_steps,
                seed=args.seed,
                owner_gbps=args.owner_gbps,
                owner_cores=args.owner_cores,
                churn=args.churn,
                quorum=args.quorum,
                overlap=args.overlap,
                hedge=args.hedge,
                push_behind=args.push_behind,
                fetch_ahead=args.fetch_ahead,
                paths_per_peer=args.paths_per_peer,
                cache_topology=not args.no_cache_topology,
                cpu_seconds=args.cpu_seconds,
            )
            print(f"{n} peers, {owners} owners:", flush=True)
            result = simulate.run(settings, progress=lambda line: print(line, flush=True))
            print(f"  {result.stats}", flush=True)
            rows.append(row(result))
            state_rows += states(result)
            print(HEADER + "\n" + "|---" * COLUMNS + "|\n" + rows[-1], flush=True)
    table = "\n".join([HEADER, "|---" * COLUMNS + "|", *rows])
    table += "\n\nWhere the peers' time went (share of their present time; wasted: training whose "
    table += "delta was never acknowledged):\n\n"
    table += "\n".join([STATE_HEADER, "|---" * (STATE_HEADER.count("|") - 1) + "|", *state_rows])
    print("\n" + table)
    if args.doc:
        cmd = "python bench/simulate.py " + " ".join(argv if argv is not None else sys.argv[1:])
        stamp = datetime.now(UTC).strftime("%Y-%m-%d")
        note = f"\n`{cmd.replace(' --doc', '')}` ({platform.processor() or platform.machine()}, {stamp}):\n\n"
        with DOC.open("a") as f:
            f.write(note + table + "\n")
    return 0 if all(" / 0 |" in r and "STALLED" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
