"""The outer step for many paths, swept: rescale, outer learning rate, outer-lr warm-up.

DiPaCo (section 2.7) multiplies a module's averaged delta by the square root of the paths through
it. With 16 paths that made 4x4 worse than 2x2 in short runs (docs/results.md). This trains DiPaCo
2x2 with the rescales none, sqrt and norm, DiPaCo 4x4 with each (none, sqrt, linear, norm), both
with the token-bag routing features (``routing.features = "tokens"``: compare with the norm
rows), both with token-bag routing and the rescales none and norm, DiPaCo 4x4 with the outer
learning rates around the best (under hidden-state and under token-bag routing) and with an
outer-lr warm-up, and gives the baselines the same
budget: DiLoCo-4 and DiLoCo-16 over three outer learning rates and the dense model over three
inner learning rates (0.5x, 1x and 2x the preset's, or --lr's). Every run goes through
``bench/paper_table.py``'s code path, is evaluated after every round, and is kept under --out, so
an interrupted sweep continues.

    python bench/outer_sweep.py --preset capacity --rounds 16     # ~1 h on 2 CPU cores
    python bench/outer_sweep.py --preset smoke                    # the CI form

Writes ``outer_sweep.md``, ``outer_sweep.json`` and ``outer_sweep.png`` (the curves) to --out.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from paper_table import (  # the benchmark's presets, variants and runner
    DILOCO,
    PLAIN,
    PRESETS,
    Variant,
    curves_chart,
    run_variant,
    variant_config,
)

from dipaco.config import load_config_dict
from dipaco.fileio import write_atomic, write_json_atomic

# The rescale, outer-lr and warm-up rows route by the initial model's hidden states (the config's
# default, where the overshoot was found), whatever the preset says; the features group alone
# changes the routing features.
HIDDEN = {"features": "hidden"}


def sweep(base_lr: float) -> list[tuple[str, Variant]]:
    """(group, variant) for every setting: each group is tuned with the same number of runs."""
    out: list[tuple[str, Variant]] = []
    four = {"levels": "4x4"}
    for mode in ("none", "sqrt", "norm"):
        out.append(
            (
                "DiPaCo 2x2: rescale",
                Variant(
                    f"dipaco2x2_{mode}",
                    f"DiPaCo 2x2, rescale {mode}, outer lr 0.7",
                    {"topology": {"levels": "2x2"}, "outer": {"rescale": mode}, "routing": HIDDEN},
                ),
            )
        )
    for mode in ("none", "sqrt", "linear", "norm"):
        out.append(
            (
                "DiPaCo 4x4: rescale",
                Variant(
                    f"dipaco4x4_{mode}",
                    f"DiPaCo 4x4, rescale {mode}, outer lr 0.7",
                    {"topology": four, "outer": {"rescale": mode}, "routing": HIDDEN},
                ),
            )
        )
    for levels in ("2x2", "4x4"):
        out.append(
            (
                f"DiPaCo {levels}: routing features",
                Variant(
                    f"dipaco{levels}_tokens",
                    f"DiPaCo {levels}, token-bag routing features, rescale norm",
                    {
                        "topology": {"levels": levels},
                        "outer": {"rescale": "norm"},
                        "routing": {"features": "tokens"},
                    },
                ),
            )
        )
    # The rescale again under the routing the capacity preset uses: at a lower inner lr the
    # averaged delta is less noisy, and restoring one path's norm may overshoot where it did not.
    for levels in ("2x2", "4x4"):
        for mode in ("none", "norm"):
            out.append(
                (
                    f"DiPaCo {levels}, token-bag routing: rescale",
                    Variant(
                        f"dipaco{levels}_tokens_{mode}",
                        f"DiPaCo {levels}, token-bag routing features, rescale {mode}",
                        {
                            "topology": {"levels": levels},
                            "outer": {"rescale": mode},
                            "routing": {"features": "tokens"},
                        },
                    ),
                )
            )
    for mode in ("none", "norm"):
        for lr in (0.5, 1.0):
            out.append(
                (
                    "DiPaCo 4x4: outer lr",
                    Variant(
                        f"dipaco4x4_{mode}_lr{lr}",
                        f"DiPaCo 4x4, rescale {mode}, outer lr {lr}",
                        {
                            "topology": four,
                            "outer": {"rescale": mode, "lr": lr},
                            "routing": HIDDEN,
                        },
                    ),
                )
            )
    # The outer lr again under the capacity preset's routing and rescale, over the same three
    # rates as the DiLoCo groups below: the baselines' best rate must be matched by DiPaCo's own.
    for lr in (0.5, 0.7, 1.0):
        out.append(
            (
                "DiPaCo 4x4, token-bag routing: outer lr",
                Variant(
                    f"dipaco4x4_tokens_lr{lr}",
                    f"DiPaCo 4x4, token-bag routing features, rescale norm, outer lr {lr}",
                    {
                        "topology": four,
                        "outer": {"rescale": "norm", "lr": lr},
                        "routing": {"features": "tokens"},
                    },
                ),
            )
        )
    for mode in ("sqrt", "norm"):
        out.append(
            (
                "DiPaCo 4x4: outer-lr warm-up",
                Variant(
                    f"dipaco4x4_{mode}_warmup",
                    f"DiPaCo 4x4, rescale {mode}, outer lr 0.7, warm-up over 4 rounds",
                    {
                        "topology": four,
                        "outer": {"rescale": mode, "warmup_rounds": 4},
                        "routing": HIDDEN,
                    },
                ),
            )
        )
    for lr in (0.5, 0.7, 1.0):
        out.append(
            (
                "DiLoCo-4: outer lr",
                Variant(
                    f"diloco4_lr{lr}",
                    f"DiLoCo-4 (i.i.d.), outer lr {lr}",
                    {
                        "topology": {"levels": "1", "replicas": 4},
                        "routing": {"method": "iid"},
                        "outer": {**DILOCO, "lr": lr},
                    },
                ),
            )
        )
    for lr in (0.5, 0.7, 1.0):
        out.append(
            (
                "DiLoCo-16: outer lr",
                Variant(
                    f"diloco16_lr{lr}",
                    f"DiLoCo-16 (i.i.d.), outer lr {lr}",
                    {
                        "topology": {"levels": "1", "replicas": 16},
                        "routing": {"method": "iid"},
                        "outer": {**DILOCO, "lr": lr},
                    },
                ),
            )
        )
    for factor in (0.5, 1.0, 2.0):
        lr = base_lr * factor
        out.append(
            (
                "dense: inner lr",
                Variant(
                    f"dense_lr{lr:g}",
                    f"dense, inner lr {lr:g}",
                    {"topology": {"levels": "1"}, "outer": PLAIN, "train": {"lr": lr}},
                ),
            )
        )
    return out


def markdown(results: list[dict]) -> str:
    lines = ["| group | setting | val ppl | best in group |", "|---|---|---|---|"]
    best: dict[str, float] = {}
    for r in results:
        best[r["group"]] = min(best.get(r["group"], float("inf")), r["ppl"])
    for r in results:
        mark = "**best**" if r["ppl"] == best[r["group"]] else ""
        lines.append(f"| {r['group']} | {r['model']} | {r['ppl']:.2f} | {mark} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="capacity")
    ap.add_argument("--out", help="results folder (default runs/outer_sweep-<preset>)")
    ap.add_argument("--source", help="corpus (default: the preset's)")
    ap.add_argument("--rounds", type=int, help="rounds per run (default: the preset's)")
    ap.add_argument("--only", nargs="*", help="run only these settings (keys)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--lr",
        type=float,
        help="inner (AdamW) learning rate of every run; the dense group sweeps 0.5x, 1x, 2x it",
    )
    ap.add_argument(
        "--path-parallel",
        nargs="?",
        const="stacked",
        choices=["stacked", "streams"],
        help="train every path of a round at once (bench/paper_table.py's option)",
    )
    ap.add_argument("--compile", choices=["auto", "on", "off"], default="auto")
    args = ap.parse_args(argv)
    out = Path(args.out or f"runs/outer_sweep-{args.preset}")
    out.mkdir(parents=True, exist_ok=True)
    preset: dict[str, Any] = dict(PRESETS[args.preset])
    if args.source:
        preset["data"] = {**preset.get("data", {}), "source": args.source}
    if args.rounds:
        preset["train"] = {**preset["train"], "rounds": args.rounds}
    if args.lr:
        preset["train"] = {**preset["train"], "lr": args.lr}
    base = load_config_dict({"name": "outer_sweep", **preset}, origin=f"preset {args.preset}")
    t0 = time.monotonic()
    results: list[dict] = []
    base_root: Path | None = None
    for group, v in sweep(base.train.lr):
        if args.only and v.key not in args.only:
            continue
        rows = run_variant(
            out,
            base_root,
            variant_config(base, v),
            v,
            args.device,
            curves=True,
            base_batch=base.train.batch_size,
            path_parallel=args.path_parallel,
            compile=args.compile,
        )
        base_root = base_root or out / v.key
        results.append({**rows[0], "group": group})
    text = markdown(results)
    write_atomic(out / "outer_sweep.md", text.encode())
    write_json_atomic(out / "outer_sweep.json", {"preset": args.preset, "rows": results})
    curves_chart(results, out / "outer_sweep.png", f"outer-step sweep, preset {args.preset}")
    print(text)
    print(
        f"wrote {out / 'outer_sweep.md'}, {out / 'outer_sweep.png'} in {time.monotonic() - t0:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
