"""Push behind and fetch ahead on a slow link: the same run with a peer pipeline off and on.

Real processes on 127.0.0.1, as ``bench/scale.py`` runs them (the tiny preset on 2x4, quorum
1.0, each peer pinned to a core with one thread). Every peer's uplink is made slow the way the
fault harness does it: each send of a task's deltas waits ``--uplink-seconds`` before its first
byte (``DIPACO_FAULTS=peer.send=sleep:S``), as a home link would take that long to carry a real
path's delta. Without push behind a peer waits through it; with it the peer trains its next task
meanwhile. Printed: tokens per second of each run (from the first task issued to the last round
closed), their ratio (on / off), where the peers' time went, the time the sends took on their
own thread, and the final model's validation perplexity (which paths a peer trains, so which
inner states it continues, may differ); each run checks that every acknowledged delta is applied
exactly once.

With ``--pipeline fetch-ahead`` the run compared is ``dipaco-peer join --fetch-ahead`` (the
next task claimed and its modules downloaded while the current one trains its last steps), and
every download is made slow instead (``--downlink-seconds``, the fault point ``peer.fetch``);
``--pipeline both`` passes both flags, with both links slow.

    python bench/push_behind.py                      # 2 peers, 3 rounds, H = 50, 1 s sends
    python bench/push_behind.py --uplink-seconds 3   # a slower link
    python bench/push_behind.py --pipeline fetch-ahead   # 1 s downloads, --fetch-ahead
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from _report import add_report_args, record
from scale import TOPOLOGY, console, one_run, prepare_once, run_config

PIPELINES = {
    "push-behind": ("--push-behind",),
    "fetch-ahead": ("--fetch-ahead",),
    "both": ("--push-behind", "--fetch-ahead"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--inner-steps", type=int, default=50, help="H, inner steps per task")
    ap.add_argument("--pipeline", choices=sorted(PIPELINES), default="push-behind")
    ap.add_argument(
        "--uplink-seconds",
        type=float,
        help="each send waits this long (default 1 with push behind, else 0)",
    )
    ap.add_argument(
        "--downlink-seconds",
        type=float,
        help="each download waits this long (default 1 with fetch ahead, else 0)",
    )
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run at most")
    ap.add_argument("--source", default="builtin", help="corpus (builtin, builtin:mixed, a file)")
    add_report_args(ap)
    args = ap.parse_args()
    flags = PIPELINES[args.pipeline]
    if args.uplink_seconds is None:
        args.uplink_seconds = 1.0 if "--push-behind" in flags else 0.0
    if args.downlink_seconds is None:
        args.downlink_seconds = 1.0 if "--fetch-ahead" in flags else 0.0
    faults = ";".join(
        f"{point}=sleep:{seconds}"
        for point, seconds in (
            ("peer.send", args.uplink_seconds),
            ("peer.fetch", args.downlink_seconds),
        )
        if seconds > 0
    )
    what = args.pipeline.replace("-", " ")
    work = Path(tempfile.mkdtemp(prefix="dipaco-push-behind-"))
    try:
        config = run_config(work, args.rounds, args.inner_steps, source=args.source)
        prepared = prepare_once(work, args.source, args.inner_steps, args.rounds)
        rows = {}
        for on in (False, True):
            console.log(f"{args.peers} peers, {what} {'on' if on else 'off'}")
            rows[on] = one_run(
                prepared, work, config, args.peers, args.rounds, args.timeout,
                label="-pipelined" if on else "",
                peer_args=flags if on else (),
                peer_faults=faults,
                quality=True,
            )  # fmt: skip
            r = rows[on]
            console.print(
                f"  {what} {'on ' if on else 'off'}: {r['tokens_per_s']:,.0f} tokens/s over "
                f"{r['wall_s']:.1f} s; peers' time: train {r['compute']:.0%}, transfer "
                f"{r['transfer']:.0%}, waiting {r['waiting']:.0%}; sent behind training "
                f"{r['sent_behind_s']:.1f} s; tasks fetched ahead {r['fetched_ahead_tasks']}; "
                f"final perplexity {r['ppl']:.2f}; every ack applied once: {r['applied_once']}"
            )
            if not r["applied_once"]:
                raise SystemExit("an acknowledged delta was not applied exactly once")
        ratio = rows[True]["tokens_per_s"] / rows[False]["tokens_per_s"]
        console.print(f"ratio ({what} on / off, tokens per second): {ratio:.2f}")
        off, on_ = rows[False], rows[True]
        record(
            args,
            "push_behind",
            f"{args.peers} peers, each send {args.uplink_seconds:g} s and each download "
            f"{args.downlink_seconds:g} s late: tokens/s "
            f"{ratio:.2f}x with {what} ({on_['tokens_per_s']:,.0f} vs "
            f"{off['tokens_per_s']:,.0f}); peers training {off['compute']:.0%} -> "
            f"{on_['compute']:.0%} of their time; perplexity {off['ppl']:.2f} -> {on_['ppl']:.2f}; "
            f"every ack applied once; tiny {TOPOLOGY} on "
            f"{args.source}, {args.rounds} rounds, H={args.inner_steps}",
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
