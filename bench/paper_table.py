"""The DiPaCo paper's comparison (its Tables 1 and 3) at small scale, in one command.

Every model is trained and evaluated on the same corpus, through the same code path (prepare ->
coordinator -> local peers -> routed evaluation), with the same per-path size, the same inner
steps per path, and the same evaluation (validation perplexity without the first 32 tokens):

    dense                    topology 1; outer step = the delta itself (plain AdamW training)
    dense, 4x steps          the same, trained four times as many steps
    dense, AxB params        topology 1 with as many blocks as DiPaCo AxB has in all: its total
                             parameters, trained like one path (the paper's dense baseline)
    dense, AxB params + tokens   the same trained on DiPaCo AxB's tokens (a P-times batch)
    DiLoCo-P (i.i.d.)        topology 1 with P replicas on i.i.d. shards, Nesterov outer step:
                             DiPaCo with P paths at equal compute (DiLoCo-16 next to 4x4)
    DiLoCo-4 (k-means)       the same on k-means shards
    flat MoE-4               one level of 4 fully independent paths (nothing shared), k-means
    DiPaCo 2x2               k-means routing
    DiPaCo 4x4               k-means routing
    DiPaCo 4x4 + disc.       one discriminative phase halfway (section 2.4.2)
      + early stopping       each path's parameters at its lowest held-out loss (Table 3)
      + re-routing 64        switching path every 64 tokens (section 2.4.3), with the prefix
                             router on the previous chunk, then with a learned chunk router

All models start from one dense pretraining (as in the paper), except those whose schedule is
longer or whose shape differs, which pretrain their own. Each model's run folder is kept under
``--out``; a finished model is not trained again, so an interrupted benchmark continues.

    python bench/paper_table.py --preset tiny            # 2 CPU cores, about 25 minutes
    python bench/paper_table.py --preset small --device cuda   # a GPU; paths of about 20 M

Every row states its compute (training FLOPs, 6 x parameters per path x tokens, plus the scoring
of a discriminative phase) and its communication (bytes moved per trained token: each task
downloads its path's shared modules and uploads their deltas, float32; a dense model trained on
P workers' tokens is charged what a ring all-reduce would move on P workers).

    python bench/paper_table.py --preset capacity    # the long preset: capacity binds, ~90 min
    python bench/paper_table.py --preset capacity --quick   # its CI form (a couple of minutes)

With ``--curves`` (on for ``capacity``) every model is evaluated after each round and the
learning curves are drawn against steps per path and against training FLOPs.

Writes ``paper_table.md``, ``paper_table.json``, the bar chart ``paper_table.png`` and (with
curves) ``curves.png`` to --out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from dipaco.config import OuterSection, RunConfig, load_config_dict  # noqa: E402
from dipaco.coordinator.early_stopping import EarlyStopping  # noqa: E402
from dipaco.errors import DipacoError  # noqa: E402
from dipaco.fileio import write_atomic, write_json_atomic  # noqa: E402
from dipaco.prepare.pipeline import prepare  # noqa: E402
from dipaco.routing.features import FEATURE_KINDS  # noqa: E402
from dipaco.run.evaluate import evaluate_modules  # noqa: E402
from dipaco.run.factory import build_coordinator  # noqa: E402
from dipaco.run.local import run_local_peers, wait_for_end  # noqa: E402
from dipaco.run.metrics_log import MetricsLog  # noqa: E402

# The base of every model in a preset; variants change topology, routing, outer step, rounds.
PRESETS: dict[str, dict[str, Any]] = {
    # Two CPU cores, about 18 minutes for every row (see docs/results.md).
    "tiny": {
        "model": {"vocab_size": 2048, "dim": 64, "n_layers": 4, "n_heads": 4, "max_seq_len": 128},
        "data": {"tokenizer_sample_chars": 2_000_000},
        "train": {
            "batch_size": 8,
            "seq_len": 128,
            "lr": 3e-3,
            "warmup_steps": 20,
            "pretrain_steps": 60,
            "inner_steps": 25,
            "rounds": 8,
        },
        "eval": {"max_docs": 150},
    },
    # One GPU: paths of about 10 M parameters (width 256, 8 blocks, vocab 8192), seq 256.
    "small": {
        "model": {
            "vocab_size": 8192,
            "dim": 256,
            "n_layers": 8,
            "n_heads": 4,
            "max_seq_len": 256,
        },
        "data": {"tokenizer_sample_chars": 4_000_000},
        "train": {
            "batch_size": 32,
            "seq_len": 256,
            "lr": 1e-3,
            "warmup_steps": 30,
            "pretrain_steps": 100,
            "inner_steps": 20,
            "rounds": 8,
        },
        "eval": {"max_docs": 200},
    },
    # For the test suite: the smallest model that still has two levels; a minute or two.
    "smoke": {
        "model": {"vocab_size": 512, "dim": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 64},
        "data": {"max_docs": 400, "tokenizer_sample_chars": 300_000, "heldout_fraction": 0.1},
        "routing": {"router_fraction": 0.1},
        "train": {
            "batch_size": 4,
            "seq_len": 64,
            "lr": 3e-3,
            "warmup_steps": 2,
            "pretrain_steps": 6,
            "inner_steps": 3,
            "rounds": 2,
        },
        "eval": {"max_docs": 24},
    },
}

# The long preset: paths small enough (4 blocks of width 64, vocabulary 1,024) that their capacity
# binds within the run on a corpus of several kinds of text (builtin:mixed), trained for
# thousands of inner steps per path (100 pretraining + 40 rounds of H = 50: 2,100 steps; DiPaCo
# 4x4 takes about 55 min on 2 CPU cores).
PRESETS["capacity"] = {
    "model": {"vocab_size": 1024, "dim": 64, "n_layers": 4, "n_heads": 4, "max_seq_len": 128},
    "data": {"source": "builtin:mixed", "tokenizer_sample_chars": 3_000_000},
    # Token-bag routing features: the 100-step initial model's hidden states lose the source of
    # a document (docs/results.md, the routing study); the rows ..._features_hidden keep them.
    "routing": {"features": "tokens"},
    "train": {
        "batch_size": 8,
        "seq_len": 128,
        # Too high (at 1.5e-3 dense, DiLoCo-4 and DiPaCo 2x2 end 14-16% lower on the same corpus:
        # docs/results.md); kept so that the documented table reproduces. Pass --lr 0.0015 for
        # the tuned comparison.
        "lr": 3e-3,
        "warmup_steps": 50,
        "pretrain_steps": 100,
        "inner_steps": 50,
        "rounds": 40,
    },
    "eval": {"max_docs": 120},
}
# The rows each preset trains unless --only names others; "curves": evaluate every round.
CORE = [
    "dense",
    "dense_4x4_params",
    "diloco4_iid",
    "dipaco2x2",
    "diloco16_iid",
    "dipaco4x4",
]
FULL = [
    "dense",
    "dense_4x_steps",
    "dense_2x2_params",
    "dense_4x4_params",
    "diloco4_iid",
    "diloco4_kmeans",
    "flat_moe4",
    "dipaco2x2",
    "diloco16_iid",
    "dipaco4x4",
    "dipaco4x4_disc",
]
PRESET_ROWS: dict[str, list[str]] = {"capacity": CORE}
PRESET_CURVES = {"capacity"}

# Local runs: every peer is a thread of this process, so rounds wait for every path and every
# task is H steps: results are deterministic. No peer is hostile: the paper's outer step, with no
# delta scored on held-out documents (an open run's default; bench/poison.py measures what it
# costs an honest run).
LOCAL = {
    "scheduler": {"quorum": 1.0, "min_step_fraction": 1.0},
    "validation": {"heldout_check": False},
}
PLAIN = {"lr": 1.0, "momentum": 0.0, "nesterov": False, "rescale": "none"}  # theta <- theta_i
DILOCO = {"lr": 0.7, "momentum": 0.9, "nesterov": True, "rescale": "none"}
DEFAULT_RESCALE = OuterSection().rescale


@dataclass
class Variant:
    key: str
    label: str
    overrides: dict[str, Any]
    rows: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (label, eval options)


def total_blocks(levels: str, layers: int) -> int:
    """Blocks in all of DiPaCo ``levels`` (each level a share of the path's blocks)."""
    counts = [int(k) for k in levels.split("x")]
    return sum(k * layers // len(counts) for k in counts)


def variants(base: RunConfig, only: set[str] | None) -> list[Variant]:
    """Every model the benchmark knows, in table order; ``only`` picks some by key."""
    rounds = base.train.rounds
    layers = base.model.n_layers
    batch = base.train.batch_size
    # The paper's re-routing interval is 64 tokens; shorter sequences re-route at their middle.
    w = 64 if base.train.seq_len > 64 else base.train.seq_len // 2
    out = [
        Variant("dense", "dense", {"topology": {"levels": "1"}, "outer": PLAIN}),
        Variant(
            "dense_4x_steps",
            "dense, 4x steps",
            {"topology": {"levels": "1"}, "outer": PLAIN, "train": {"rounds": 4 * rounds}},
        ),
    ]
    for levels in ("2x2", "4x4"):
        paths = math.prod(int(k) for k in levels.split("x"))
        big = {"n_layers": total_blocks(levels, layers)}
        out += [
            Variant(
                f"dense_{levels}_params",
                f"dense, DiPaCo-{levels} params",
                {"topology": {"levels": "1"}, "outer": PLAIN, "model": big},
            ),
            Variant(
                f"dense_{levels}_tokens",
                f"dense, DiPaCo-{levels} params and tokens",
                {
                    "topology": {"levels": "1"},
                    "outer": PLAIN,
                    "model": big,
                    "train": {"batch_size": paths * batch},
                },
            ),
        ]
    # Each DiLoCo-P row stands just before the DiPaCo topology with P paths it is compared with.
    out += [
        Variant(
            "diloco4_iid",
            "DiLoCo-4, i.i.d. shards",
            {"topology": {"levels": "1", "replicas": 4}, "routing": {"method": "iid"}},
        ),
        Variant(
            "diloco4_kmeans",
            "DiLoCo-4, k-means shards",
            {"topology": {"levels": "1", "replicas": 4}},
        ),
        Variant("flat_moe4", "flat MoE-4 (k-means)", {"topology": {"levels": "4", "shared": []}}),
        Variant("dipaco2x2", "DiPaCo 2x2 (k-means)", {"topology": {"levels": "2x2"}}),
        Variant(
            "diloco16_iid",
            "DiLoCo-16, i.i.d. shards",
            {"topology": {"levels": "1", "replicas": 16}, "routing": {"method": "iid"}},
        ),
        Variant("dipaco4x4", "DiPaCo 4x4 (k-means)", {"topology": {"levels": "4x4"}}),
    ]
    # The outer-gradient rescales other than the default (docs/results.md: the sweep).
    for levels in ("2x2", "4x4"):
        for mode in ("none", "sqrt", "linear", "norm"):
            if mode != DEFAULT_RESCALE:
                out.append(
                    Variant(
                        f"dipaco{levels}_rescale_{mode}",
                        f"DiPaCo {levels} (k-means), rescale {mode}",
                        {"topology": {"levels": levels}, "outer": {"rescale": mode}},
                    )
                )
    # The routing features other than the preset's (dipaco.routing.features).
    for levels in ("2x2", "4x4"):
        for kind in FEATURE_KINDS:
            if kind != base.routing.features:
                out.append(
                    Variant(
                        f"dipaco{levels}_features_{kind}",
                        f"DiPaCo {levels} (k-means), {kind} routing features",
                        {"topology": {"levels": levels}, "routing": {"features": kind}},
                    )
                )
    out.append(
        Variant(
            "dipaco4x4_disc",
            "DiPaCo 4x4 + discriminative",
            {
                "topology": {"levels": "4x4"},
                "routing": {"discriminative_after": [rounds // 2]},
                "eval": {"early_stopping": True},
            },
            rows=[
                ("+ early stopping", {"early": True}),
                (f"+ early stopping + re-routing every {w} tokens", {"early": True, "window": w}),
                (
                    f"+ early stopping + re-routing every {w // 2} tokens",
                    {"early": True, "window": w // 2},
                ),
                (
                    f"+ early stopping + re-routing every {w} tokens, learned chunk router",
                    {"early": True, "window": w, "learned": True},
                ),
                (
                    f"+ early stopping + re-routing every {w // 2} tokens, learned chunk router",
                    {"early": True, "window": w // 2, "learned": True},
                ),
            ],
        )
    )
    out.append(
        Variant(
            "dipaco4x4_plateau",
            "DiPaCo 4x4 + discriminative at the held-out plateau",
            {
                "topology": {"levels": "4x4"},
                # A phase once the paths' held-out loss improves by less than 1% in a round.
                "routing": {"discriminative_plateau": 0.01},
                "eval": {"early_stopping": True},
            },
            rows=[("+ early stopping", {"early": True})],
        )
    )
    for v in out:
        if v.key.startswith("diloco"):
            v.overrides.setdefault("outer", DILOCO)
    known = {v.key for v in out}
    if only is not None and only - known:
        raise SystemExit(f"unknown model keys {sorted(only - known)}; known: {sorted(known)}")
    return [v for v in out if only is None or v.key in only]


def variant_config(base: RunConfig, v: Variant) -> RunConfig:
    data = base.to_dict()
    for section, values in {**LOCAL, **v.overrides}.items():
        data[section] = {**data[section], **values}
    data["name"] = v.key
    data["baseline"] = False
    return load_config_dict(data, origin=f"variant {v.key}")


def bytes_per_token(config: RunConfig, base_batch: int) -> float:
    """Bytes moved between workers per trained token, float32, both directions.

    A task downloads its path's shared modules (those more than one path goes through) and
    uploads their deltas, once per H steps. A single model trained on k workers' batch (a batch
    k times the base one) is charged a ring all-reduce of its gradient on k workers every step.
    """
    topology = config.build_topology()
    counts = topology.parameter_counts(config.build_model_config())
    step_tokens = config.train.batch_size * config.train.seq_len
    if topology.num_paths == 1:
        k = config.train.batch_size // base_batch
        return 2 * (k - 1) / k * 4 * counts["total"] / step_tokens if k > 1 else 0.0
    sharing: dict[str, int] = {}
    for p in range(topology.num_paths):
        for mid in topology.path_modules(p):
            sharing[mid] = sharing.get(mid, 0) + 1
    per_path = sum(counts["modules"][mid] for mid in topology.path_modules(0) if sharing[mid] > 1)
    return 2 * 4 * per_path / (config.train.inner_steps * step_tokens)


def corpus_of(root: Path, config: RunConfig) -> dict:
    """What a row was trained and scored on: the source, document counts and a fingerprint.

    The fingerprint hashes the tokenized training and validation sets, so two rows share it
    only if they saw the same documents (``builtin:mixed`` reads what the machine has
    installed, and changes when a package is added).
    """
    manifests = [json.loads((root / "data" / f"{s}.json").read_text()) for s in ("train", "val")]
    digest = hashlib.sha256(":".join(m["tokens_sha256"] for m in manifests).encode())
    return {
        "source": config.data.source,
        "train_docs": manifests[0]["n_docs"],
        "val_docs": manifests[1]["n_docs"],
        "fingerprint": digest.hexdigest()[:12],
    }


def mixed_corpora(rows: list[dict]) -> str | None:
    """A message naming the rows' corpora if they differ (rows without one are not compared)."""
    seen: dict[str, list[str]] = {}
    for r in rows:
        if r.get("corpus"):
            c = r["corpus"]
            name = f"{c['source']} ({c['train_docs']} training documents, {c['fingerprint']})"
            seen.setdefault(name, []).append(r["model"])
    if len(seen) < 2:
        return None
    return "; ".join(f"{name}: {', '.join(models)}" for name, models in seen.items())


def curve(metrics: MetricsLog) -> list[dict]:
    """The run's per-round validation perplexity (the last evaluation of each round)."""
    by_round: dict[int, dict] = {}
    for e in metrics.read():
        if e.get("event") == "eval" and e.get("model") == "dipaco":
            by_round[e["round"]] = {
                "round": e["round"],
                "steps": e["steps_per_path"],
                "ppl": e["ppl"],
            }
    return [by_round[r] for r in sorted(by_round)]


def run_variant(
    out: Path,
    base_root: Path | None,
    config: RunConfig,
    v: Variant,
    device: str,
    *,
    curves: bool = False,
    base_batch: int | None = None,
    path_parallel: str | None = None,
    compile: str = "auto",
) -> list[dict]:
    root = out / v.key
    done = root / "bench.json"
    if done.exists() and json.loads(done.read_text()).get("complete", True):
        print(f"[{v.key}] already done", flush=True)
        return json.loads(done.read_text())["rows"]
    t0 = time.monotonic()
    prep = prepare(
        root,
        config,
        stage=lambda s: print(f"[{v.key}] {s}", flush=True),
        reuse=base_root,
        device=device,
    )
    prepared_s = time.monotonic() - t0
    metrics = MetricsLog(root / "metrics.jsonl")
    topology = config.build_topology()
    c = config

    def on_event(e: dict) -> None:
        if e["event"] == "round":
            print(f"[{v.key}] round {e['round']}/{c.train.rounds}", flush=True)
        elif e["event"] in ("routing_phase", "routing_phase_failed"):
            print(f"[{v.key}] {e}", flush=True)

    metrics.listeners.append(on_event)
    t1 = time.monotonic()
    coordinator = build_coordinator(prep, metrics, evaluate=curves, device=device)
    stop = threading.Event()
    # One local peer; path-parallel, it trains every path of a round at once: as one stacked
    # model ("stacked": the same parameters up to float rounding, several times faster for small
    # paths) or interleaved on CUDA streams ("streams": bit for bit on a CPU).
    parallel = max(2, topology.num_paths) if path_parallel else 1
    diverged: list[str] = []

    def watch(info: dict) -> None:  # a loss that is not finite: the run diverged, stop it
        if not math.isfinite(info["loss"]) and not diverged:
            diverged.append(f"training loss {info['loss']} on path P{info['path']}")
            stop.set()

    threads = run_local_peers(
        coordinator,
        prep,
        1,
        stop=stop,
        on_progress=watch,
        device=device,
        parallel=parallel,
        batching=path_parallel or "stacked",
        compile=compile,
    )
    try:
        wait_for_end(
            coordinator, threads, f"{v.key}: the local peer stopped before the run finished"
        )
    except DipacoError:
        if diverged:
            raise DipacoError(f"{v.key}: diverged ({diverged[0]})") from None
        raise
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    if coordinator.failure:
        raise DipacoError(coordinator.failure)
    train_s = time.monotonic() - t1
    prep.refresh()
    counts = topology.parameter_counts(c.build_model_config())
    per_step = c.train.batch_size * c.train.seq_len
    tokens = per_step * (
        c.train.pretrain_steps + topology.num_paths * c.train.rounds * c.train.inner_steps
    )
    # Training FLOPs ~ 6 x parameters x tokens; a discriminative phase adds its scoring
    # forward passes (2 x parameters x tokens, every router document under every path).
    flops = 6.0 * counts["per_path"] * tokens
    for routing in prep.routings[1:]:
        scored = routing.stats.get("router_docs", 0) * c.train.seq_len
        flops += (
            2.0
            * counts["per_path"]
            * scored
            * (routing.stats.get("candidates") or topology.num_paths)
        )
    base_row = {
        "key": v.key,
        "params_per_path": counts["per_path"],
        "total_params": counts["total"],
        "paths": topology.num_paths,
        "tokens": tokens,
        "flops": flops,
        "bytes_per_token": bytes_per_token(c, base_batch or c.train.batch_size),
        "steps_per_path": c.train.pretrain_steps + c.train.rounds * c.train.inner_steps,
        "train_seconds": round(train_s, 1),
        "prepare_seconds": round(prepared_s, 1),
        "inner_lr": c.train.lr,
        "corpus": corpus_of(root, c),
    }
    if curves:
        base_row["curve"] = curve(metrics)
    rows = []
    for label, options in [(v.label, {}), *v.rows]:
        t2 = time.monotonic()
        early = EarlyStopping(root / "early_stopping") if options.get("early") else None
        result = evaluate_modules(
            prep,
            coordinator.store.params,
            early=early,
            window=options.get("window"),
            learned=options.get("learned", False),
            device=device,
        )
        if label == v.label and not result["loss"] < math.log(c.model.vocab_size):
            # A run that ends no better than a uniform guess over the vocabulary (or at an
            # infinite loss) diverged, whether or not a training loss was ever NaN.
            raise DipacoError(
                f"{v.key}: diverged (validation loss {result['loss']:.4g}, no better than "
                f"uniform over {c.model.vocab_size} tokens: {math.log(c.model.vocab_size):.4g})"
            )
        rows.append(
            {
                **base_row,
                "model": label if label == v.label else f"{v.label} {label}",
                "ppl": result["ppl"],
                "loss": result["loss"],
                "eval_tokens": result["tokens"],
                "eval_seconds": round(time.monotonic() - t2, 1),
            }
        )
        print(f"[{v.key}] {rows[-1]['model']}: validation ppl {result['ppl']:.2f}", flush=True)
        # Each row as soon as it is measured: a benchmark cut short keeps what it finished.
        write_json_atomic(done, {"rows": rows, "complete": False})
    write_json_atomic(done, {"rows": rows, "complete": True})
    return rows


ORDERINGS = [
    # (claim, lower, higher, target): the paper says ppl(lower) < target * ppl(higher)
    ("DiPaCo 2x2 below dense at equal per-path size", "DiPaCo 2x2 (k-means)", "dense", 1.0),
    ("DiLoCo-4 below dense", "DiLoCo-4, i.i.d. shards", "dense", 1.0),
    (
        "DiPaCo 2x2 below DiLoCo-4 (equal compute)",
        "DiPaCo 2x2 (k-means)",
        "DiLoCo-4, i.i.d. shards",
        1.0,
    ),
    (
        "DiPaCo 4x4 at or below 0.92x DiLoCo-16 (equal compute)",
        "DiPaCo 4x4 (k-means)",
        "DiLoCo-16, i.i.d. shards",
        0.92,
    ),
    ("more paths help: DiPaCo 4x4 below 2x2", "DiPaCo 4x4 (k-means)", "DiPaCo 2x2 (k-means)", 1.0),
    (
        "DiPaCo 4x4 below the dense model of its total size",
        "DiPaCo 4x4 (k-means)",
        "dense, DiPaCo-4x4 params",
        1.0,
    ),
    (
        "discriminative routing below k-means (4x4)",
        "DiPaCo 4x4 + discriminative",
        "DiPaCo 4x4 (k-means)",
        1.0,
    ),
    (
        "a phase at the held-out plateau below k-means (4x4)",
        "DiPaCo 4x4 + discriminative at the held-out plateau",
        "DiPaCo 4x4 (k-means)",
        1.0,
    ),
    (
        "early stopping lowers it further",
        "DiPaCo 4x4 + discriminative + early stopping",
        "DiPaCo 4x4 + discriminative",
        1.0,
    ),
    (
        "re-routing every 64 tokens lowers it further",
        "DiPaCo 4x4 + discriminative + early stopping + re-routing every 64 tokens",
        "DiPaCo 4x4 + discriminative + early stopping",
        1.0,
    ),
]


def orderings(rows: list[dict]) -> list[dict]:
    ppl = {r["model"]: r["ppl"] for r in rows}
    out = []
    for claim, lower, higher, target in ORDERINGS:
        if lower in ppl and higher in ppl:
            out.append(
                {
                    "claim": claim,
                    "holds": ppl[lower] <= target * ppl[higher]
                    if target < 1
                    else ppl[lower] < ppl[higher],
                    "target": target,
                    "lower": lower,
                    "higher": higher,
                    "ratio": ppl[lower] / ppl[higher],
                }
            )
    return out


def _si(x: float) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f}"


def _seconds(x: float | None) -> str:
    return "—" if x is None else f"{x:.0f}"


def markdown(rows: list[dict], checks: list[dict], preset: str, device: str) -> str:
    lines = [
        "| model | params / path | total params | steps / path | tokens | FLOPs | bytes / token "
        "| val ppl | wall time (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        moved = r.get("bytes_per_token")
        lines.append(
            f"| {r['model']} | {_si(r['params_per_path'])} | {_si(r['total_params'])} | "
            f"{r.get('steps_per_path', '—')} | {_si(r['tokens'])} | {_si(r['flops'])} | "
            f"{'—' if moved is None else f'{moved:.1f}'} | {r['ppl']:.2f} | "
            f"{_seconds(r.get('train_seconds'))} |"
        )
    corpora = {json.dumps(r["corpus"], sort_keys=True) for r in rows if r.get("corpus")}
    lrs = sorted({r["inner_lr"] for r in rows if r.get("inner_lr") is not None})
    if len(corpora) == 1:
        c = json.loads(corpora.pop())
        lines += [
            "",
            f"Corpus `{c['source']}`: {c['train_docs']} training documents, {c['val_docs']} "
            f"validation documents, fingerprint `{c['fingerprint']}`"
            + (f"; inner lr {', '.join(f'{x:g}' for x in lrs)}" if lrs else "")
            + ".",
        ]
    elif mixed := mixed_corpora(rows):
        lines += ["", f"**Rows from different corpora, not comparable across them**: {mixed}."]
    lines += ["", f"Orderings (preset `{preset}`, device `{device}`):", ""]
    for ch in checks:
        mark = "holds" if ch["holds"] else "does not hold"
        lines.append(f"- {ch['claim']}: **{mark}** (ratio {ch['ratio']:.3f})")
    return "\n".join(lines) + "\n"


def curves_chart(rows: list[dict], path: Path, title: str) -> bool:
    """Validation perplexity after each round, against steps per path and against FLOPs."""
    with_curves = [r for r in rows if r.get("curve") and "re-routing" not in r["model"]]
    if not with_curves:
        return False
    fig, (by_steps, by_flops) = plt.subplots(1, 2, figsize=(13, 5))
    for r in with_curves:
        steps = [c["steps"] for c in r["curve"]]
        ppl = [c["ppl"] for c in r["curve"]]
        # Training FLOPs so far: the run's FLOPs in proportion of its steps per path.
        flops = [r["flops"] * s / r["steps_per_path"] for s in steps]
        style = "--" if r["model"].startswith(("dense", "DiLoCo")) else "-"
        by_steps.plot(steps, ppl, style, label=r["model"])
        by_flops.plot(flops, ppl, style, label=r["model"])
    for ax, xlabel in ((by_steps, "inner steps per path"), (by_flops, "training FLOPs")):
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation perplexity (routed; first 32 tokens excluded)")
        ax.grid(True, which="both", alpha=0.3)
    by_flops.set_xscale("log")
    by_steps.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def bar_chart(rows: list[dict], path: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.5))
    names = [r["model"] for r in rows][::-1]
    values = [r["ppl"] for r in rows][::-1]
    colors = [
        "#444444"
        if n.startswith("dense")
        else "#1f77b4"
        if n.startswith("DiLoCo")
        else "#ff7f0e"
        if n.startswith("flat")
        else "#2ca02c"
        for n in names
    ]
    bars = ax.barh(names, values, color=colors)
    for bar, value in zip(bars, values, strict=True):
        ax.text(value, bar.get_y() + bar.get_height() / 2, f" {value:.1f}", va="center", fontsize=8)
    ax.set_xlabel("validation perplexity (first 32 tokens excluded; lower is better)")
    ax.set_xlim(min(values) * 0.9, max(values) * 1.08)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--out", help="results folder (default runs/paper_table-<preset>)")
    ap.add_argument("--source", help="corpus: builtin, a text/jsonl/parquet file or folder, hf:...")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, or auto")
    ap.add_argument("--only", nargs="*", help="train only these models (keys as in the table)")
    ap.add_argument("--max-docs", type=int, help="read at most this many documents (evenly spread)")
    ap.add_argument("--rounds", type=int, help="outer rounds per model (default: the preset's)")
    ap.add_argument(
        "--lr",
        type=float,
        help="inner (AdamW) learning rate of every model (default: the preset's)",
    )
    ap.add_argument("--dim", type=int, help="model width of every path (default: the preset's)")
    ap.add_argument(
        "--layers",
        type=int,
        help="blocks per path (default: the preset's; must split evenly into DiPaCo's levels)",
    )
    ap.add_argument("--fresh", action="store_true", help="delete --out first")
    ap.add_argument(
        "--curves",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="evaluate after every round and draw curves.png (default: on for capacity)",
    )
    ap.add_argument(
        "--path-parallel",
        nargs="?",
        const="stacked",
        choices=["stacked", "streams"],
        help="train every path of a round at once: as one stacked model (the default; equal to "
        "the sequential run up to float rounding) or each path on its own CUDA stream (streams)",
    )
    ap.add_argument(
        "--compile",
        choices=["auto", "on", "off"],
        default="auto",
        help="torch.compile the training step (auto: on a GPU; on: also on a CPU, where it "
        "speeds a stacked batch of small paths by about 1.5-2x after a compile of a minute)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="the CI form: a few hundred documents, 2 rounds of 10 steps, the same rows",
    )
    ap.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="no training: build the table and chart from the rows of earlier paper_table.json "
        "files (a benchmark split over machines or sessions, each with --only)",
    )
    ap.add_argument(
        "--mixed-corpora",
        action="store_true",
        help="let --merge join rows trained on different corpora (their fingerprints differ)",
    )
    args = ap.parse_args(argv)
    out = Path(args.out or f"runs/paper_table-{args.preset}")
    if args.fresh and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")  # TF32 matmuls, as GPU training does
    preset = dict(PRESETS[args.preset])
    if args.quick:
        preset.update(
            data={**preset.get("data", {}), "max_docs": 500, "tokenizer_sample_chars": 400_000},
            train={**preset["train"], "rounds": 2, "inner_steps": 10, "pretrain_steps": 10},
            eval={**preset.get("eval", {}), "max_docs": 16},
        )
    curves = args.curves if args.curves is not None else args.preset in PRESET_CURVES
    if args.source:
        preset["data"] = {**preset.get("data", {}), "source": args.source}
    if args.max_docs:
        preset["data"] = {**preset.get("data", {}), "max_docs": args.max_docs}
    if args.rounds:
        preset["train"] = {**preset["train"], "rounds": args.rounds}
    if args.lr:
        preset["train"] = {**preset["train"], "lr": args.lr}
    if args.dim or args.layers:
        preset["model"] = {
            **preset["model"],
            **({"dim": args.dim} if args.dim else {}),
            **({"n_layers": args.layers} if args.layers else {}),
        }
    base = load_config_dict({"name": "paper_table", **preset}, origin=f"preset {args.preset}")
    t0 = time.monotonic()
    rows: list[dict] = []
    if args.merge:
        order = [v.key for v in variants(base, None)]
        merged: dict[tuple[str, str], dict] = {}  # a later file's row replaces an earlier one
        for path in args.merge:
            for row in json.loads(Path(path).read_text())["rows"]:
                merged[(row["key"], row["model"])] = row
        rows = list(merged.values())
        rows.sort(key=lambda r: order.index(r["key"]) if r["key"] in order else len(order))
        if (mixed := mixed_corpora(rows)) and not args.mixed_corpora:
            raise SystemExit(
                f"--merge: these rows were trained on different corpora, so their perplexities "
                f"do not compare: {mixed}. Re-run the odd ones out on one corpus, or pass "
                f"--mixed-corpora to merge them anyway."
            )
    base_root: Path | None = None
    only = set(args.only) if args.only else set(PRESET_ROWS.get(args.preset, FULL))
    for v in [] if args.merge else variants(base, only):
        rows += run_variant(
            out,
            base_root,
            variant_config(base, v),
            v,
            device,
            curves=curves,
            base_batch=base.train.batch_size,
            path_parallel=args.path_parallel,
            compile=args.compile,
        )
        base_root = base_root or out / v.key
    if not args.merge and (mixed := mixed_corpora(rows)):
        print(f"warning: rows from different corpora (see the table's note): {mixed}", flush=True)
    checks = orderings(rows)
    text = markdown(rows, checks, args.preset, device)
    write_atomic(out / "paper_table.md", text.encode())
    write_json_atomic(
        out / "paper_table.json", {"preset": args.preset, "rows": rows, "orderings": checks}
    )
    bar_chart(rows, out / "paper_table.png", f"dipaco paper table, preset {args.preset} ({device})")
    if curves_chart(rows, out / "curves.png", f"learning curves, preset {args.preset} ({device})"):
        print(f"learning curves: {out / 'curves.png'}")
    print(text)
    print(
        f"wrote {out / 'paper_table.md'}, {out / 'paper_table.png'} in {time.monotonic() - t0:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
