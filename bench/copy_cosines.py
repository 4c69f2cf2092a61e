"""How close honest deltas come to being copies: the highest correlation of any stored delta
with an earlier one of its module (``dipaco/coordinator/copies.py``'s sketch), over a real local
run of the tiny preset, with ``validation.copy_cosine = 1.0`` so that nothing is refused.

    python bench/copy_cosines.py                                   # 2x2, H = 30, 4 rounds, builtin
    python bench/copy_cosines.py --source builtin:mixed
    python bench/copy_cosines.py --levels 4x4 --inner-steps 3 --rounds 3
    python bench/copy_cosines.py --levels 1 --replicas 8 --inner-steps 3 --rounds 3   # DiLoCo-8

Prints each module's highest correlation and the run's; docs/security.md ("Copies of earlier
deltas") quotes them to choose ``copy_cosine``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

from dipaco.config import preset_config
from dipaco.prepare.pipeline import prepare
from dipaco.run.factory import build_coordinator
from dipaco.run.local import run_local_peers
from dipaco.run.metrics_log import MetricsLog

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import add_report_args, record  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--source", default="builtin")
    ap.add_argument("--levels", default="2x2")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--inner-steps", type=int, default=30)
    ap.add_argument("--peers", type=int, default=2, help="local peers")
    add_report_args(ap)
    args = ap.parse_args()
    config = preset_config("tiny").replace(
        topology={"levels": args.levels, "replicas": args.replicas},
        train={"inner_steps": args.inner_steps, "rounds": args.rounds},
        data={"source": args.source},
        # Nothing refused: copies judged (1.0), no held-out scoring (every honest delta stored).
        validation={"copy_cosine": 1.0, "heldout_check": False},
    )
    root = Path(tempfile.mkdtemp(prefix="dipaco-copies-")) / "run"
    began = time.perf_counter()
    try:
        prep = prepare(root, config)
        co = build_coordinator(prep, MetricsLog(root / "metrics.jsonl"), evaluate=False)
        for thread in run_local_peers(co, prep, args.peers, stop=threading.Event()):
            thread.join()
        if not co.finished:
            raise SystemExit("the run did not finish")
        nearest = co.copies.nearest
    finally:
        shutil.rmtree(root.parent, ignore_errors=True)
    for mid, value in sorted(nearest.items()):
        print(f"{mid:>8}: {value:.3f}")
    worst = max(nearest, key=lambda mid: nearest[mid])
    what = (
        f"{args.levels}{f' x {args.replicas} replicas' if args.replicas > 1 else ''}, "
        f"H = {args.inner_steps}, {args.rounds} rounds, {args.source}"
    )
    print(f"highest: {nearest[worst]:.3f} ({worst}); {what}; {time.perf_counter() - began:.0f} s")
    blocks = max((v for mid, v in nearest.items() if not mid.startswith("S.")), default=-1.0)
    record(
        args,
        "copy_cosines",
        f"{what}: highest correlation of an honest delta with an earlier one {nearest[worst]:.3f} "
        f"({worst}); level modules at most {blocks:.3f}",
    )


if __name__ == "__main__":
    main()
