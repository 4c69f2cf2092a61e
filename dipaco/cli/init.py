"""``dipaco init``: write a commented TOML run config for a preset and a topology.

Every section and field of :class:`dipaco.config.RunConfig` is written with its value for the
chosen preset and a one-line comment saying what it means and what is allowed (the allowed
range is read from the config's own validation, so it cannot drift). The file loads with
:func:`dipaco.config.load_config` to exactly the preset with that topology.
"""

from __future__ import annotations

import argparse
import json
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel

from dipaco.cli.common import console
from dipaco.config import PRESETS, RunConfig, load_config_dict, preset_config
from dipaco.errors import ConfigError

_TOPOLOGY = re.compile(r"^[1-9][0-9]*(x[1-9][0-9]*)*$")

SECTIONS: dict[str, str] = {
    "model": "The path transformer (a Llama-style decoder): every path has this shape.",
    "topology": "Levels of modules and the paths through them (DiPaCo §2.3).",
    "data": "Where the training text comes from and how it is split.",
    "routing": "How documents are routed to paths, i.e. how the data is sharded (§2.4).",
    "train": "Inner optimization: what each peer runs on its path (AdamW, cosine schedule).",
    "outer": "Outer optimization: how the coordinator applies the paths' deltas (Nesterov).",
    "validation": "Checks on the deltas peers send, and how a module combines them.",
    "scheduler": "Leases, heartbeats and round deadlines for peers that come and go.",
    "network": "How deltas travel on the wire.",
    "eval": "Evaluation during and after the run.",
    "security": "Who may join, and the limits on each key.",
    "flower": "Only under `--transport flower` (docs/flower.md).",
}

# One line per field: what it means (the allowed values are added from the validation).
FIELDS: dict[str, str] = {
    "name": "the run's name, shown in logs and reports",
    "baseline": "also train a dense baseline of the same compute, to compare against",
    "model.vocab_size": "tokenizer vocabulary size (a SentencePiece model is trained for it)",
    "model.dim": "width of the residual stream; must be divisible by n_heads",
    "model.n_layers": "transformer blocks in a path; the topology's levels split them",
    "model.n_heads": "attention heads; dim / n_heads must be even (rotary embeddings)",
    "model.ffn_hidden": "SwiGLU hidden width; 0 means the Llama rule, 8/3 * dim rounded up to 32",
    "model.max_seq_len": "longest window the model is built for; train.seq_len must fit in it",
    "topology.levels": "modules per level joined by 'x': '2x2' is 4 paths, '1' is dense, '8' one level",
    "topology.shared": "parts shared by every path: any of 'embed', 'head' (others are private)",
    "topology.private_blocks_before": "blocks before the levels that each path keeps to itself",
    "topology.private_blocks_after": "blocks after the levels that each path keeps to itself",
    "topology.blocks_per_level": "blocks in each level, one count per level (unset: an even split)",
    "topology.replicas": "workers per module combination, each with its own shard; '1' x 4 is DiLoCo-4",
    "data.source": "'builtin' (the bundled corpus), a .txt/.jsonl file or folder, or a dataset name",
    "data.text_field": "the field holding the text in JSON lines or dataset records",
    "data.max_docs": "read at most this many documents (unset: all of them)",
    "data.val_fraction": "fraction of documents kept for validation",
    "data.heldout_fraction": "fraction of documents held out for the held-out validation check",
    "data.tokenizer_sample_chars": "characters of text the tokenizer is trained on",
    "data.byte_fallback": "the tokenizer spells unknown characters as bytes (256 of its pieces)",
    "data.min_doc_tokens": "documents shorter than this many tokens are dropped",
    "routing.method": "'kmeans'/'product': generative routing on prefix features; 'iid': hashed",
    "routing.balance": "how strongly shard sizes are balanced (0: not at all, 1: fully)",
    "routing.prefix_tokens": "tokens of a document's prefix its routing features come from",
    "routing.features": "'hidden': the initial model's mean state over the prefix; 'tokens': a "
    "bag of the prefix's token ids",
    "routing.overlap": "each training document goes to its top-n paths (never at eval)",
    "routing.discriminative_after": "rounds after which a discriminative router re-shards the data",
    "routing.discriminative_plateau": "or: re-shard once the paths' mean held-out loss improves by "
    "less than this fraction in a round (0: off)",
    "routing.discriminative_phases": "at most this many phases decided by discriminative_plateau",
    "routing.router_fraction": "training documents reserved to fit the router, never trained on",
    "routing.candidates": "score only each router document's top-c paths (unset: every path)",
    "routing.skip_openings": "route by the first block past openings shared by this share of the "
    "training documents (0: the first tokens)",
    "train.seed": "random seed of the whole run",
    "train.batch_size": "windows per inner step (split into micro-batches to fit a device)",
    "train.seq_len": "tokens per window; at most model.max_seq_len",
    "train.lr": "peak inner learning rate (AdamW)",
    "train.min_lr_ratio": "the cosine schedule ends at lr * this",
    "train.warmup_steps": "linear warmup steps of the inner learning rate",
    "train.weight_decay": "AdamW weight decay",
    "train.grad_clip": "clip each step's gradient norm to this",
    "train.pretrain_steps": "dense pretraining steps before the paths split",
    "train.inner_steps": "H: inner steps per path per round",
    "train.rounds": "outer rounds",
    "outer.lr": "outer learning rate (unset: 0.7, or 2.5 with a sparse codec)",
    "outer.momentum": "outer momentum (unset: 0.9, or 0 with a sparse codec)",
    "outer.nesterov": "use Nesterov momentum in the outer step",
    "outer.rescale": "scale a module's averaged delta by its n paths: none, sqrt, linear, norm",
    "outer.warmup_rounds": "outer-lr warm-up: a module's k-th step uses lr * min(1, k / this)",
    "outer.weight_by_tokens": "weight each path's delta by the tokens it trained on",
    "outer.lr_by_sharing": "an outer lr per module by how many paths share it, e.g. {4 = 0.7, 16 = 1.0}"
    " (a module not listed takes lr)",
    "validation.norm_check": "a delta whose norm is an outlier is 'reject'ed, 'clip'ped, or 'off'",
    "validation.norm_mads": "outlier bound: median + norm_mads * MAD of recent accepted norms",
    "validation.norm_ratio": "and at least norm_ratio * median of recent accepted norms",
    "validation.min_observations": "accepted norms needed before the norm check applies",
    "validation.norm_window": "accepted norms remembered per module; >= min_observations",
    "validation.max_norm": "an absolute bound on any delta's norm (unset: none)",
    "validation.aggregation": "how a module combines its paths' deltas",
    "validation.trim_fraction": "for trimmed_mean: fraction of paths dropped at each end",
    "validation.min_paths_for_robust": "paths needed before trimmed_mean/median apply",
    "validation.heldout_check": "score each delta on held-out documents (auto: in open runs)",
    "validation.heldout_tolerance": "allowed rise of the held-out loss (nats per token)",
    "validation.heldout_docs": "held-out documents scored per check",
    "validation.offshard_check": "also score on other paths' documents; refuse keys that help those more",
    "validation.copy_cosine": "refuse a copy of an earlier delta (0.9999; auto: with heldout_check; false: off)",
    "scheduler.lease_seconds": "a peer silent this long has vanished; its task is re-issued",
    "scheduler.heartbeat_seconds": "how often peers send a heartbeat",
    "scheduler.deadline_mads": "round deadline: median + max(k * MAD, slack * median) of durations",
    "scheduler.deadline_slack": "the slack in the round deadline formula",
    "scheduler.deadline_floor": "never a round deadline shorter than this (seconds)",
    "scheduler.min_observations": "round durations needed before deadlines apply",
    "scheduler.quorum": "fraction of a module's paths that must report for its round to close",
    "scheduler.max_staleness": "deltas up to this many versions late are still applied",
    "scheduler.stale_damping": "weight factor per version a delta is late",
    "scheduler.min_step_fraction": "a slow peer gets at least this fraction of H inner steps",
    "scheduler.overlap": "peers never wait for a round: they train their path's next one",
    "scheduler.overlap_start": "where such a task starts: end (where the last ended) or eager",
    "scheduler.hedge": 'an idle peer copies a straggler\'s task ("last": in the last round only)',
    "network.codec": "delta encoding: float32, fp16, bf16, int8, sign1 (1 bit), or topk2/topk4",
    "network.topk_density": "top-k: the share of each 4096-element chunk a delta sends",
    "network.error_feedback_decay": "a residual's weight in the next delta (unset: 0.9 sparse, else 1)",
    "eval.max_docs": "evaluate on at most this many documents (unset: all)",
    "eval.every_round": "evaluate after every round",
    "eval.early_stopping": "keep each path's parameters at its lowest held-out loss",
    "eval.reroute_windows": "final evaluations that re-route every W tokens, e.g. [64, 32]",
    "security.join": "'open': any key may join; 'allow-list': only allowed keys",
    "security.clock_skew_seconds": "signed requests further than this from the coordinator's clock are refused",
    "security.requests_per_second": "per key: the token bucket's rate",
    "security.burst": "per key: the token bucket's size",
    "security.max_tasks_per_key": "live tasks one key may hold",
    "security.max_names_per_key": "peer ids one key may use",
    "security.ban_after": "hostile refusals before a key is banned (0: never)",
    "flower.round_timeout": "longest a round waits for the nodes' replies (seconds)",
    "flower.quorum": "fraction of nodes after whose replies stragglers get a last grace",
    "flower.straggler_seconds": "that grace, in seconds",
    "flower.poll_seconds": "how often the server polls for replies (seconds)",
    "flower.max_bundle_mb": "shard files sent inside task messages, at most this many MB in all",
}


def field_names(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[str]:
    """Every field of the config, dotted (``train.lr``), sections excluded."""
    names = []
    for name, info in model.model_fields.items():
        if info.exclude:  # kept for old configs, never written
            continue
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            names += field_names(ann, f"{prefix}{name}.")
        else:
            names.append(prefix + name)
    return names


def _type_text(ann: Any) -> tuple[str, bool]:
    """The allowed type in words, and whether it may be unset."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return ", or ".join(_type_text(a)[0] for a in rest), len(rest) < len(args)
    if origin is Literal:
        if len(args) == 1:
            return json.dumps(args[0]), False
        return "one of " + ", ".join(json.dumps(a) for a in args), False
    if origin is list:
        inner = _type_text(args[0])[0]
        if inner.startswith("one of "):
            return "a list of any of " + inner[len("one of ") :], False
        return "a list of " + inner.removeprefix("an ").removeprefix("a ") + "s", False
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        ann, str(ann)
    ), False


def _allowed(info: Any) -> str:
    words, optional = _type_text(info.annotation)
    bounds = []
    for m in info.metadata:
        for cls, attr, op in ((Ge, "ge", ">="), (Gt, "gt", ">"), (Le, "le", "<="), (Lt, "lt", "<")):
            if isinstance(m, cls):
                bounds.append(f"{op} {getattr(m, attr)}")
    text = words + (" " + " and ".join(bounds) if bounds else "")
    return text + ("; may be left unset" if optional and info.default is None else "")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table; its keys as strings (TOML's keys are)
        return (
            "{"
            + ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items())
            + "}"
        )
    raise TypeError(f"cannot write {value!r} as TOML")


def _field_lines(model: BaseModel, name: str, dotted: str, value: Any) -> list[str]:
    info = type(model).model_fields[name]
    comment = f"# {FIELDS.get(dotted, dotted)}. Allowed: {_allowed(info)}."
    if value is None:
        return [comment, f"# {name} = ...   (unset: uncomment and give a value to set it)"]
    return [comment, f"{name} = {_toml_value(value)}"]


def build_config(preset: str = "demo", topology: str | None = None) -> RunConfig:
    """The preset, with ``topology.levels`` replaced by ``topology`` when given."""
    if not isinstance(preset, str) or preset not in PRESETS:
        raise ConfigError(
            f"preset: unknown preset {preset!r}; allowed: {', '.join(sorted(PRESETS))}"
        )
    config = preset_config(preset)
    if topology is None:
        return config
    if not isinstance(topology, str) or not _TOPOLOGY.match(topology.strip().lower()):
        raise ConfigError(
            f"topology.levels: {topology!r} is not positive module counts joined by 'x'; "
            "allowed: e.g. '1' (dense), '8' (one level of 8), '2x2', '4x4'"
        )
    data = config.to_dict()
    data["topology"] = {**data["topology"], "levels": topology.strip().lower()}
    return load_config_dict(data, origin=f"preset {preset} with topology {topology}")


def render_config(preset: str = "demo", topology: str | None = None) -> str:
    """The commented TOML text of :func:`build_config`'s config."""
    config = build_config(preset, topology)
    lines = [
        f"# dipaco run config: preset {preset!r}"
        + (f", topology {config.topology.levels!r}" if topology else "")
        + ", written by `dipaco init`.",
        "# Every field is listed with its value; a field left out takes the preset's value.",
        "# Load it with e.g. `dipaco demo --config FILE`.",
        "",
        "# the preset the values below start from. Allowed: " + ", ".join(sorted(PRESETS)) + ".",
        f"preset = {_toml_value(preset)}",
    ]
    sections = []
    for name in RunConfig.model_fields:
        value = getattr(config, name)
        if isinstance(value, BaseModel):
            sections.append((name, value))
        else:
            lines += _field_lines(config, name, name, value)
    for section, model in sections:
        lines += ["", f"# {SECTIONS.get(section, section)}", f"[{section}]"]
        for name, info in type(model).model_fields.items():
            if info.exclude:
                continue
            lines += _field_lines(model, name, f"{section}.{name}", getattr(model, name))
    return "\n".join(lines) + "\n"


def write_config(
    out: str | Path, preset: str = "demo", topology: str | None = None, force: bool = False
) -> Path:
    """Write the config to ``out``; refuses to overwrite an existing file unless ``force``."""
    out = Path(out)
    text = render_config(preset, topology)
    if out.exists() and not force:
        raise ConfigError(f"{out} already exists; pass --force to overwrite it", reason="exists")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return out


def cmd_init(args: argparse.Namespace) -> int:
    out = write_config(args.out, args.preset, args.topology, args.force)
    console.print(f"wrote {out} (preset {args.preset}); edit it, then pass it as --config {out}")
    return 0


def add_init_command(sub: Any) -> argparse.ArgumentParser:
    """Register ``init`` on the ``dipaco`` command's subparsers."""
    p = sub.add_parser("init", help="write a commented TOML run config to start from")
    p.add_argument(
        "--preset", default="demo", help=f"the preset to start from: {', '.join(sorted(PRESETS))}"
    )
    p.add_argument("--topology", help="modules per level joined by 'x', e.g. 2x2, 4x4, 1")
    p.add_argument("--out", default="run.toml", help="where to write it (default run.toml)")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.set_defaults(fn=cmd_init)
    return p
