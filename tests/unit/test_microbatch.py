"""Gradient accumulation in the inner loop, and the device memory estimate that picks it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dipaco.errors import ConfigError
from dipaco.model.optim import InnerSettings, make_optimizer, train_steps
from dipaco.model.transformer import ModelConfig, new_dense_model
from dipaco.peer.device import (
    _mem_available,
    check_fits,
    device_memory_bytes,
    path_memory_bytes,
    path_parameter_count,
    pick_micro_batch,
)

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, max_seq_len=16)
SETTINGS = InnerSettings(lr=3e-3, warmup_steps=2, total_steps=10)
STEPS, BATCH, SEQ = 3, 8, 12


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def _train(**kwargs) -> tuple[dict[str, torch.Tensor], list[float]]:
    model = new_dense_model(CFG, seed=3)
    opt = make_optimizer(model, SETTINGS)
    losses = train_steps(
        model, opt, iter(_batches()), SETTINGS, steps=STEPS, step_offset=0, **kwargs
    )
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def test_micro_batch_matches_full_batch() -> None:
    full, full_losses = _train()
    micro, micro_losses = _train(micro_batch=3)  # 8 rows: chunks of 3, 3, 2
    assert micro_losses == pytest.approx(full_losses, abs=1e-5)
    for name, tensor in full.items():
        torch.testing.assert_close(micro[name], tensor, atol=1e-5, rtol=0, msg=name)
    # The run actually moved the parameters (the comparison is not vacuous).
    start = new_dense_model(CFG, seed=3).state_dict()
    assert any(not torch.equal(start[n], t) for n, t in full.items())


def test_micro_batch_none_and_large_are_bit_identical() -> None:
    base, base_losses = _train()
    for kwargs in ({"micro_batch": None}, {"micro_batch": BATCH}, {"micro_batch": 100}):
        params, losses = _train(**kwargs)
        assert losses == base_losses
        for name, tensor in base.items():
            assert torch.equal(params[name], tensor), (kwargs, name)


def test_a_compiled_forward_trains_like_the_model() -> None:
    """The peer passes ``torch.compile(model)`` as ``forward`` on a GPU; a compiled module has no
    truth value (its ``__len__`` raises), which once stopped every GPU peer at its first step.
    The "eager" backend compiles through Dynamo without a C compiler, so this runs on any CPU."""
    base, base_losses = _train()
    model = new_dense_model(CFG, seed=3)
    compiled = torch.compile(model, backend="eager")
    with pytest.raises(TypeError):
        bool(compiled)  # the trap itself, so this test keeps meaning something
    opt = make_optimizer(model, SETTINGS)
    for micro_batch in (None, 3):
        model.load_state_dict(new_dense_model(CFG, seed=3).state_dict())
        opt = make_optimizer(model, SETTINGS)
        losses = train_steps(
            model,
            opt,
            iter(_batches()),
            SETTINGS,
            steps=STEPS,
            step_offset=0,
            forward=compiled,
            micro_batch=micro_batch,
        )
        assert losses == pytest.approx(base_losses, abs=1e-5)
        for name, tensor in model.state_dict().items():
            torch.testing.assert_close(tensor, base[name], atol=1e-5, rtol=0, msg=name)


def test_bf16_autocast_trains_within_tolerance_of_fp32_and_keeps_fp32_masters() -> None:
    """A GPU peer's default precision, on the CPU (autocast works there too): the losses stay
    within 0.02 of fp32's over the steps, the parameters (the master weights, hence the delta a
    peer sends) stay float32, and the delta differs from fp32's by under 10% of its norm."""
    start = new_dense_model(CFG, seed=3).state_dict()
    fp32, fp32_losses = _train()
    bf16, bf16_losses = _train(autocast=torch.bfloat16)
    assert bf16_losses == pytest.approx(fp32_losses, abs=0.02)
    assert bf16_losses != fp32_losses  # autocast did compute in bf16
    assert all(t.dtype == torch.float32 for t in bf16.values())
    for name in start:
        d32, d16 = start[name] - fp32[name], start[name] - bf16[name]
        if d32.norm() > 0:
            assert (d16 - d32).norm() <= 0.1 * d32.norm(), name


def test_micro_batch_must_be_positive() -> None:
    with pytest.raises(ValueError):
        _train(micro_batch=0)


def test_parameter_count_matches_model() -> None:
    model = new_dense_model(CFG, seed=0)
    assert path_parameter_count(CFG) == sum(p.numel() for p in model.parameters())


def test_memory_estimate_grows_with_batch_and_optimizer() -> None:
    one = path_memory_bytes(CFG, 1, SEQ)
    assert path_memory_bytes(CFG, 4, SEQ) > one
    assert path_memory_bytes(CFG, 1, SEQ, optimizer=False) < one
    # The logits term alone: B * T * vocab * 4 bytes * 2.
    assert path_memory_bytes(CFG, 2, SEQ) - one >= SEQ * CFG.vocab_size * 4 * 2


def test_pick_micro_batch_shrinks_with_memory() -> None:
    assert pick_micro_batch(CFG, 64, SEQ, "cpu", memory_bytes=2**40) == 64
    picks = [
        pick_micro_batch(
            CFG, 64, SEQ, "cpu", memory_bytes=int(path_memory_bytes(CFG, mb, SEQ) / 0.8)
        )
        for mb in (64, 32, 16, 8, 4, 2, 1)
    ]
    assert picks == [64, 32, 16, 8, 4, 2, 1]
    # Between two sizes: the smaller one, and never below 1.
    between = (path_memory_bytes(CFG, 16, SEQ) + path_memory_bytes(CFG, 32, SEQ)) // 2
    assert pick_micro_batch(CFG, 64, SEQ, "cpu", memory_bytes=int(between / 0.8)) == 16
    assert pick_micro_batch(CFG, 64, SEQ, "cpu", memory_bytes=1) == 1
    # Non-power-of-two batch: 12, 6, 3, 1.
    need3 = path_memory_bytes(CFG, 3, SEQ)
    assert pick_micro_batch(CFG, 12, SEQ, "cpu", memory_bytes=int(need3 / 0.8) + 1) == 3


def test_check_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    check_fits(CFG, SEQ, "cpu", memory_bytes=2**40)  # plenty: no error
    with pytest.raises(ConfigError) as err:  # a --memory-gb cap too small: says it is the cap
        check_fits(CFG, SEQ, "cuda:0", memory_bytes=1024)
    message = str(err.value)
    assert "device cuda:0 is capped at" in message and "(--memory-gb), one path needs" in message
    assert "free" not in message
    assert "even at micro-batch 1" in message
    assert err.value.reason == "device-too-small"
    # Without a cap, the device's own free memory (probed) is what is too small.
    monkeypatch.setattr("dipaco.peer.device.device_memory_bytes", lambda _device: 1024)
    with pytest.raises(ConfigError) as err:
        check_fits(CFG, SEQ, "cuda:0")
    assert "device cuda:0 has 9.54e-07 GiB free, one path needs" in str(err.value)
    assert err.value.reason == "device-too-small"


def test_a_card_too_small_for_the_path_in_bf16_is_told_what_bf16_needs() -> None:
    """A GPU peer trains in bf16 autocast: its activations take half the bytes, so the check at
    join plans for that, and says the precision and the GiB it needs."""
    big = ModelConfig(vocab_size=512, dim=256, n_layers=4, n_heads=4, max_seq_len=1024)
    fp32 = path_memory_bytes(big, 1, 1024)
    bf16 = path_memory_bytes(big, 1, 1024, bf16=True)
    assert bf16 < fp32
    between = int((fp32 + bf16) / 2 / 0.8)  # enough for bf16, not for fp32 (80% headroom)
    check_fits(big, 1024, "cuda:0", memory_bytes=between, bf16=True)
    with pytest.raises(ConfigError, match="in fp32"):
        check_fits(big, 1024, "cuda:0", memory_bytes=between)
    with pytest.raises(
        ConfigError, match=rf"needs {bf16 / 2**30:.3g} GiB even at micro-batch 1 in bf16"
    ):
        check_fits(big, 1024, "cuda:0", memory_bytes=bf16 // 2, bf16=True)
    # The micro-batch it picks in bf16 is the largest that fits: the next one up does not.
    picked = pick_micro_batch(big, 8, 1024, "cuda:0", memory_bytes=between, bf16=True)
    assert path_memory_bytes(big, picked, 1024, bf16=True) <= between * 0.8
    assert picked == 8 or path_memory_bytes(big, 2 * picked, 1024, bf16=True) > between * 0.8
    assert picked >= pick_micro_batch(big, 8, 1024, "cuda:0", memory_bytes=between)
    # Not even 1 fits: 1, and check_fits (above) is what refuses.
    assert pick_micro_batch(big, 8, 1024, "cuda:0", memory_bytes=bf16 // 2, bf16=True) == 1


def test_device_memory_probe(tmp_path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:    8000000 kB\n")
    assert _mem_available(meminfo) == 8_000_000 * 1024
    meminfo.write_text("MemTotal:       16000000 kB\n")  # a kernel that does not say
    assert _mem_available(meminfo) is None
    assert _mem_available(tmp_path / "none") is None  # no /proc
    if Path("/proc/meminfo").exists():  # Linux: the machine's own, in bytes
        cpu = device_memory_bytes("cpu")
        assert cpu is not None and 2**20 < cpu <= 2**50
    assert device_memory_bytes("meta") is None
    if not torch.cuda.is_available():
        assert device_memory_bytes("cuda") is None


def test_the_memory_cap_on_a_plain_cuda_device_names_its_index(monkeypatch) -> None:
    """``--memory-gb`` on ``--device cuda`` (no index): torch's per-process fraction wants a
    device index, and the first real GPU run (an H200, 2026-11-30) stopped with "Expected a
    torch.device with a specified index". The cap is set on the current device, at the share
    of its memory the cap asks for. torch's own index check stands in for the card."""
    from torch.cuda._utils import _get_device_index

    from dipaco.peer import device as dev

    fractions: list[tuple[float, int]] = []

    def set_fraction(fraction: float, device: object = None) -> None:
        fractions.append((fraction, _get_device_index(device)))  # raises as torch does

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**34, 2**35))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    dev.cap_memory("cuda", 2**33)
    dev.cap_memory("cuda:0", 2**36)  # more than the card: the whole of it
    assert fractions == [(0.25, 0), (1.0, 0)]
