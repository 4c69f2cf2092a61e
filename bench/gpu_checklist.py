"""The GPU checklist: what a session runs first whenever it finds a GPU lent to it.

On whatever device is present (``--device cuda``, or ``--device cpu`` for its CPU form, which
CI's test suite does not run but any machine can), in this order, each a row in
``docs/benchmarks.md`` with the device named:

  1. precision   the same path, the same batches, the same start: fp32 against bf16 autocast,
                 and bf16 + torch.compile, for ``--agree-steps`` inner steps through dipaco's
                 own ``train_steps``. Printed: the largest loss difference and the difference of
                 the resulting deltas (what a peer sends) relative to the fp32 delta. The
                 parameters stay fp32 (autocast computes in bf16, the master weights and the
                 delta are fp32), so the delta's dtype is checked too.
  2. throughput  ``bench/peer_throughput.py --paper-path --push-behind`` (the paper's 150 M
                 path) at H = 16 and at the paper's H = 150 (``--task-steps``): MFU against the
                 card's measured bf16 matmul peak, and a real peer's inner loop and whole task
                 (fetch and push included) against a bare loop, pushed as usual and pushed
                 behind the next task (targets: MFU >= 45% on an H100, inner loop >= 0.95 of
                 bare, whole task >= 0.95 of the inner loop at H = 150).
  3. machine     ``dipaco-peer join --gpus all`` (``cpu:2`` in the CPU form) trains a tiny 2x2
                 run against a loopback coordinator, a path per worker, then again with
                 ``--shard-path`` (each path over every device, DDP); on one GPU it says that
                 the run shows the plumbing only.
  4. memory      the memory cap (``dipaco-peer join --memory-gb``) on the paper's path, batch
                 16 x 1024, bf16 autocast: the micro-batch planned without a cap and under
                 ``--memory-cap-gib``, each trained for a few steps; the estimate against the
                 measured peak, and whether an allocation past the cap is refused (GPU form only:
                 on a CPU the cap is not enforced).
  5. DiPaCo      ``bench/paper_table.py --preset small`` (``smoke`` in the CPU form): the
                 paper's comparison at small scale, its table printed.

    python bench/gpu_checklist.py                  # the GPU form (make gpu-check)
    python bench/gpu_checklist.py --device cpu     # the CPU form: tiny sizes, a few minutes
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _report import add_report_args, record  # noqa: E402

from dipaco.model.optim import InnerSettings, make_optimizer, train_steps  # noqa: E402
from dipaco.model.transformer import ModelConfig, new_dense_model  # noqa: E402


def agreement(device: str, cfg: ModelConfig, steps: int, batch: int, seq: int) -> dict:
    """Train one path from one start on one list of batches three ways; compare to fp32."""
    g = torch.Generator().manual_seed(11)
    batches = [
        torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g).to(device)
        for _ in range(steps)
    ]
    settings = InnerSettings(lr=1e-3, warmup_steps=max(1, steps // 10), total_steps=steps)
    start = new_dense_model(cfg, seed=5).state_dict()
    runs = {}
    ways = {"fp32": (None, False), "bf16": (torch.bfloat16, False)}
    if device.startswith("cuda"):
        ways["bf16+compile"] = (torch.bfloat16, True)
    for name, (autocast, compiled) in ways.items():
        model = new_dense_model(cfg, seed=5).to(device)
        model.load_state_dict(start)
        opt = make_optimizer(model, settings)
        marks: list[float] = []  # after each step (its loss read): the first one compiles
        losses = train_steps(
            model, opt, iter(batches), settings, steps=steps, step_offset=0,
            autocast=autocast, forward=torch.compile(model) if compiled else None,
            on_step=lambda i, loss, marks=marks: marks.append(time.perf_counter()),
        )  # fmt: skip
        seconds = (marks[-1] - marks[0]) / max(1, steps - 1)  # per step, the first left out
        delta = {k: (start[k].to(device) - v).float() for k, v in model.state_dict().items()}
        dtypes = {str(v.dtype) for v in model.state_dict().values() if v.is_floating_point()}
        runs[name] = {"losses": losses, "delta": delta, "seconds": seconds, "dtypes": dtypes}
        print(
            f"  {name:>13}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, {seconds * 1e3:.1f} ms a step "
            "after the first; "
            f"parameters {', '.join(sorted(dtypes))}",
            flush=True,
        )
    ref = runs["fp32"]
    norm = torch.sqrt(sum((d**2).sum() for d in ref["delta"].values())).item()
    out = {}
    for name, r in runs.items():
        if name == "fp32":
            continue
        loss_gap = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"], strict=True))
        diff = torch.sqrt(
            sum(((r["delta"][k] - ref["delta"][k]) ** 2).sum() for k in ref["delta"])
        ).item()
        out[name] = {
            "max_loss_gap": loss_gap,
            "final_loss_gap": abs(r["losses"][-1] - ref["losses"][-1]),
            "delta_rel": diff / norm,
            "fp32_params": r["dtypes"] == {"torch.float32"},
            "speedup": ref["seconds"] / r["seconds"],
        }
    return out


def memory_cap(device: str, cfg: ModelConfig, batch: int, seq: int, cap_gib: float) -> dict:
    """Train the path a few steps uncapped and under the cap (``fit_micro_batch``, as the peer
    does with ``--memory-gb``); each one's micro-batch, estimated and measured peak; then whether
    an allocation that would cross the cap is refused. The cap is lifted before returning."""
    from dipaco.peer.device import fit_micro_batch, path_memory_bytes

    steps = 3
    g = torch.Generator().manual_seed(3)
    batches = [
        torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g).to(device)
        for _ in range(steps)
    ]
    settings = InnerSettings(lr=1e-3, warmup_steps=1, total_steps=steps)
    train = {"seq_len": seq, "batch_size": batch}
    out: dict = {}
    cap = int(cap_gib * 2**30)
    try:
        for name, limit in (("uncapped", None), ("capped", cap)):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            mb = fit_micro_batch(cfg, train, device, limit, bf16=True)
            row = {"micro_batch": mb, "estimate": path_memory_bytes(cfg, mb, seq, bf16=True)}
            model = new_dense_model(cfg, seed=5).to(device)
            opt = make_optimizer(model, settings)
            try:
                losses = train_steps(
                    model, opt, iter(batches), settings, steps=steps, step_offset=0,
                    micro_batch=mb, autocast=torch.bfloat16,
                )  # fmt: skip
                row["loss"] = losses[-1]
            except torch.OutOfMemoryError as e:
                row["error"] = f"out of memory: {str(e).splitlines()[0][:120]}"
            row["peak"] = torch.cuda.max_memory_allocated()
            if limit is not None:
                # Past the cap by 1 GiB from what is held now: the allocator must refuse it.
                want = cap - torch.cuda.memory_allocated() + 2**30
                try:
                    extra = torch.empty(want, dtype=torch.uint8, device=device)
                    del extra
                    row["refused"] = False
                except torch.OutOfMemoryError:
                    row["refused"] = True
            del model, opt
            out[name] = row
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, torch.cuda.current_device())
        torch.cuda.empty_cache()
    return out


def machine_smoke(gpus: str, shard: bool, folder: Path) -> dict:
    """A tiny 2x2 run (2 rounds of 10 steps) against a loopback coordinator, trained by one
    ``dipaco-peer join --gpus GPUS`` machine; what its last line said and how long it took."""
    bin_dir = Path(sys.executable).parent
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    config = folder / "run.toml"
    config.write_text(
        'preset = "tiny"\n[train]\ninner_steps = 10\nrounds = 2\n[scheduler]\nquorum = 1.0\n'
    )
    run = folder / "run"
    coordinator = subprocess.Popen(
        [bin_dir / "dipaco-coordinator", "start", "--config", config, "--run-dir", run,
         "--no-eval", "--transport", "loopback"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        address = run / "coordinator" / "address"
        deadline = time.monotonic() + 300
        while not address.exists() and coordinator.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        began = time.perf_counter()
        cmd = [bin_dir / "dipaco-peer", "--log-format", "plain", "join", address.read_text().strip(),
               "--authkey-file", run / "coordinator" / "authkey", "--gpus", gpus,
               "--peer-id", "checklist", "--state-dir", folder / "peer"]  # fmt: skip
        done = subprocess.run(
            cmd + (["--shard-path"] if shard else []), capture_output=True, text=True, timeout=600
        )
        seconds = time.perf_counter() - began
        coordinator.wait(120)
    finally:
        if coordinator.poll() is None:
            coordinator.kill()
            coordinator.wait()
    lines = [line for line in done.stdout.splitlines() if "tasks by" in line]
    summary = lines[-1].split(" ", 1)[-1] if lines else done.stdout[-300:]
    return {"summary": summary, "seconds": seconds, "code": done.returncode}


def step(title: str) -> None:
    print(f"\n== {title} ==", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--agree-steps", type=int, default=50)
    ap.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=["precision", "throughput", "machine", "memory", "dipaco"],
    )
    ap.add_argument(
        "--memory-cap-gib", type=float, default=4.0, help="the memory step's cap (GPU form)"
    )
    ap.add_argument("--out", default="runs/gpu_checklist", help="paper table's folder")
    ap.add_argument(
        "--task-steps",
        type=int,
        nargs="+",
        default=[16, 150],
        help="inner steps H of the throughput step's tasks, one run each (GPU form)",
    )
    add_report_args(ap)
    args = ap.parse_args()
    gpu = args.device.startswith("cuda")
    if gpu and not torch.cuda.is_available():
        print("no CUDA device here: run with --device cpu for the CPU form", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(0) if gpu else "cpu"
    report = [] if args.no_record else (["--doc", args.doc] if args.doc else [])
    if args.no_record:
        report = ["--no-record"]
    began = time.perf_counter()

    if "precision" not in args.skip:
        step(f"1. precision on {name}: fp32 against bf16 autocast (and compile)")
        if gpu:
            cfg = ModelConfig(vocab_size=8192, dim=896, n_layers=12, n_heads=16, max_seq_len=1024)
            batch, seq = 8, 1024
        else:
            cfg = ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=2, max_seq_len=64)
            batch, seq = 8, 64
        res = agreement(args.device, cfg, args.agree_steps, batch, seq)
        parts = []
        for way, r in res.items():
            print(
                f"  {way}: largest loss gap {r['max_loss_gap']:.4f} (final {r['final_loss_gap']:.4f}),"
                f" delta differs from fp32's by {r['delta_rel']:.2%} of its norm; parameters fp32: "
                f"{r['fp32_params']}; {r['speedup']:.2f}x fp32's speed "
                "per step (the first, which compiles, left out)",
                flush=True,
            )
            parts.append(
                f"{way}: loss gap max {r['max_loss_gap']:.4f} final {r['final_loss_gap']:.4f}, "
                f"delta {r['delta_rel']:.2%} off fp32's, fp32 master weights "
                f"{'yes' if r['fp32_params'] else 'NO'}, {r['speedup']:.2f}x fp32 speed per step"
            )
        n = sum(p.numel() for p in new_dense_model(cfg, seed=0).parameters())
        record(
            args,
            "precision",
            f"{n / 1e6:.0f}M path, {args.agree_steps} steps, batch {batch}x{seq}: "
            + "; ".join(parts),
        )

    if "throughput" not in args.skip:
        step(f"2. a real peer's throughput on {name}")
        cmd = [sys.executable, str(HERE / "peer_throughput.py"), "--device", args.device]
        if not gpu:
            subprocess.run([*cmd, "--quick", *report], check=True)
        for h in args.task_steps if gpu else []:
            # A long task's whole-task ratio is what a volunteer's GPU gives; 3 tasks each way
            # keep H = 150 within a few minutes.
            tasks = ["--tasks", "3"] if h >= 100 else []
            subprocess.run(
                [*cmd, "--paper-path", "--push-behind", "--steps", str(h), *tasks, *report],
                check=True,
            )

    if "machine" not in args.skip:
        count = torch.cuda.device_count() if gpu else 2
        gpus = "all" if gpu else "cpu:2"
        step(f"3. one peer over {count} {'GPU' if gpu else 'CPU worker'}(s): join --gpus {gpus}")
        if gpu and count < 2:
            print("  one GPU here: --gpus runs one worker; the smoke run shows the plumbing only")
        parts = []
        for shard in (False, True):
            r = machine_smoke(gpus, shard, Path(args.out) / f"machine{'-shard' if shard else ''}")
            how = "--shard-path (one path over all, DDP)" if shard else "a path per worker"
            print(f"  {how}: {r['summary']} in {r['seconds']:.1f} s, exit {r['code']}", flush=True)
            parts.append(f"{how}: {r['summary']} in {r['seconds']:.1f} s (exit {r['code']})")
        record(
            args, "machine", f"--gpus {gpus} on {count} device(s), tiny 2x2: " + "; ".join(parts)
        )

    if "memory" not in args.skip and gpu:
        step(f"4. the memory cap on {name}: --memory-gb {args.memory_cap_gib:g}")
        cfg = ModelConfig(vocab_size=8192, dim=896, n_layers=12, n_heads=16, max_seq_len=1024)
        res = memory_cap(args.device, cfg, 16, 1024, args.memory_cap_gib)
        parts = []
        for way, r in res.items():
            gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
            how = f"loss {r['loss']:.3f}" if "loss" in r else r["error"]
            past = ""
            if "refused" in r:
                past = f"; 1 GiB past the cap {'refused' if r['refused'] else 'NOT refused'}"
            line = (
                f"{way}: micro-batch {r['micro_batch']}, estimate {gib(r['estimate'])}, "
                f"peak {gib(r['peak'])} ({r['peak'] / r['estimate']:.2f}x), {how}{past}"
            )
            print(f"  {line}", flush=True)
            parts.append(line)
        record(
            args,
            "memory",
            f"131M path, batch 16x1024 bf16, cap {args.memory_cap_gib:g} GiB: " + "; ".join(parts),
        )

    if "dipaco" not in args.skip:
        step(f"5. DiPaCo at small scale on {name}")
        cmd = [sys.executable, str(HERE / "paper_table.py"), "--device", args.device]
        cmd += ["--preset", "small" if gpu else "smoke", "--out", args.out]
        subprocess.run(cmd, check=True)
        table = Path(args.out) / "paper_table.md"
        if table.exists():
            print(table.read_text())
    print(f"\nchecklist done in {time.perf_counter() - began:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
