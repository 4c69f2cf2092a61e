"""Where a routed model wins or loses against dense: the routing study, from finished runs.

Reads the run folders that ``bench/paper_table.py`` left under ``--table`` (nothing is trained
here) and prints, for the modular run (``--model``, default ``dipaco4x4``) and each of its
routing phases:

- shard balance (training tokens per path, smallest over largest) and purity by source (the
  share of a shard's documents of its most common kind, by the doc id's prefix: ``python/``,
  ``man/``, ``messages/``... in ``builtin:mixed``);
- what the 32-token prefix features capture: how well a logistic regression on them tells a
  validation document's source (against always guessing the most common source);
- whether validation documents reach the path whose shard resembles them: the share routed to a
  path whose shard's dominant source is their own;
- per source and per path, validation perplexity routed, with the oracle path (the best path for
  that document, chosen after the fact), and under the dense model (``--dense``, default
  ``dense``) on the very same documents.

    python bench/routing_study.py --table runs/paper_table-capacity

Writes ``routing_study.md`` and ``routing_study.json`` beside the runs.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression

from dipaco.data.mixed import source_kind
from dipaco.data.shards import TokenShard
from dipaco.fileio import write_atomic, write_json_atomic
from dipaco.routing.evaluate import token_losses
from dipaco.run.evaluate import path_loader
from dipaco.run.export import open_run

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _composition import format_composition, shard_composition  # noqa: E402


def doc_losses(model: torch.nn.Module, docs: list[np.ndarray], seq_len: int) -> np.ndarray:
    """Each document's summed loss and scored tokens, (N, 2), as routed evaluation scores them."""
    model.eval()
    out = np.zeros((len(docs), 2))
    with torch.no_grad():
        for start in range(0, len(docs), 32):
            windows = [
                np.asarray(d[: seq_len + 1], dtype=np.int64) for d in docs[start : start + 32]
            ]
            losses, valid = token_losses(model, windows, 32)
            out[start : start + len(windows), 0] = (losses * valid).double().sum(1).numpy()
            out[start : start + len(windows), 1] = valid.sum(1).numpy()
    return out


def ppl(rows: np.ndarray) -> float:
    return math.exp(rows[:, 0].sum() / max(rows[:, 1].sum(), 1.0))


def phase_report(run, phase: int) -> dict:
    """Balance and purity of one routing phase's training shards, and its validation routes."""
    routing = run.prep.routings[phase]
    paths = run.prep.config.build_topology().num_paths
    ids: list[str] = []
    assignment: list[int] = []
    for p in range(paths):
        shard = TokenShard(run.prep.root / routing.prefix / f"P{p}" / "train")
        ids += shard.doc_ids
        assignment += [p] * len(shard.doc_ids)
    comp = shard_composition(ids, np.array(assignment), paths)
    tokens = routing.stats["shards"]["train"]["tokens"]
    val_ids = TokenShard(run.prep.root / "data" / "val").doc_ids
    dominant = {int(p): info["dominant"] for p, info in comp["paths"].items()}
    routed = routing.val_paths
    home = [source_kind(d) == dominant.get(int(p)) for d, p in zip(val_ids, routed, strict=True)]
    return {
        "phase": phase,
        "method": routing.method,
        "balance": min(tokens) / max(max(tokens), 1),
        "tokens": tokens,
        "composition": comp,
        "val_to_home_shard": float(np.mean(home)) if home else float("nan"),
    }


def feature_probe(run) -> dict | None:
    """Logistic regression from prefix features to source: train on train, score on val."""
    feats = run.prep.root / "features"
    if not (feats / "train.npy").exists():
        return None
    x_train, x_val = run.prep.features("train"), run.prep.features("val")
    y_train = [source_kind(d) for d in TokenShard(run.prep.root / "data" / "train").doc_ids]
    y_val = [source_kind(d) for d in TokenShard(run.prep.root / "data" / "val").doc_ids]
    if len(set(y_train)) < 2:
        return None
    clf = LogisticRegression(max_iter=2000).fit(x_train, y_train)
    majority = Counter(y_train).most_common(1)[0][0]
    # What the same 32 tokens tell without the model: a bag of their token ids (square-root
    # counts, unit length). If this probe does far better, the model's features lose the source.
    vocab = run.prep.config.model.vocab_size
    prefix = run.prep.config.routing.prefix_tokens
    bags = [
        token_bags(TokenShard(run.prep.root / "data" / split).docs(), prefix, vocab)
        for split in ("train", "val")
    ]
    bag_clf = LogisticRegression(max_iter=2000).fit(bags[0], y_train)
    return {
        "accuracy": float(clf.score(x_val, y_val)),
        "token_bag_accuracy": float(bag_clf.score(bags[1], y_val)),
        "majority_baseline": float(np.mean([y == majority for y in y_val])),
        "sources": sorted(set(y_train)),
    }


def token_bags(docs: list[np.ndarray], prefix: int, vocab: int) -> np.ndarray:
    """(N, vocab): each document's first ``prefix`` token ids counted, square-rooted, unit length."""
    out = np.zeros((len(docs), vocab), dtype=np.float32)
    for i, d in enumerate(docs):
        np.add.at(out[i], np.asarray(d[:prefix], dtype=np.int64), 1.0)
    out = np.sqrt(out)
    return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-9)


def loss_report(run, dense_run) -> dict:
    """Routed, oracle-routed and dense perplexity per source and per path, on the same docs."""
    prep = run.prep
    docs = prep.val_docs()
    seq_len = prep.config.train.seq_len
    routed = prep.val_routes()
    val_ids = TokenShard(prep.root / "data" / "val").doc_ids
    kinds = [source_kind(val_ids[int(i)]) for i in prep.val_index()]
    load = path_loader(prep, run.store.params)
    paths = prep.config.build_topology().num_paths
    under = np.stack([doc_losses(load(p), docs, seq_len) for p in range(paths)])  # (P, N, 2)
    dense = doc_losses(path_loader(dense_run.prep, dense_run.store.params)(0), docs, seq_len)
    n = np.arange(len(docs))
    routed_rows = under[routed, n]
    per_token = under[:, :, 0] / np.maximum(under[:, :, 1], 1)
    oracle_rows = under[per_token.argmin(0), n]

    def summary(mask: np.ndarray) -> dict:
        return {
            "docs": int(mask.sum()),
            "routed": ppl(routed_rows[mask]),
            "oracle": ppl(oracle_rows[mask]),
            "dense": ppl(dense[mask]),
        }

    everything = np.ones(len(docs), dtype=bool)
    return {
        "all": summary(everything),
        "by_source": {k: summary(np.array([x == k for x in kinds])) for k in sorted(set(kinds))},
        "by_path": {str(p): summary(routed == p) for p in range(paths) if (routed == p).any()},
        "oracle_agrees": float(np.mean(per_token.argmin(0) == routed)),
    }


def markdown(report: dict) -> str:
    lines = [f"# Routing study: `{report['model']}` against `{report['dense']}`", ""]
    probe = report.get("probe")
    if probe:
        lines += [
            f"Prefix features -> source (logistic regression, validation documents): accuracy "
            f"{probe['accuracy']:.3f} against {probe['majority_baseline']:.3f} for the most "
            f"common source; from a bag of the same prefix's token ids (no model): "
            f"{probe['token_bag_accuracy']:.3f}; sources: {', '.join(probe['sources'])}.",
            "",
        ]
    for ph in report["phases"]:
        lines += [
            f"## {ph.get('run', report['model'])}: phase {ph['phase']} ({ph['method']})",
            "",
            f"Balance (smallest / largest shard, tokens): {ph['balance']:.2f}; overall purity "
            f"{ph['composition']['purity']:.3f}; validation documents routed to a shard whose "
            f"dominant source is theirs: {ph['val_to_home_shard']:.3f}.",
            "",
            format_composition(ph["composition"]),
            "",
        ]
    lo = report["losses"]
    lines += [
        "## Perplexity on the same validation documents",
        "",
        f"The routed path is the oracle's (best after the fact) for {lo['oracle_agrees']:.3f} "
        "of the documents.",
        "",
        "| documents | n | routed | oracle path | dense | routed / dense |",
        "|---|---|---|---|---|---|",
    ]
    rows = [("all", lo["all"])]
    rows += [(f"source {k}", v) for k, v in lo["by_source"].items()]
    rows += [(f"path P{k}", v) for k, v in lo["by_path"].items()]
    for name, v in rows:
        lines.append(
            f"| {name} | {v['docs']} | {v['routed']:.2f} | {v['oracle']:.2f} | {v['dense']:.2f} "
            f"| {v['routed'] / v['dense']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", required=True, help="a bench/paper_table.py --out folder")
    ap.add_argument("--model", default="dipaco4x4", help="the modular run's key")
    ap.add_argument("--dense", default="dense", help="the dense run's key")
    ap.add_argument(
        "--also",
        nargs="*",
        default=[],
        help="more modular runs whose phases' balance and purity to report (e.g. the "
        "discriminative run dipaco4x4_disc)",
    )
    args = ap.parse_args(argv)
    table = Path(args.table)
    run = open_run(table / args.model)
    report: dict = {"model": args.model, "dense": args.dense}
    report["probe"] = feature_probe(run)
    report["phases"] = [phase_report(run, k) for k in range(len(run.prep.routings))]
    for key in args.also:
        other = open_run(table / key)
        for k in range(len(other.prep.routings)):
            report["phases"].append({**phase_report(other, k), "run": key})
    report["losses"] = loss_report(run, open_run(table / args.dense))
    text = markdown(report)
    write_atomic(table / "routing_study.md", text.encode())
    write_json_atomic(table / "routing_study.json", report)
    print(text)
    print(f"wrote {table / 'routing_study.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
