"""A path trained over 2 gloo processes (``dipaco.peer.ddp``) equals the single-process path on
the same global batches, within 1e-6, from an optimizer that already holds state."""

import dataclasses
import os
import sys

import pytest
import torch
import torch.multiprocessing as mp

from dipaco.errors import ConfigError
from dipaco.model.optim import InnerSettings, make_optimizer, train_step
from dipaco.model.transformer import ModelConfig, PathModel
from dipaco.peer import ddp

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, max_seq_len=16)
SETTINGS = InnerSettings(lr=3e-3, warmup_steps=2, total_steps=12)
WARM, STEPS, BATCH, SEQ = 2, 6, 4, 12


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=g) for _ in range(n)]


def fresh() -> tuple[PathModel, torch.optim.Optimizer]:
    torch.manual_seed(3)
    model = PathModel(CFG)
    model.train()
    return model, make_optimizer(model, SETTINGS)


def warm_up(model, optimizer, data) -> None:
    """What a peer's inner state brings: AdamW moments from earlier rounds."""
    for i in range(WARM):
        train_step(model, optimizer, data[i], SETTINGS, step=i)


def lead(group: ddp.Group, out: str) -> None:
    """Rank 0: the steps a single process takes, led over the group; its result saved."""
    data = batches(WARM + STEPS)
    model, optimizer = fresh()
    warm_up(model, optimizer, data)
    spec = {"model": dataclasses.asdict(CFG), "settings": dataclasses.asdict(SETTINGS)}
    wrapped = ddp.start_task(group, model, optimizer, spec)
    losses = []
    for i in range(WARM, WARM + STEPS):
        batch = ddp.send_step(group, i, data[i])
        loss = ddp.sharded_step(group, model, wrapped, optimizer, batch, SETTINGS, step=i)
        losses.append(loss.item())
    ddp.quit_followers(group)
    torch.save({"params": model.state_dict(), "losses": losses}, out)


def rank_main(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    group = ddp.Group.join(init, rank, 2, "cpu")
    ended = False
    try:
        if rank != 0:
            ddp.follow(group)
        else:
            lead(group, out)
        ended = True
    finally:
        group.close(synchronise=ended)
    # As `dipaco.cli.machine.follow_path` does: leave without the interpreter's teardown, where
    # gloo's threads can abort the process ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_two_gloo_processes_train_the_path_a_single_process_trains(tmp_path):
    data = batches(WARM + STEPS)
    model, optimizer = fresh()
    warm_up(model, optimizer, data)
    expected = [
        train_step(model, optimizer, data[i], SETTINGS, step=i).item()
        for i in range(WARM, WARM + STEPS)
    ]
    out = tmp_path / "ddp.pt"
    mp.spawn(rank_main, args=(f"file://{tmp_path / 'rendezvous'}", str(out)), nprocs=2)
    got = torch.load(out, weights_only=True)
    assert got["losses"] == pytest.approx(expected, abs=1e-6)
    worst = max((got["params"][k] - v).abs().max().item() for k, v in model.state_dict().items())
    assert worst <= 1e-6, worst
    # ...and the steps moved the parameters (the comparison is not of two untouched models).
    untouched, _ = fresh()
    assert any(not torch.equal(untouched.state_dict()[k], v) for k, v in model.state_dict().items())


def test_a_batch_that_does_not_split_over_the_devices_is_refused():
    group = ddp.Group(rank=0, world=3, device="cpu")
    with pytest.raises(ConfigError, match="does not split over 3 devices"):
        group.share(torch.zeros(4, 5, dtype=torch.int64))
