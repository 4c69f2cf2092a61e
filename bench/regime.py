"""The regime ladder: DiPaCo against a tuned DiLoCo across tokens per path parameter.

The DiPaCo paper compares DiPaCo 8x8 with DiLoCo-64 at about 300 tokens per path parameter,
where DiLoCo has saturated (DiLoCo-8 to DiLoCo-64 gains 0.4%); every earlier comparison here
ran at about 6. This climbs from one to the other on one machine: paths small enough (the
``cpu`` preset: vocabulary 256, width 16, 4 blocks, 24.7 k parameters) that a couple of hours
of 2 cores reach 100 tokens per parameter, every path of a model trained at once as one stacked
model (``--path-parallel stacked``, ``torch.compile`` on), and at each point of the ladder, at
equal compute (the same inner steps per path):

    dense        the path-sized model alone (plain AdamW: topology 1, outer step = the delta);
                 inner lr swept
    DiLoCo-4     4 replicas of it on i.i.d. shards, Nesterov outer step; outer lr swept
    DiLoCo-16    16 replicas; the same sweep
    DiPaCo 2x2   product k-means routing (token-bag features), no rescale (``DIPACO``: chosen
                 by --calibrate); outer lr swept, and one more run with an outer lr per module
                 by its sharing count
    DiPaCo 4x4   the same, 16 paths

Every model gets the same tuning budget, four runs (``TUNING``): DiLoCo three outer lrs and one
larger rate (DiLoCo has preferred larger outer steps: docs/results.md), DiPaCo the same three
and a run with an outer lr per module by its sharing count: its level modules keep its own best
rate of the three, the modules all P paths share (embedding and head) take DiLoCo-P's best, whose
modules average as many deltas (when the two rates are the same, that run is the grid's and is
not trained twice); dense four inner lrs. Each model's row at a point is its best run. The
modular models share the preset's inner lr.

Every row states tokens per path parameter (trained tokens of one path, pretraining included,
over its parameters), the corpus's training tokens per path parameter, training FLOPs
(6 x parameters per path x tokens) and bytes moved per trained token. A row that fails (prepare
refused, a run diverged) is recorded as failed with its reason; the others still make the table.
Each run's folder is kept under --out, so a stopped ladder resumes where it stopped.

    python bench/regime.py                                    # the CPU ladder (~75 min, 2 cores)
    python bench/regime.py --source runs/site.jsonl --out runs/regime-site   # a second corpus
    python bench/regime.py --preset gpu --device cuda         # the GPU form: 300 tokens/param
    python bench/regime.py --merge runs/regime-cpu/regime.json runs/regime-gpu/regime.json
    python bench/regime.py --calibrate 25                     # the runs that chose DIPACO
    python bench/regime.py --calibrate 25 --study openings --source runs/site.jsonl
    python bench/regime.py --quick                            # CI's form (a minute)

Writes ``regime.json`` (every run), ``regime.md`` (a table per point and the ratios) and
``regime.png`` (the ratios 4x4/DiLoCo-16, 2x2/DiLoCo-4 and DiLoCo-16/DiLoCo-4 against tokens per
path parameter, log axis) to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paper_table import DILOCO, PLAIN, Variant, run_variant, variant_config  # noqa: E402

from dipaco.config import RunConfig, load_config_dict  # noqa: E402
from dipaco.data.shards import TokenShard  # noqa: E402
from dipaco.fileio import write_atomic, write_json_atomic  # noqa: E402

# Every model's tuning budget: four runs. DiLoCo and DiPaCo take the outer lrs of the grid;
# DiLoCo one more rate (it has preferred larger outer steps: docs/results.md), DiPaCo the
# per-module run (the module docstring). Dense has no outer step: its four runs are inner lrs,
# these multiples of the preset's.
TUNING = {"outer_lrs": (0.7, 1.0, 1.4), "diloco_extra": 2.0, "dense_lrs": (0.5, 1.0, 2.0, 4.0)}
# DiPaCo's routing and outer step in every preset, chosen by --calibrate on builtin:mixed at 25
# tokens per parameter (docs/results.md): product k-means (the paper's, Table 5) and no rescale
# of the outer gradient; with k-means and the `norm` rescale (the run config's defaults) 4x4
# was 4% worse there.
DIPACO = {"routing": {"method": "product"}, "outer": {"rescale": "none"}}

# The base of every run of a preset, and its points (tokens per path parameter, aimed at).
PRESETS: dict[str, dict[str, Any]] = {
    # Paths of 24.7 k parameters (blocks 67% of them): 100 tokens per parameter is 4,900 steps of
    # 512 tokens; on 2 CPU cores the five points take about 90 minutes. The inner lr, 3e-3, is
    # the best of 1.5e-3, 3e-3 and 8e-3 for DiLoCo-4 and DiPaCo 2x2 at 20 tokens per parameter
    # on builtin:mixed (docs/results.md); dense prefers a higher one, which its own sweep finds.
    "cpu": {
        "model": {"vocab_size": 256, "dim": 16, "n_layers": 4, "n_heads": 1, "max_seq_len": 64},
        "data": {"source": "builtin:mixed", "byte_fallback": False},
        "routing": {"features": "tokens"},
        "train": {
            "batch_size": 8,
            "seq_len": 64,
            "lr": 3e-3,
            "warmup_steps": 50,
            "pretrain_steps": 100,
            "inner_steps": 50,
        },
        "points": [6, 12, 25, 50, 100],
        "dipaco": DIPACO,
    },
    # One H100/H200 within an 8-minute call (estimated; not yet run on one): larger paths
    # (vocabulary 512, width 32, 4 blocks: 86 k parameters) at the ladder's top, 300 tokens per
    # parameter, in batches of 8,192 tokens (3,150 steps, 31 rounds of H = 100), on a corpus
    # with four times builtin:mixed's text of each kind where the machine has it; its rows join
    # the CPU ladder with --merge. bench/regime.py --preset gpu --device cuda --points 150 300
    # adds a point below it (about 1.5x the time).
    "gpu": {
        "model": {"vocab_size": 512, "dim": 32, "n_layers": 4, "n_heads": 2, "max_seq_len": 64},
        "data": {"source": "builtin:mixed:48", "byte_fallback": False},
        "routing": {"features": "tokens"},
        "train": {
            "batch_size": 128,
            "seq_len": 64,
            "lr": 3e-3,
            "warmup_steps": 50,
            "pretrain_steps": 100,
            "inner_steps": 100,
        },
        "points": [300],
        "dipaco": DIPACO,
    },
    # The CPU ladder's top point with 8x its batch (4,096 tokens a step, H = 25: 600 steps, 20
    # rounds): is it the small batch that keeps DiLoCo from saturating? (docs/results.md)
    "cpu-wide": {
        "model": {"vocab_size": 256, "dim": 16, "n_layers": 4, "n_heads": 1, "max_seq_len": 64},
        "data": {"source": "builtin:mixed", "byte_fallback": False},
        "routing": {"features": "tokens"},
        "train": {
            "batch_size": 64,
            "seq_len": 64,
            "lr": 6e-3,
            "warmup_steps": 7,
            "pretrain_steps": 13,
            "inner_steps": 25,
        },
        "points": [100],
        "dipaco": DIPACO,
    },
    # CI: a few hundred documents, two low points, every family with a smaller budget.
    "quick": {
        "model": {"vocab_size": 256, "dim": 16, "n_layers": 2, "n_heads": 1, "max_seq_len": 64},
        "data": {
            "source": "builtin:mixed",
            "byte_fallback": False,
            "max_docs": 600,
            "tokenizer_sample_chars": 300_000,
        },
        "routing": {"features": "tokens"},
        "train": {
            "batch_size": 4,
            "seq_len": 64,
            "lr": 3e-3,
            "warmup_steps": 4,
            "pretrain_steps": 8,
            "inner_steps": 8,
        },
        "eval": {"max_docs": 24},
        "points": [1, 2],
        "tuning": {"outer_lrs": (0.7,), "diloco_extra": 1.4, "dense_lrs": (1.0, 2.0)},
        "dipaco": DIPACO,
    },
}
# Local benchmark runs: every round waits for every path; no peer is hostile, so the delta-norm
# check (which would refuse a fast-growing delta again and again) is off, and so is the held-out
# scoring of an open run: a run that diverges shows as a training loss that is not finite (a
# failed row).
LOCAL = {"validation": {"norm_check": "off", "heldout_check": False}}
FAMILIES = ("dense", "DiLoCo-4", "DiLoCo-16", "DiPaCo 2x2", "DiPaCo 4x4")


def steps_for(target: float, params: int, tokens_per_step: int, pretrain: int, h: int) -> int:
    """Rounds of H steps after pretraining that bring a path nearest ``target`` tokens/param."""
    steps = target * params / tokens_per_step
    return max(1, round((steps - pretrain) / h))


def models(
    point_rows: dict[str, dict],
    tuning: dict[str, Any],
    inner_lr: float,
    dipaco: dict[str, Any] | None = None,
) -> list[tuple[str, str, Variant]]:
    """(family, key, variant) of every run at a point, in order; the per-module DiPaCo runs
    take their rates from the runs before them (``point_rows``: key -> row, finished so far).
    ``dipaco``: the DiPaCo runs' routing and outer settings (the preset's, from --calibrate)."""
    dipaco = dipaco or {}

    def structure(levels: str, outer: dict[str, Any]) -> dict[str, Any]:
        return {
            "topology": {"levels": levels},
            "routing": dipaco.get("routing", {}),
            "outer": {**dipaco.get("outer", {}), **outer},
        }

    out: list[tuple[str, str, Variant]] = []
    # The preset's own inner lr first: its pretraining is every other model's.
    for factor in sorted(tuning["dense_lrs"], key=lambda f: f != 1.0):
        lr = inner_lr * factor
        key = f"dense_ilr{lr:g}"
        out.append(
            (
                "dense",
                key,
                Variant(
                    key,
                    f"dense, inner lr {lr:g}",
                    {"topology": {"levels": "1"}, "outer": PLAIN, "train": {"lr": lr}},
                ),
            )
        )
    for replicas in (4, 16):
        for lr in (*tuning["outer_lrs"], tuning["diloco_extra"]):
            key = f"diloco{replicas}_lr{lr}"
            out.append(
                (
                    f"DiLoCo-{replicas}",
                    key,
                    Variant(
                        key,
                        f"DiLoCo-{replicas}, outer lr {lr}",
                        {
                            "topology": {"levels": "1", "replicas": replicas},
                            "routing": {"method": "iid"},
                            "outer": {**DILOCO, "lr": lr},
                        },
                    ),
                )
            )
    for levels in ("2x2", "4x4"):
        for lr in tuning["outer_lrs"]:
            key = f"dipaco{levels}_lr{lr}"
            out.append(
                (
                    f"DiPaCo {levels}",
                    key,
                    Variant(key, f"DiPaCo {levels}, outer lr {lr}", structure(levels, {"lr": lr})),
                )
            )
    for levels in ("2x2", "4x4"):
        rates = sharing_rates(levels, point_rows)
        if rates is None:
            continue
        key = f"dipaco{levels}_by_sharing"
        text = ", ".join(f"{n}: {lr:g}" for n, lr in sorted(rates.items()))
        if len(set(rates.values())) == 1:
            continue  # one rate for all: the grid's run of that rate already is this run
        out.append(
            (
                f"DiPaCo {levels}",
                key,
                Variant(
                    key,
                    f"DiPaCo {levels}, outer lr by sharing ({text})",
                    structure(levels, {"lr": rates[max(rates)], "lr_by_sharing": rates}),
                ),
            )
        )
    return out


def best_lr(rows: dict[str, dict], prefix: str) -> float | None:
    """The outer lr of the best finished run whose key starts with ``prefix`` + "_lr"."""
    done = [r for k, r in rows.items() if k.startswith(prefix + "_lr") and r.get("ok")]
    if not done:
        return None
    return float(min(done, key=lambda r: r["ppl"])["key"].split("_lr")[1])


def sharing_rates(levels: str, rows: dict[str, dict]) -> dict[int, float] | None:
    """The per-module rates of DiPaCo ``levels``, or None until the runs they come from have
    finished: the level modules keep DiPaCo's own best uniform rate, the modules every path
    shares (P of them: the embedding and the head) take the best rate of DiLoCo-P, whose every
    module averages as many deltas (the module docstring)."""
    paths = 16 if levels == "4x4" else 4
    own, shared = best_lr(rows, f"dipaco{levels}"), best_lr(rows, f"diloco{paths}")
    if own is None or shared is None:
        return None
    return {int(levels[0]): own, paths: shared}


def corpus_tokens(root: Path) -> int:
    """Training tokens of a prepared run's corpus (validation and router documents left out)."""
    return TokenShard(root / "data" / "train").n_tokens


def run_point(
    out: Path,
    base: RunConfig,
    target: float,
    device: str,
    compile: str,
    base_root: Path | None,
    plan: Callable[[dict[str, dict]], list[tuple[str, str, Variant]]],
) -> tuple[list[dict], Path | None]:
    """Every run at one point of the ladder that ``plan`` (the rows so far -> every run, in
    order) names; its rows (failed ones included), and the folder later points link data from."""
    params = base.build_topology().parameter_counts(base.build_model_config())["per_path"]
    t = base.train
    rounds = steps_for(target, params, t.batch_size * t.seq_len, t.pretrain_steps, t.inner_steps)
    point = base.replace(train={"rounds": rounds})
    folder = out / f"tpp{target:g}"
    folder.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict] = {}
    done_keys: set[str] = set()
    # Runs link the tokenizer and token files of the ladder's first run, the pretraining and
    # features of the first run at their point, and the router and shards of their family's.
    point_root: Path | None = None
    while True:
        pending = [m for m in plan(rows) if m[1] not in done_keys]
        if not pending:
            break
        family, key, v = pending[0]
        done_keys.add(key)
        # A run of the same family at this point routes alike: its router and shards too.
        kin = next(
            (folder / k for k, r in rows.items() if r.get("ok") and r["family"] == family), None
        )
        row = run_one(
            folder, kin or point_root or base_root, point, v, family, target, device, compile
        )
        rows[key] = row
        if row.get("ok") and point_root is None:
            point_root = folder / key
    return list(rows.values()), base_root or point_root


def openings_study(dipaco: dict[str, Any]) -> list[tuple[str, str, Variant]]:
    """``--calibrate --study openings``: DiPaCo 2x2 and 4x4 (the preset's routing and outer
    step, outer lr 1.0) routed by the first tokens, and by the first block after the openings
    shared by at least 0.2% or 1% of the training documents (``routing.skip_openings``)."""
    out: list[tuple[str, str, Variant]] = []
    for levels in ("2x2", "4x4"):
        for share in (0.0, 0.002, 0.01):
            key = f"dipaco{levels}_skip{share:g}"
            label = f"DiPaCo {levels}, " + (
                f"openings shared by {share:.1%} skipped" if share else "the first tokens"
            )
            overrides = {
                "topology": {"levels": levels},
                "routing": {**dipaco.get("routing", {}), "skip_openings": share},
                "outer": {**dipaco.get("outer", {}), "lr": 1.0},
            }
            out.append((f"DiPaCo {levels}", key, Variant(key, label, overrides)))
    return out


def calibration(inner_lr: float) -> list[tuple[str, str, Variant]]:
    """``--calibrate``'s runs at one point: DiLoCo-4 and DiLoCo-16 at outer lr 1.0; DiPaCo 2x2
    and 4x4 at outer lr 0.7 and 1.0 with k-means or product k-means routing and the ``norm``
    rescale or none; and the inner lr (0.5x, 1x, 2.67x) for DiLoCo-4 and DiPaCo 2x2."""
    out: list[tuple[str, str, Variant]] = []
    for replicas in (4, 16):
        key = f"diloco{replicas}_lr1.0"
        overrides = {
            "topology": {"levels": "1", "replicas": replicas},
            "routing": {"method": "iid"},
            "outer": {**DILOCO, "lr": 1.0},
        }
        out.append(
            (f"DiLoCo-{replicas}", key, Variant(key, f"DiLoCo-{replicas}, outer lr 1.0", overrides))
        )
    for levels in ("2x2", "4x4"):
        for method in ("kmeans", "product"):
            for rescale in ("norm", "none"):
                for lr in (0.7, 1.0):
                    key = f"dipaco{levels}_{method}_{rescale}_lr{lr}"
                    label = f"DiPaCo {levels}, {method} routing, rescale {rescale}, outer lr {lr}"
                    overrides = {
                        "topology": {"levels": levels},
                        "routing": {"method": method},
                        "outer": {"lr": lr, "rescale": rescale},
                    }
                    out.append((f"DiPaCo {levels}", key, Variant(key, label, overrides)))
    for factor in (0.5, 8 / 3):
        lr = inner_lr * factor
        for family, key, v in out[:1] + [m for m in out if m[1] == "dipaco2x2_kmeans_norm_lr0.7"]:
            train = {"train": {"lr": lr}}
            out.append(
                (
                    f"{family}, inner lr {lr:g}",
                    f"{key}_ilr{lr:g}",
                    Variant(
                        f"{key}_ilr{lr:g}", f"{v.label}, inner lr {lr:g}", {**v.overrides, **train}
                    ),
                )
            )
    return out


def run_one(
    folder: Path,
    base_root: Path | None,
    point: RunConfig,
    v: Variant,
    family: str,
    target: float,
    device: str,
    compile: str,
) -> dict:
    """One run through bench/paper_table.py's code path; its row, or a failed row with why."""
    failed = folder / v.key / "failed.json"
    if failed.exists():
        print(f"[{v.key}] failed before: {json.loads(failed.read_text())['reason']}", flush=True)
        return json.loads(failed.read_text())
    config = variant_config(point, v)
    config = config.replace(**LOCAL)
    steps = point.train.pretrain_steps + point.train.rounds * point.train.inner_steps
    params = config.build_topology().parameter_counts(config.build_model_config())["per_path"]
    head = {
        "key": v.key,
        "model": v.label,
        "family": family,
        "target_tokens_per_param": target,
        "steps_per_path": steps,
        "series": f"{config.data.source}, paths of {params / 1000:.1f} k",
    }
    try:
        rows = run_variant(
            folder,
            base_root,
            config,
            v,
            device,
            base_batch=point.train.batch_size,
            path_parallel="stacked",
            compile=compile,
        )
    except Exception as exc:  # noqa: BLE001 - a failed row, recorded with its reason
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        traceback.print_exc()
        print(f"[{v.key}] FAILED: {reason}", flush=True)
        row = {**head, "ok": False, "reason": reason}
        failed.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(failed, row)
        return row
    row = {**head, **rows[0], "ok": math.isfinite(rows[0]["ppl"])}
    if not row["ok"]:
        row["reason"] = f"validation perplexity {rows[0]['ppl']} (diverged)"
    tokens = row["steps_per_path"] * point.train.batch_size * point.train.seq_len
    row["tokens_per_param"] = tokens / row["params_per_path"]
    row["corpus_tokens"] = corpus_tokens(folder / v.key)
    row["corpus_tokens_per_param"] = row["corpus_tokens"] / row["params_per_path"]
    row["flops_per_token"] = row["flops"] / row["tokens"]
    return row


# ---- the summary -----------------------------------------------------------------------------
def series_of(row: dict) -> str:
    """Which ladder a row belongs to: its corpus and path size (merged ladders stay apart)."""
    if row.get("series"):
        return row["series"]
    source = (row.get("corpus") or {}).get("source", "?")
    params = row.get("params_per_path")
    return f"{source}, paths of {params / 1000:.1f} k" if params else source


def point_of(row: dict) -> tuple[str, float]:
    """A row's point: its ladder and the tokens per parameter it aimed at."""
    return series_of(row), float(row["target_tokens_per_param"])


def best_rows(rows: list[dict]) -> dict[tuple[str, tuple[str, float]], dict]:
    """(family, point) -> the family's best finished run at that point (lowest perplexity)."""
    best: dict[tuple[str, tuple[str, float]], dict] = {}
    for r in rows:
        if not r.get("ok"):
            continue
        k = (r["family"], point_of(r))
        if k not in best or r["ppl"] < best[k]["ppl"]:
            best[k] = r
    return best


RATIOS = (
    ("DiPaCo 4x4 / DiLoCo-16", "DiPaCo 4x4", "DiLoCo-16", 0.92),
    ("DiPaCo 2x2 / DiLoCo-4", "DiPaCo 2x2", "DiLoCo-4", 1.0),
    ("DiLoCo-16 / DiLoCo-4", "DiLoCo-16", "DiLoCo-4", None),
)


def ratio_table(rows: list[dict]) -> list[dict]:
    """Per point of every ladder (by measured tokens per parameter): the three ratios of best
    runs, and whether DiLoCo has saturated there (DiLoCo-16 within 3% of DiLoCo-4)."""
    best = best_rows(rows)
    out = []
    for point in sorted({point_of(r) for r in rows}):
        at = {f: best.get((f, point)) for f in FAMILIES}
        measured = next((r["tokens_per_param"] for r in at.values() if r), None)
        entry: dict[str, Any] = {"series": point[0], "target": point[1]}
        entry["tokens_per_param"] = measured
        for name, a, b, _ in RATIOS:
            entry[name] = at[a]["ppl"] / at[b]["ppl"] if at[a] and at[b] else None
        entry["saturated"] = (
            entry["DiLoCo-16 / DiLoCo-4"] is not None and entry["DiLoCo-16 / DiLoCo-4"] >= 0.97
        )
        entry["corpus_tokens_per_param"] = next(
            (r["corpus_tokens_per_param"] for r in at.values() if r), None
        )
        entry["best"] = {f: (r["key"], r["ppl"]) for f, r in at.items() if r}
        out.append(entry)
    return out


def trend(table: list[dict], name: str, level: float) -> dict | None:
    """A least-squares line of ``name`` against log10(tokens per parameter) over ``table``'s
    points (one ladder): its slope per tenfold, its value at the top point, and where it
    crosses ``level`` going up (``already`` if it is at or below it at the top point; None if
    it never reaches it)."""
    pts = [(math.log10(e["tokens_per_param"]), e[name]) for e in table if e.get(name) is not None]
    if len(pts) < 2:
        return None
    x, y = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
    slope, intercept = np.polyfit(x, y, 1)
    at_top = float(intercept + slope * x.max())
    cross: float | str | None = None
    if at_top <= level:
        cross = "already"
    elif slope < 0:
        cross = float(10 ** ((level - intercept) / slope))
    return {
        "slope_per_decade": float(slope),
        "intercept": float(intercept),
        "at_top": at_top,
        "crosses_at": cross,
    }


def trends(table: list[dict]) -> dict[str, dict[str, dict | None]]:
    """Per ladder, per target ratio: its trend line (``trend``)."""
    out: dict[str, dict[str, dict | None]] = {}
    for series in dict.fromkeys(e["series"] for e in table):
        points = [e for e in table if e["series"] == series]
        out[series] = {
            name: trend(points, name, level) for name, _, _, level in RATIOS if level is not None
        }
    return out


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "—" if x is None else format(x, spec)


def _si(x: float) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f}"


def markdown(rows: list[dict], table: list[dict], title: str) -> str:
    lines = [f"# {title}", ""]
    best = best_rows(rows)
    for point in sorted({point_of(r) for r in rows}):
        here = [r for r in rows if point_of(r) == point]
        done = [r for r in here if r.get("ok")]
        measured = done[0]["tokens_per_param"] if done else point[1]
        lines += [
            f"## {point[0]}: {measured:.1f} tokens per path parameter (aimed at {point[1]:g})",
            "",
            "| model | best | params / path | total params | steps / path | tokens / param "
            "| corpus tokens / param | FLOPs | FLOPs / token | bytes / token | val ppl "
            "| train (s) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in here:
            if not r.get("ok"):
                lines.append(
                    f"| {r['model']} | | | | {r['steps_per_path']} | | | | | | "
                    f"**failed**: {r.get('reason', '?')} | |"
                )
                continue
            mark = "**best**" if best.get((r["family"], point)) is r else ""
            lines.append(
                f"| {r['model']} | {mark} | {_si(r['params_per_path'])} | {_si(r['total_params'])} "
                f"| {r['steps_per_path']} | {r['tokens_per_param']:.1f} "
                f"| {r['corpus_tokens_per_param']:.0f} | {_si(r['flops'])} "
                f"| {_si(r['flops_per_token'])} | {r['bytes_per_token']:.1f} | {r['ppl']:.2f} "
                f"| {r['train_seconds']:.0f} |"
            )
        corpora = {
            (c["source"], c["fingerprint"], r["corpus_tokens"], c["train_docs"])
            for r in done
            if (c := r.get("corpus"))
        }
        for source, fingerprint, tokens, docs in sorted(corpora):
            lines.append(
                f"\nCorpus `{source}` (fingerprint `{fingerprint}`): {docs:,} training documents, "
                f"{tokens:,} training tokens."
            )
        lines.append("")
    lines += [
        "## The ratios (each model at its best run)",
        "",
        "| ladder | tokens / param | corpus tokens / param | 4x4 / DiLoCo-16 | 2x2 / DiLoCo-4 "
        "| DiLoCo-16 / DiLoCo-4 | DiLoCo saturated (within 3%) |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in table:
        lines.append(
            f"| {e['series']} | {_fmt(e['tokens_per_param'], '.1f')} "
            f"| {_fmt(e['corpus_tokens_per_param'], '.0f')} "
            f"| {_fmt(e['DiPaCo 4x4 / DiLoCo-16'])} | {_fmt(e['DiPaCo 2x2 / DiLoCo-4'])} "
            f"| {_fmt(e['DiLoCo-16 / DiLoCo-4'])} | {'yes' if e['saturated'] else 'no'} |"
        )
    lines.append("")
    for series, fits in trends(table).items():
        for name, _, _, level in RATIOS:
            fit = fits.get(name)
            if level is None or fit is None:
                continue
            cross = fit["crosses_at"]
            if cross == "already":
                where = f"is at or below {level} at the top point ({fit['at_top']:.3f})"
            elif cross is None:
                where = f"rises going up ({fit['at_top']:.3f} at the top point): never {level}"
            else:
                where = f"reaches {level} at about {cross:,.0f} tokens per parameter"
            lines.append(
                f"- {series}, {name}: {fit['slope_per_decade']:+.3f} per tenfold tokens per "
                f"parameter (least squares on log10); the line {where}."
            )
    return "\n".join(lines) + "\n"


def chart(table: list[dict], path: Path, title: str) -> None:
    """The three ratios against tokens per path parameter: a colour per ratio, a line style and
    marker per ladder (corpus and path size)."""
    fig, ax = plt.subplots(figsize=(9, 5.5))
    colors = ("#1f77b4", "#ff7f0e", "#2ca02c")
    styles = (("o", "-"), ("s", "--"), ("^", ":"), ("D", "-."))
    ladders = list(dict.fromkeys(e["series"] for e in table))
    for (name, _, _, _), color in zip(RATIOS, colors, strict=True):
        for series, (marker, line) in zip(ladders, styles * 4, strict=False):
            pts = [
                (e["tokens_per_param"], e[name])
                for e in table
                if e["series"] == series and e.get(name) is not None
            ]
            if pts:
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    marker=marker,
                    linestyle=line,
                    color=color,
                    label=f"{name} ({series})" if len(ladders) > 1 else name,
                )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(0.97, color="gray", linestyle="--", linewidth=0.8, label="DiLoCo saturated above")
    ax.axhline(0.92, color="gray", linestyle=":", linewidth=1, label="4x4 target (0.92)")
    ax.set_xscale("log")
    ax.set_xlabel("tokens per path parameter (log)")
    ax.set_ylabel("validation perplexity ratio (each model at its best run)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(out: Path, rows: list[dict], title: str) -> str:
    table = ratio_table(rows)
    text = markdown(rows, table, title)
    write_atomic(out / "regime.md", text.encode())
    write_json_atomic(out / "regime.json", {"rows": rows, "ratios": table, "trends": trends(table)})
    chart(table, out / "regime.png", title)
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--out", help="results folder (default runs/regime-<preset>)")
    ap.add_argument("--source", help="corpus (default: builtin:mixed)")
    ap.add_argument("--points", nargs="+", type=float, help="tokens per path parameter to aim at")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, or auto")
    ap.add_argument("--compile", choices=["on", "off", "auto"], default="on")
    ap.add_argument("--quick", action="store_true", help="CI's form (the quick preset)")
    ap.add_argument("--fresh", action="store_true", help="delete --out first")
    ap.add_argument(
        "--only",
        nargs="+",
        metavar="KEY",
        help="train only these runs at each point (keys as in regime.json: dense_ilr0.003, "
        "diloco16_lr1.0, dipaco4x4_lr0.7, dipaco4x4_by_sharing...)",
    )
    ap.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="no training: the table and chart of the rows of earlier regime.json files",
    )
    ap.add_argument(
        "--calibrate",
        nargs="?",
        type=float,
        const=25.0,
        metavar="TOKENS_PER_PARAM",
        help="not the ladder: the runs that chose the preset's DiPaCo routing, rescale and inner "
        "lr, at one point (default 25 tokens per parameter); writes calibrate.md (openings.md "
        "with --study openings)",
    )
    ap.add_argument(
        "--study",
        choices=["structure", "openings"],
        default="structure",
        help="with --calibrate: DiPaCo's routing and rescale and the inner lr (structure), or "
        "routing by the first tokens against skipping the openings many documents share",
    )
    args = ap.parse_args(argv)
    preset_name = "quick" if args.quick else args.preset
    out = Path(args.out or f"runs/regime-{preset_name}")
    if args.fresh and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        rows = [r for path in args.merge for r in json.loads(Path(path).read_text())["rows"]]
        print(write_outputs(out, rows, "The regime ladder (merged)"))
        return 0
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")
    spec = PRESETS[preset_name]
    preset = {k: v for k, v in spec.items() if k not in ("points", "tuning", "dipaco")}
    tuning = spec.get("tuning", TUNING)
    if args.source:
        preset["data"] = {**preset["data"], "source": args.source}
    preset.setdefault("eval", {"max_docs": None})
    base = load_config_dict({"name": "regime", **preset}, origin=f"preset {preset_name}")
    began = time.monotonic()
    if args.calibrate is not None:
        rows, _ = run_point(
            out,
            base,
            args.calibrate,
            device,
            args.compile,
            None,
            lambda done: (
                calibration(base.train.lr)
                if args.study == "structure"
                else openings_study(spec.get("dipaco", {}))
            ),
        )
        text = calibration_table(rows, args.calibrate)
        name = "calibrate" if args.study == "structure" else "openings"
        write_atomic(out / f"{name}.md", text.encode())
        write_json_atomic(out / f"{name}.json", {"rows": rows})
        print(text)
        print(f"wrote {out / f'{name}.md'} in {time.monotonic() - began:.0f} s")
        return 0
    points = args.points or spec["points"]
    rows = []
    base_root: Path | None = None
    for i, target in enumerate(points):
        print(f"== point {i + 1}/{len(points)}: {target:g} tokens per path parameter", flush=True)
        point_rows, base_root = run_point(
            out,
            base,
            target,
            device,
            args.compile,
            base_root,
            lambda done: [
                m
                for m in models(done, tuning, base.train.lr, spec.get("dipaco"))
                if args.only is None or m[1] in args.only
            ],
        )
        rows += point_rows
        # After every point: a ladder stopped later still has the table of what it finished.
        text = write_outputs(out, rows, f"The regime ladder, preset {preset_name} ({device})")
    print(text)
    print(f"wrote {out / 'regime.md'}, {out / 'regime.png'} in {time.monotonic() - began:.0f} s")
    return 0


def calibration_table(rows: list[dict], target: float) -> str:
    lines = [
        f"# Calibration at {target:g} tokens per path parameter",
        "",
        "| run | val ppl | against its reference (DiLoCo-4 for 2x2, -16 for 4x4; for skipped "
        "openings, the first tokens) |",
        "|---|---|---|",
    ]
    ppl = {r["key"]: r["ppl"] for r in rows if r.get("ok")}
    for r in rows:
        if not r.get("ok"):
            lines.append(f"| {r['model']} | **failed**: {r.get('reason')} | |")
            continue
        ref = "diloco16_lr1.0" if "4x4" in r["key"] else "diloco4_lr1.0"
        if "_skip" in r["key"]:  # the openings study: against routing by the first tokens
            ref = r["key"].split("_skip")[0] + "_skip0"
        against = ppl[r["key"]] / ppl[ref] if ref in ppl and r["key"].startswith("dipaco") else None
        lines.append(f"| {r['model']} | {r['ppl']:.2f} | {_fmt(against)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
