"""Poisoned deltas against the outer step, measured: how each defence holds (docs/security.md).

    .venv/bin/python bench/poison.py                       # builtin corpus, about 35 min
    .venv/bin/python bench/poison.py --source builtin:mixed --cases clean sybil-25

A tiny-preset DiPaCo 4x4 (every level module is on 4 paths; S.embed and S.head on all 16),
trained through the real coordinator and a local peer. The attack is in the peer's push: a
hostile path's trained delta is replaced by ``-flip`` times itself (sign-flipped, and scaled up
towards the norm check's bound of 3x the median norm), so it is finite, well-shaped and of a
plausible size: it passes every check of form. Which key sent each delta is set per case (the
coordinator's ``voter_of``): honest paths are one key each.

    clean        no attack
    sybil-25     4 hostile paths of 16, one on each level module, each its own key
    one-key-50   8 hostile paths, two on each level module, all from one key
    sybil-50     the same 8 paths, 8 keys

Lazy keys, on the sybil-25 paths (one key each), send something useless rather than harmful:

    lazy-random-25  a random step (Gaussian, per module --lazy-scale times the trained delta's
                    norm) in place of each round's trained delta
    replay-25       from the second round on, the delta the path sent in its first round, again
    other-shard-25  every task of the path trained on another path's shard (path p + 8 of 16:
                    no download of its own shard), pushed as trained

Defences (``validation`` settings): ``default`` (an open run's: every delta scored on held-out
documents, the mean where every path is scored), ``default-2owners`` (the same with the level-1
modules held by a second owner, in-process: every path's modules split, each path scored whole
by the scheduler, whose verdict each owner admits its share with), ``mean`` (the paper's weighted mean), ``trimmed_mean``,
``median`` (one vote per key in both), and ``mean+heldout`` / ``trimmed+heldout`` (the
usefulness score: each delta's held-out loss change on its path, per-key scores, refusal).
Prints each run's final validation perplexity and its ratio to the clean run with the plain
mean on the same corpus, the refusals by reason, and the held-out gains of honest and hostile
deltas; writes ``poison.md`` and ``poison.json`` to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from paper_table import LOCAL, PRESETS  # noqa: E402

from dipaco.config import RunConfig, load_config_dict  # noqa: E402
from dipaco.errors import RejectedError  # noqa: E402
from dipaco.fileio import write_atomic, write_json_atomic  # noqa: E402
from dipaco.peer.peer import Peer  # noqa: E402
from dipaco.prepare.pipeline import prepare  # noqa: E402
from dipaco.protocols.auth import Identity  # noqa: E402
from dipaco.protocols.transport import LocalTransport  # noqa: E402
from dipaco.run.evaluate import evaluate_modules  # noqa: E402
from dipaco.run.factory import build_coordinator  # noqa: E402
from dipaco.run.local import wait_for_end  # noqa: E402
from dipaco.run.metrics_log import MetricsLog  # noqa: E402

CASES = {  # name -> (hostile paths per level module, one key for all of them, what they send)
    "clean": (0, False, "flip"),
    "sybil-25": (1, False, "flip"),
    "one-key-50": (2, True, "flip"),
    "sybil-50": (2, False, "flip"),
    "lazy-random-25": (1, False, "random"),
    "replay-25": (1, False, "replay"),
    "other-shard-25": (1, False, "other-shard"),
}
DEFENCES = {
    # An open run's defaults: the held-out check "auto" (on), aggregation "auto" (the mean where
    # every path is scored); set here because the local runs' settings (paper_table.LOCAL) turn
    # the check off.
    "default": {"heldout_check": "auto", "aggregation": "auto"},
    # ...and the off-shard rule (validation.offshard_check: each delta also scored on other
    # paths' documents)
    "default+offshard": {"heldout_check": "auto", "aggregation": "auto", "offshard_check": True},
    "default-2owners": {"heldout_check": "auto", "aggregation": "auto"},
    "mean": {"aggregation": "mean", "heldout_check": False},
    "trimmed_mean": {"aggregation": "trimmed_mean", "heldout_check": False},
    "median": {"aggregation": "median", "heldout_check": False},
    "mean+heldout": {"aggregation": "mean", "heldout_check": True},
    "trimmed+heldout": {"aggregation": "trimmed_mean", "heldout_check": True},
    "trimmed+copies": {
        "aggregation": "trimmed_mean",
        "heldout_check": False,
        "copy_cosine": 0.9999,
    },
}
PLAN = [  # (case, defence): the default set of runs
    ("clean", "mean"),
    ("clean", "default"),
    ("sybil-25", "default"),
    ("sybil-50", "default"),
    ("lazy-random-25", "default"),
    ("replay-25", "default"),
    ("other-shard-25", "default"),
    ("other-shard-25", "mean"),
    ("clean", "default+offshard"),
    ("other-shard-25", "default+offshard"),
    ("clean", "default-2owners"),
    ("sybil-25", "default-2owners"),
    ("clean", "trimmed_mean"),
    ("clean", "median"),
    ("clean", "trimmed+heldout"),
    ("sybil-25", "mean"),
    ("sybil-25", "trimmed_mean"),
    ("sybil-25", "median"),
    ("sybil-25", "trimmed+heldout"),
    ("clean", "mean+heldout"),
    ("sybil-25", "mean+heldout"),
    ("one-key-50", "trimmed_mean"),
    ("sybil-50", "trimmed_mean"),
    ("sybil-50", "trimmed+heldout"),
    ("sybil-50", "mean+heldout"),
    ("lazy-random-25", "trimmed_mean"),
    ("lazy-random-25", "trimmed+heldout"),
    ("replay-25", "trimmed_mean"),
    ("replay-25", "trimmed+heldout"),
    ("replay-25", "trimmed+copies"),
]


def hostile_paths(config: RunConfig, per_module: int) -> list[int]:
    """Paths chosen so that every level module has exactly ``per_module`` hostile paths."""
    topo = config.build_topology()
    count: dict[str, int] = {}
    chosen = []
    for shift in range(per_module):
        for p in range(topo.num_paths):
            mids = [mid for mid in topo.path_modules(p) if not mid.startswith("S.")]
            if p not in chosen and all(count.get(mid, 0) <= shift for mid in mids):
                chosen.append(p)
                for mid in mids:
                    count[mid] = count.get(mid, 0) + 1
    return sorted(chosen)


class HostilePeer(Peer):
    """A peer that trains every task honestly and pushes, for a hostile path, once per path and
    round: ``-flip`` times the trained delta (``mode`` "flip"), a random step of ``lazy_scale``
    times its norm per module ("random"), or the path's first-round delta again ("replay",
    from the second round). When that is refused, the task's next attempt is pushed as
    trained, as the honest peer that the path would go to next would push it."""

    hostile: frozenset[int] = frozenset()
    honest_next: set[int]  # other-shard: paths whose next task trains on their own shard
    flip: float = 2.5
    mode: str = "flip"
    lazy_scale: float = 0.1

    def push(self, task, delta, tokens, losses, before_send=None):  # noqa: ANN001
        poisoned = self.__dict__.setdefault("poisoned", set())
        first = self.__dict__.setdefault("first", {})  # path -> its first pushed delta
        if self.mode == "other-shard":  # trained on the wrong data (shard_source): as trained
            # A refused task goes to the honest peer the path would go to next: its retry is
            # trained on the path's own shard (``honest_next``), the path's next round not.
            try:
                pushed = super().push(task, delta, tokens, losses, before_send)
            except RejectedError:
                self.honest_next.add(task.path)
                raise
            self.honest_next.discard(task.path)
            return pushed
        if task.path in self.hostile and (task.path, task.round) not in poisoned:
            poisoned.add((task.path, task.round))
            if self.mode == "flip":
                delta = {mid: {k: -self.flip * v for k, v in t.items()} for mid, t in delta.items()}
            elif self.mode == "random":
                delta = {mid: random_step(t, self.lazy_scale, (task.path, task.round))
                         for mid, t in delta.items()}  # fmt: skip
            elif task.path in first:
                delta = first[task.path]
            else:
                first[task.path] = delta
        return super().push(task, delta, tokens, losses, before_send)


def other_shard(root: Path, hostile: frozenset[int], paths: int, honest_next: set[int]):
    """A peer's shard source that gives a hostile path p the shard of path p + paths / 2
    (unless ``honest_next`` holds p: a refused task's retry, as the next peer trains it)."""
    import re

    from dipaco.data.shards import TokenShard

    def source(name: str, files: dict) -> TokenShard:
        p = int(re.search(r"P(\d+)", name).group(1))
        if p in hostile and p not in honest_next:
            name = re.sub(r"P\d+", f"P{(p + paths // 2) % paths}", name)
        return TokenShard(root / name)

    return source


def random_step(tensors: dict, scale: float, seed: tuple[int, int]) -> dict:
    """Gaussian noise shaped like ``tensors``, its norm ``scale`` times theirs."""
    import torch

    gen = torch.Generator().manual_seed(hash(seed) % (2**31))
    noise = {
        k: torch.randn(v.shape, generator=gen, dtype=torch.float32) for k, v in tensors.items()
    }
    norm = math.sqrt(sum(float(v.float().pow(2).sum()) for v in tensors.values()))
    noise_norm = math.sqrt(sum(float(v.pow(2).sum()) for v in noise.values()))
    factor = scale * norm / max(noise_norm, 1e-12)
    return {k: (v * factor).to(tensors[k].dtype) for k, v in noise.items()}


def run_case(
    out: Path,
    base_root: Path | None,
    base: RunConfig,
    case: str,
    defence: str,
    flip: float,
    lazy_scale: float = 0.1,
    heldout_docs: int | None = None,
) -> dict:
    key = f"{case}__{defence}" + (f"__docs{heldout_docs}" if heldout_docs else "")
    root = out / key
    done = root / "poison.json"
    if done.exists():
        print(f"[{key}] already done", flush=True)
        row = json.loads(done.read_text())
        every = CASES[row["case"]][2] == "other-shard"
        return {**row, **gains_of(root, row["hostile_paths"], every)}
    data = base.to_dict()
    data["name"] = key
    data["validation"] = {**data["validation"], **DEFENCES[defence]}
    if heldout_docs:
        data["validation"]["heldout_docs"] = heldout_docs
    config = load_config_dict(data, origin=f"poison {key}")
    per_module, one_key, mode = CASES[case]
    hostile = hostile_paths(config, per_module)
    t0 = time.monotonic()
    prep = prepare(root, config, stage=lambda s: print(f"[{key}] {s}", flush=True), reuse=base_root)
    metrics = MetricsLog(root / "metrics.jsonl")
    rounds = config.train.rounds
    metrics.listeners.append(
        lambda e: (
            print(f"[{key}] round {e['round']}/{rounds}", flush=True)
            if e["event"] == "round"
            else None
        )
    )
    coordinator = build_coordinator(prep, metrics, evaluate=False)
    voters = {
        p: ("hostile" if one_key else f"hostile-{p}") if p in hostile else f"honest-{p}"
        for p in range(config.build_topology().num_paths)
    }
    second = reporter = None
    if defence.endswith("2owners"):
        second, reporter = second_owner(prep, coordinator, metrics)
    for co in (coordinator, second) if second else (coordinator,):
        co.voter_of = lambda req: voters.get(req.path, req.peer_id)
        # One local key sends every delta, honest and hostile: it must not be banned for them.
        co.set_security(co.security.model_copy(update={"ban_after": 0}))
    stop = threading.Event()
    peer = HostilePeer(
        LocalTransport(coordinator.handle).authenticate(Identity.generate()),
        "local-0",
        prep.root / "peers",
        stop=stop,
        connect=(lambda owner, addresses: LocalTransport(second.handle)) if second else None,
    )
    peer.hostile, peer.flip, peer.mode = frozenset(hostile), flip, mode
    peer.lazy_scale = lazy_scale
    if mode == "other-shard":
        paths = config.build_topology().num_paths
        peer.honest_next = set()
        peer.shard_source = other_shard(prep.root, frozenset(hostile), paths, peer.honest_next)
    thread = threading.Thread(target=peer.run, daemon=True)
    thread.start()
    try:
        wait_for_end(
            coordinator, [thread], f"{key}: the local peer stopped before the run finished"
        )
    finally:
        stop.set()
        thread.join(60)
        if reporter is not None:
            reporter.close()
    owner_of = {mid: second for mid in second.owned_modules()} if second else {}
    result = evaluate_modules(prep, lambda mid: owner_of.get(mid, coordinator).store.params(mid))
    row = {
        "key": key,
        "case": case,
        "defence": defence,
        "hostile_paths": hostile,
        "flip": flip,
        "ppl": result["ppl"],
        "rejections": dict(coordinator.rejections),
        **({"owner_rejections": dict(second.rejections)} if second else {}),
        "heldout_docs": config.validation.heldout_docs,
        **gains_of(root, hostile, mode == "other-shard"),
        "seconds": round(time.monotonic() - t0, 1),
    }
    print(f"[{key}] ppl {row['ppl']:.2f}, refused {row['rejections']}", flush=True)
    write_json_atomic(done, row)
    return row


def second_owner(prep, coordinator, metrics: MetricsLog):  # noqa: ANN001, ANN201
    """A second owner, in this process, of the level-1 modules (every path's modules then split
    between two owners), reporting to ``coordinator``, which fetches its releases to score
    whole paths (as ``dipaco-coordinator start --join --owns`` and the scheduler's fetcher)."""
    from dipaco.coordinator.access import change_access
    from dipaco.coordinator.gather import fetch_current
    from dipaco.coordinator.owner import Reporter, take_over
    from dipaco.run.factory import build_owner

    mids = [mid for mid in coordinator.topology.module_ids() if mid.startswith("L1.")]
    second = build_owner(
        prep.root / "owner-b", coordinator.peer_config, metrics, owner_id="owner-b"
    )
    change_access(coordinator.root, second.identity.public_key, allow=True, owner=True)
    take_over(second, LocalTransport(coordinator.handle), mids)
    reporter = Reporter(second, LocalTransport(coordinator.handle), interval=0.2)
    reporter.start()
    key = second.identity.public_key

    def connect(owner, addresses, key):  # noqa: ANN001, ANN202
        return LocalTransport(second.handle).authenticate(coordinator.identity, key)

    coordinator.set_remote_fetcher(
        lambda wanted: fetch_current(
            connect, coordinator.run_id, {mid: ("owner-b", [], key) for mid in wanted}
        )
    )
    return second, reporter


def gains_of(
    root: Path, hostile: list[int], every: bool = False
) -> dict[str, dict[str, list[float]]]:
    """The held-out gains of the run's honest and hostile deltas (``gains``), the weight
    factors of those accepted (``weights``), and their gains less their gains on other paths'
    documents (``specific``). A hostile path's first delta of each round is the poisoned one; a
    retry after its refusal is pushed as trained (``every``: every delta of a hostile path is
    hostile, as a lazy key's trained on another shard)."""
    gains: dict[str, list[float]] = {"honest": [], "hostile": []}
    # own gain minus the gain on other paths' documents (heldout_check's foreign_gain)
    specific: dict[str, list[float]] = {"honest": [], "hostile": []}
    weights: dict[str, list[float]] = {"honest": [], "hostile": []}
    seen: set[tuple[int, str]] = set()
    for e in MetricsLog(root / "metrics.jsonl").read():
        if e["event"] != "heldout_check" or not math.isfinite(e.get("gain", math.nan)):
            continue
        round_ = e["task"].split("-e")[0]  # task ids are P<path>-r<round>-e<epoch>-a<attempt>
        first = (e["path"], round_) not in seen
        seen.add((e["path"], round_))
        side = "hostile" if e["path"] in hostile and (first or every) else "honest"
        gains[side].append(e["gain"])
        if math.isfinite(e.get("foreign_gain", math.nan)):
            specific[side].append(e["gain"] - e["foreign_gain"])
        if not e.get("refused"):
            weights[side].append(e.get("trust", 1.0))
    return {"gains": gains, "weights": weights, "specific": specific}


def _gain_text(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{min(values):+.3f} / {statistics.median(values):+.3f} / {max(values):+.3f}"


def markdown(rows: list[dict], source: str, flip: float, lazy_scale: float = 0.1) -> str:
    ref = {r["case"]: r["ppl"] for r in rows if r["defence"] == "mean"}.get("clean")
    lines = [
        f"Corpus {source}; tiny preset, DiPaCo 4x4; hostile deltas are -{flip:g} x the trained "
        f"delta (lazy-random: a random step of {lazy_scale:g} x its norm; replay: the path's "
        "first-round delta again). Ratio: ppl over the clean run's with the plain mean. "
        "Held-out gains (loss before - after, nats/token): min / median / max. Specific: the "
        "gain on the path's own documents less the gain on other paths', median honest / "
        "hostile.",
        "",
        "| case | defence | docs | ppl | ratio | refused | honest gains | hostile gains | "
        "hostile weight | specific |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r['ppl'] / ref:.3f}" if ref else "-"
        refused = ", ".join(f"{k} {v}" for k, v in sorted(r["rejections"].items())) or "none"
        hostile_w = r.get("weights", {}).get("hostile", [])
        weight = f"{statistics.median(hostile_w):.3f}" if hostile_w else "-"
        spec = r.get("specific", {})
        specific = " / ".join(
            f"{statistics.median(v):+.4f}" if (v := spec.get(side)) else "-"
            for side in ("honest", "hostile")
        )
        lines.append(
            f"| {r['case']} | {r['defence']} | {r.get('heldout_docs', '-')} | {r['ppl']:.2f} | "
            f"{ratio} | {refused} | {_gain_text(r['gains']['honest'])} | "
            f"{_gain_text(r['gains']['hostile'])} | {weight} | {specific} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="results folder (default runs/poison-<source>)")
    ap.add_argument("--source", default="builtin", help="corpus (as paper_table's --source)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--flip", type=float, default=2.5, help="hostile delta = -flip x trained")
    ap.add_argument("--lazy-scale", type=float, default=0.1,
                    help="lazy-random: the random step's norm over the trained delta's")  # fmt: skip
    ap.add_argument("--cases", nargs="*", choices=sorted(CASES), help="only these cases")
    ap.add_argument("--defences", nargs="*", choices=sorted(DEFENCES), help="only these")
    ap.add_argument("--heldout-docs", type=int, nargs="*",
                    help="rerun the held-out-scored runs with these validation.heldout_docs")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="a tiny smoke run (CI)")
    args = ap.parse_args(argv)
    slug = args.source.replace(":", "-").replace("/", "_")
    out = Path(args.out or REPO / "runs" / f"poison-{slug}")
    out.mkdir(parents=True, exist_ok=True)
    preset = dict(PRESETS["smoke" if args.quick else "tiny"])
    preset["data"] = {**preset.get("data", {}), "source": args.source}
    preset["train"] = {**preset["train"], "rounds": 2 if args.quick else args.rounds}
    data = {"name": "poison", **preset}
    for section, values in LOCAL.items():
        data[section] = {**data.get(section, {}), **values}
    data["topology"] = {**data.get("topology", {}), "levels": "4x4"}
    base = load_config_dict(data, origin="bench/poison.py")
    plan = [
        (c, d)
        for c, d in PLAN
        if (not args.cases or c in args.cases) and (not args.defences or d in args.defences)
    ]
    rows, base_root = [], None
    t0 = time.monotonic()
    for case, defence in plan:
        for docs in args.heldout_docs or [None]:
            if docs and DEFENCES[defence].get("heldout_check") is False:
                continue  # nothing scored: the document count changes nothing
            rows.append(
                run_case(out, base_root, base, case, defence, args.flip, args.lazy_scale, docs)
            )
            base_root = base_root or out / rows[-1]["key"]
    text = markdown(rows, args.source, args.flip, args.lazy_scale)
    write_atomic(out / "poison.md", text.encode())
    write_json_atomic(out / "poison.json", {"source": args.source, "rows": rows})
    print(text)
    print(f"wrote {out / 'poison.md'} in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
