"""What a run shows people: the results table and a PNG of the loss curves."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from rich.table import Table


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, imported when a chart is drawn (it
    costs every command that merely imports this module about half a second)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def results_table(rows: list[dict]) -> Table:
    table = Table(title="routed validation perplexity (first 32 tokens excluded)")
    for col, justify in (
        ("model", "left"),
        ("params / path", "right"),
        ("total params", "right"),
        ("steps / path", "right"),
        ("tokens seen", "right"),
        ("val ppl", "right"),
    ):
        table.add_column(col, justify=justify)
    for r in rows:
        table.add_row(
            r["model"],
            f"{r['params_per_path'] / 1e6:.2f} M",
            f"{r['total_params'] / 1e6:.2f} M",
            str(r["steps_per_path"]),
            f"{r['tokens_seen'] / 1e6:.2f} M",
            f"{r['ppl']:.1f}",
        )
    return table


def results_markdown(rows: list[dict]) -> str:
    lines = [
        "| model | params / path | total params | steps / path | tokens seen | val ppl |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['params_per_path'] / 1e6:.2f} M | {r['total_params'] / 1e6:.2f} M | "
            f"{r['steps_per_path']} | {r['tokens_seen'] / 1e6:.2f} M | {r['ppl']:.1f} |"
        )
    return "\n".join(lines)


def plot_run(events: list[dict], out: str | Path, title: str = "") -> Path:
    """Training loss per path and for the dense baseline (left); routed validation ppl (right)."""
    plt = pyplot()
    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(12, 4.5))
    train: dict[str, dict[int, float]] = defaultdict(dict)
    for e in events:
        if e["event"] == "pretrain":
            train["dense pretraining"].update({e["step"]: e["loss"]})
        elif e["event"] == "delta":
            for i, loss in enumerate(e["train_losses"]):
                train[f"path P{e['path']}"][e["step_offset"] + i] = loss
        elif e["event"] == "baseline_train":
            for i, loss in enumerate(e["train_losses"]):
                train["dense baseline"][e["step_offset"] + i] = loss
    for label in sorted(train):
        steps = sorted(train[label])
        style = {
            "dense pretraining": {"color": "grey"},
            "dense baseline": {"color": "black"},
        }.get(label, {"alpha": 0.8})
        ax_train.plot(steps, [train[label][s] for s in steps], label=label, linewidth=1, **style)
    ax_train.set(xlabel="inner steps per path", ylabel="training loss", title="training loss")
    ax_train.legend(fontsize=8)
    val: dict[str, dict[int, float]] = defaultdict(dict)
    for e in events:
        if e["event"] == "eval":
            val[e["model"]][e["steps_per_path"]] = e["ppl"]
    for label, points in sorted(val.items()):
        steps = sorted(points)
        ax_val.plot(steps, [points[s] for s in steps], marker="o", label=label)
    ax_val.set(
        xlabel="inner steps per path", ylabel="perplexity", title="routed validation perplexity"
    )
    ax_val.set_yscale("log")
    ax_val.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
