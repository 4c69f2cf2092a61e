"""What scoring a delta costs the coordinator, against what training its task costs a peer.

An open run scores every delta on held-out documents (``validation.heldout_check = "auto"``):
the path is built from the module tensors twice (as it is and with the delta) and each time
``heldout_docs`` documents are run forward (``run/evaluate.heldout_scorer``, as
heldout.check_heldout calls it); with ``--offshard`` (``validation.offshard_check``) as many
documents of other paths again (``foreign_scorer``). A task is H inner steps of ``batch``
sequences. Both are timed here on this machine, at the paper's path size by default (12
blocks, width 896, 16 heads, vocabulary 32,000, sequence 1,024: about 150M parameters), the
same process, the same threads:

    score    the scorer's two calls (four with --offshard), path builds included (the best of
             --repeats)
    step     one training step (forward, backward, AdamW) of --micro-batch sequences, the
             best of --repeats, after one untimed warm-up step
    task     step / micro-batch x batch x H: the task's training time on this machine

Printed: the ratio score / task (the issue's target: at most 5%), and the scored tokens. The
paper's task is H = 150 (62 in its Table 5) steps of 512 sequences of 1,024 tokens.

    python bench/scoring_cost.py                 # the paper's path, 8 documents, H = 62
    python bench/scoring_cost.py --docs 2 4 8    # several document counts
    python bench/scoring_cost.py --quick         # CI's short form (a small path)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dipaco.model.optim import InnerSettings, make_optimizer
from dipaco.model.topology import Topology
from dipaco.model.transformer import ModelConfig, new_dense_model
from dipaco.routing.evaluate import heldout_loss

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import add_report_args, best, record  # noqa: E402


def step_time(topology, cfg, modules, args, rng) -> float:  # noqa: ANN001
    """One training step of --micro-batch sequences as a peer's inner loop takes it (forward,
    cross-entropy, backward, clipping, AdamW), the best of --repeats after a warm-up step
    (bench/peer_throughput.py measures the rest of a task)."""
    model = topology.build_path(cfg, 0, modules)
    model.train()
    opt = make_optimizer(model, InnerSettings(lr=4e-4, warmup_steps=10, total_steps=1000))
    x = torch.from_numpy(rng.integers(0, args.vocab, (args.micro_batch, args.seq + 1)))

    def step() -> None:
        logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up: the optimizer's state, the allocator
    return best(step, args.repeats)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=896)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32_000)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--prefix", type=int, default=32, help="routing prefix, not scored")
    ap.add_argument("--docs", type=int, nargs="+", default=[8], help="held-out documents scored")
    ap.add_argument("--offshard", action="store_true",
                    help="validation.offshard_check: also score on other paths' documents")  # fmt: skip
    ap.add_argument("--inner-steps", type=int, default=62, help="H (the paper: 62 or 150)")
    ap.add_argument("--batch", type=int, default=512, help="sequences per inner step")
    ap.add_argument("--micro-batch", type=int, default=1, help="sequences per timed step")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a small path (CI)")
    add_report_args(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.dim, args.layers, args.heads, args.vocab, args.seq = 64, 2, 2, 512, 128
        args.docs, args.inner_steps, args.batch = [2], 8, 8
    torch.manual_seed(0)
    cfg = ModelConfig(args.vocab, args.dim, args.layers, args.heads, max_seq_len=args.seq)
    topology = Topology.parse("2x2", args.layers)
    modules = topology.init_modules(new_dense_model(cfg, 0).state_dict())
    path_mids = topology.path_modules(0)
    current = {mid: modules[mid] for mid in path_mids}
    proposed = {
        mid: {k: v - 1e-3 * torch.randn_like(v) for k, v in t.items()} for mid, t in current.items()
    }
    params = sum(v.numel() for t in current.values() for v in t.values())
    rng = np.random.default_rng(0)
    print(f"path: {params / 1e6:.1f}M parameters, sequence {args.seq}, "
          f"{torch.get_num_threads()} threads", flush=True)  # fmt: skip

    t_step = step_time(topology, cfg, current, args, rng)
    task = t_step / args.micro_batch * args.batch * args.inner_steps
    print(f"training step of {args.micro_batch} x {args.seq}: {t_step:.2f} s; "
          f"task (H = {args.inner_steps} x {args.batch} sequences): {task:.0f} s", flush=True)  # fmt: skip

    rows = []
    for n in args.docs:
        pools = [
            [rng.integers(0, args.vocab, args.seq + 1).astype(np.int32) for _ in range(n)]
            for _ in range(2 if args.offshard else 1)
        ]

        def score(pools: list = pools) -> None:
            # heldout.check_heldout: its own documents before and after (then other paths')
            for docs in pools:
                for tensors in (current, proposed):
                    path = topology.build_path(cfg, 0, tensors)
                    with torch.no_grad():
                        heldout_loss(path, docs, seq_len=args.seq, prefix_tokens=args.prefix)

        t_score = best(score, args.repeats)
        tokens = len(pools) * n * (args.seq - args.prefix)
        ratio = t_score / task
        print(f"{n} documents ({tokens} scored tokens): scoring {t_score:.2f} s", flush=True)
        print(f"ratio (scoring / task, {n} documents): {ratio:.5f}", flush=True)
        rows.append(f"{n} docs ({tokens} tokens) {t_score:.2f} s = {100 * ratio:.3f}%")
    record(
        args,
        "scoring_cost",
        f"{params / 1e6:.1f}M path; task H = {args.inner_steps} x {args.batch} x {args.seq} "
        f"= {task:.0f} s (step of {args.micro_batch}: {t_step:.2f} s); scoring a delta"
        + (" (with offshard_check)" if args.offshard else "")
        + ": "
        + "; ".join(rows),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
