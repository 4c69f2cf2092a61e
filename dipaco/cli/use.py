"""``dipaco export`` and ``dipaco generate``: use a run folder's modules as language models."""

from __future__ import annotations

import argparse
import json
from typing import Any

from dipaco.cli.common import console, say


def cmd_export(args: argparse.Namespace) -> int:
    from dipaco.run.export import export_path, open_run

    run = open_run(args.run_dir, remote=gatherer(args))
    out = export_path(run, args.path, args.out)
    info = json.loads((out / "dipaco_path.json").read_text())
    console.print(
        f"wrote path P{args.path} of {info['topology']} as a Hugging Face Llama checkpoint to "
        f"{out} ({info['parameters']:,} parameters)"
    )
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from dipaco.run.export import open_run
    from dipaco.run.generate import generate

    result = generate(
        open_run(args.run_dir, remote=gatherer(args)),
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        reroute_every=args.reroute_every,
        path=args.path,
    )
    if args.json:
        print(json.dumps(result))
        return 0
    routes = " -> ".join(f"P{p}" for p in result["paths_used"])
    say(f"path P{result['path']}  (segments: {routes})")
    if console.lines:  # the text is data: as it is, without a time on each of its lines
        print(args.prompt + result["text"], flush=True)
    else:
        console.print(args.prompt + result["text"], markup=False, highlight=False)
    return 0


def gatherer(args: argparse.Namespace):
    """How the command gets other owners' modules: gathered copies, --owner-dir, the network."""
    from dipaco.coordinator.gather import whole_run

    return lambda run_dir: whole_run(run_dir, owner_dirs=tuple(args.owner_dir), say=say)


def add_owner_dir(p: Any) -> None:
    p.add_argument(
        "--owner-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="a module owner's run folder on this machine, to gather its modules from "
        "(repeatable; else the owners are asked over the network)",
    )


def add_use_commands(sub: Any) -> None:
    """Register ``export`` and ``generate`` on the ``dipaco`` command's subparsers."""
    ex = sub.add_parser("export", help="write one path of a run as a Hugging Face Llama checkpoint")
    ex.add_argument("--run-dir", required=True, help="a prepared and trained run folder")
    ex.add_argument("--path", type=int, required=True, help="path index, 0 to num_paths - 1")
    ex.add_argument("--out", required=True, help="folder to write the checkpoint to")
    add_owner_dir(ex)
    ex.set_defaults(fn=cmd_export)
    gen = sub.add_parser(
        "generate", help="sample text from the path the prompt routes to (latest modules)"
    )
    gen.add_argument("prompt")
    gen.add_argument("--run-dir", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    gen.add_argument("--top-k", type=int, default=50, help="0: no top-k cut")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument(
        "--reroute-every", type=int, default=None, help="re-route every N generated tokens"
    )
    gen.add_argument("--path", type=int, default=None, help="use this path instead of routing")
    gen.add_argument("--json", action="store_true", help="print the result as JSON")
    add_owner_dir(gen)
    gen.set_defaults(fn=cmd_generate)
