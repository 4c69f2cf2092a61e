"""The stacked trainer (dipaco.model.stacked, dipaco.peer.stacking) against the sequential one.

The tolerance, and why: a stacked step computes the same functions as ``optim.train_step`` on each
path, but through batched matrix products, fused q/k/v and gate/up products and a per-path norm,
which sum in another order than the sequential kernels. After one step the parameters agree to
about 1e-7; each further step carries the rounding on, and training amplifies small differences
slowly. The tests allow 2e-5 absolute after 12 steps of each path (the values are of order 0.1
to 1) and 1e-4 after three rounds of a local run with outer steps in between; a real error (a
wrong learning rate, a missed clip, a path's gradient leaking into another) is far larger.
"""

from __future__ import annotations

import shutil
import threading
import time

import pytest
import torch

from dipaco.model.optim import (
    InnerSettings,
    lm_loss,
    make_optimizer,
    optimizer_state_tensors,
    param_names_in_optimizer_order,
    train_step,
)
from dipaco.model.stacked import StackedAdamW, StackedPaths, stacked_step
from dipaco.model.transformer import ModelConfig, new_dense_model
from dipaco.peer.peer import Peer
from dipaco.prepare.pipeline import prepare
from dipaco.protocols.auth import Identity
from dipaco.protocols.transport import LocalTransport
from dipaco.run.factory import build_coordinator
from dipaco.run.local import run_local_peers
from dipaco.run.metrics_log import MetricsLog

CFG = ModelConfig(vocab_size=96, dim=32, n_layers=2, n_heads=2, max_seq_len=32)
STEP_TOLERANCE = 2e-5
RUN_TOLERANCE = 1e-4


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_stacked_steps_equal_each_paths_sequential_steps():
    """Three paths, each with its own place on the schedule, its own history (one fresh, two
    with moments from earlier steps), its own data, and a clip that bites: every parameter and
    every moment agree with three sequential trainers after 12 steps."""
    settings = InnerSettings(lr=3e-3, warmup_steps=3, total_steps=40, grad_clip=0.3)
    models = [new_dense_model(CFG, seed) for seed in range(3)]
    optimizers = [make_optimizer(m, settings) for m in models]
    g = torch.Generator().manual_seed(1)
    warm = torch.randint(0, CFG.vocab_size, (5, 4, 33), generator=g)
    for k in range(5):  # path 1 has 5 steps of history, path 2 has 2, path 0 none
        train_step(models[1], optimizers[1], warm[k], settings, step=k)
        if k < 2:
            train_step(models[2], optimizers[2], warm[k], settings, step=k)
    offsets = [0, 5, 2]
    names = param_names_in_optimizer_order(models[0])
    paths = StackedPaths(CFG, [m.state_dict() for m in models])
    optimizer = StackedAdamW(paths, settings)
    for i, opt in enumerate(optimizers):
        optimizer.load_path(i, optimizer_state_tensors(opt, names), names)
    assert optimizer.steps.tolist() == [0.0, 5.0, 2.0]

    batches = torch.randint(0, CFG.vocab_size, (12, 3, 4, 33), generator=g)
    for k in range(12):
        want = [
            train_step(models[i], optimizers[i], batches[k, i], settings, step=offsets[i] + k)
            for i in range(3)
        ]
        got = stacked_step(paths, optimizer, batches[k], [settings.lr_at(o + k) for o in offsets])
        assert torch.allclose(got, torch.stack(want), atol=1e-5), (k, got, want)
    for i, model in enumerate(models):
        assert _max_diff(paths.state(i), model.state_dict()) < STEP_TOLERANCE, i
        moments = optimizer.path_state(i, names)
        assert _max_diff(moments, optimizer_state_tensors(optimizers[i], names)) < 1e-6, i
    # Different paths stay different: nothing of one path leaked into another.
    assert _max_diff(paths.state(0), paths.state(1)) > 1e-2


def test_a_paths_loss_and_gradient_are_its_own():
    """Each path's loss is ``lm_loss`` of its own model on its own batch, and its gradient in the
    stacked buffer is the model's own gradient (so the engine really adds into the buffer)."""
    models = [new_dense_model(CFG, seed) for seed in (5, 6)]
    batch = torch.randint(0, CFG.vocab_size, (2, 3, 17), generator=torch.Generator().manual_seed(2))
    paths = StackedPaths(CFG, [m.state_dict() for m in models])
    paths.zero_grad()
    losses = paths.losses(batch)
    losses.sum().backward()
    for i, model in enumerate(models):
        loss = lm_loss(model, batch[i])
        loss.backward()
        assert torch.allclose(losses[i], loss, atol=1e-6)
        for name, p in model.named_parameters():
            a, b = paths.offsets[name]
            assert torch.allclose(paths.grad[i, a:b].view_as(p), p.grad, atol=1e-6), name


def test_stacking_refuses_paths_of_another_shape():
    other = new_dense_model(ModelConfig(vocab_size=96, dim=16, n_layers=2, n_heads=2), 0)
    with pytest.raises(ValueError, match="not"):
        StackedPaths(CFG, [new_dense_model(CFG, 0).state_dict(), other.state_dict()])


@pytest.fixture
def prepared(prepared_batch):
    return prepared_batch


def _run(prepared, tmp_path, name, **peer):
    root, config = prepared
    dest = tmp_path / name
    shutil.copytree(root, dest)
    prep = prepare(dest, config)
    metrics = MetricsLog(dest / "metrics.jsonl")
    co = build_coordinator(prep, metrics, evaluate=False)
    threads = run_local_peers(co, prep, 1, stop=threading.Event(), **peer)
    for t in threads:
        t.join(120)
    assert co.finished and co.failure is None
    return co, metrics.read()


def test_a_stacked_peer_matches_a_sequential_one(prepared, tmp_path):
    sequential, _ = _run(prepared, tmp_path, "sequential", parallel=1)
    stacked, events = _run(prepared, tmp_path, "stacked", parallel=4, batching="stacked")
    worst = 0.0
    for mid in sequential.store.modules:
        assert stacked.store.version(mid) == sequential.store.version(mid) == 3
        worst = max(worst, _max_diff(stacked.store.params(mid), sequential.store.params(mid)))
    assert 0.0 < worst < RUN_TOLERANCE  # not bit for bit: stacked, but within the tolerance
    kinds = [e["event"] for e in events if e["event"] in ("task_issued", "delta")]
    assert kinds == (["task_issued"] * 4 + ["delta"] * 4) * 3, kinds


def test_a_task_whose_lease_is_lost_leaves_the_stack_and_the_others_train_on(prepared, tmp_path):
    """The scheduler takes one task of a stacked batch back mid-way: the peer drops it (its
    deltas are never sent), the other three finish in the stack, the task is issued again and
    trained from its base, and the run ends with the sequential run's parameters."""
    root, config = prepared
    dest = tmp_path / "lost"
    shutil.copytree(root, dest)
    prep = prepare(dest, config.replace(scheduler={"heartbeat_seconds": 0.05}))
    metrics = MetricsLog(dest / "metrics.jsonl")
    co = build_coordinator(prep, metrics, evaluate=False)
    taken: list[str] = []

    def on_progress(info):
        if info["path"] == 2 and info["step"] == 1 and not taken:
            task_id = info["task"]
            assert co.scheduler.release(task_id, "solo")
            taken.append(task_id)
            time.sleep(0.3)  # the heartbeat hears of it before the next step

    peer = Peer(
        LocalTransport(co.handle).authenticate(Identity.load_or_create(dest / "peer.key")),
        "solo",
        dest / "peer",
        on_progress=on_progress,
        parallel=4,
        batching="stacked",
    )
    assert peer.run() == 4 * 3
    assert co.finished and co.failure is None and taken
    deltas = [e for e in metrics.read() if e["event"] == "delta"]
    assert taken[0] not in {e.get("task") for e in deltas}
    sequential, _ = _run(prepared, tmp_path, "sequential", parallel=1)
    for mid in sequential.store.modules:
        assert _max_diff(co.store.params(mid), sequential.store.params(mid)) < RUN_TOLERANCE


def test_the_compiled_adamw_update_is_the_eager_one():
    """``StackedAdamW`` on a stack made with ``compile=True`` runs its arithmetic through
    torch.compile (one fused pass, what the ladder's CPU runs use); the buffers it leaves and the
    norms it returns equal the eager function's, a clip biting on one path and not the other."""
    from dipaco.model.stacked import _compiled_update, adamw_update

    g = torch.Generator().manual_seed(3)
    flat, exp_avg, grad = (torch.randn(2, 300, generator=g) for _ in range(3))
    exp_avg_sq = torch.rand(2, 300, generator=g)
    grad[1] *= 100  # path 1's norm is far above the clip, path 0's below it
    decays = (torch.arange(300) % 2).float()
    columns = (
        torch.tensor([[1e-3], [3e-3]]),
        torch.tensor([[2e-3], [5e-3]]),
        torch.tensor([[0.3], [0.5]]),
    )
    outs = []
    for update in (adamw_update, _compiled_update()):
        buffers = [t.clone() for t in (flat, grad, exp_avg, exp_avg_sq)]
        norms = update(*buffers, decays, *columns, 50.0, 0.1, 0.9, 0.95)
        outs.append((norms, buffers))
    (norms, eager), (compiled_norms, compiled) = outs
    assert norms[0] < 50 < norms[1]
    assert torch.allclose(norms, compiled_norms, rtol=1e-6)
    for want, got in zip(eager, compiled, strict=True):
        assert torch.allclose(want, got, rtol=1e-6, atol=1e-7)
    assert not torch.equal(compiled[0], flat)  # it stepped
