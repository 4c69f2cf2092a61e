"""The training device: which one ``auto`` means and what the inner loop uses on it (autocast,
torch.compile, fused AdamW); how much memory one path needs to train, how much the device has,
and the micro-batch to use.

The estimate is deliberately simple and on the generous side: fp32 parameters, their gradients,
AdamW's two moments, and the activations autograd keeps for one micro-batch of a Llama-style
decoder (see :mod:`dipaco.model.transformer`), at 2 bytes an element under bf16 autocast. It is used to pick a micro-batch for gradient
accumulation (:func:`dipaco.model.optim.train_steps`) and to refuse, with a readable message, a
device on which not even a micro-batch of one window fits.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

import torch

from dipaco.errors import ConfigError
from dipaco.model.optim import fused_adamw_available
from dipaco.model.transformer import ModelConfig

_FP32 = 4
_GIB = 2**30


@functools.cache
def _glibc() -> Any:
    """The C library, if it is glibc (it has ``malloc_trim``); None elsewhere."""
    try:
        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def trim_heap() -> None:
    """Give the free pages of the process's heap back to the system (glibc's ``malloc_trim``).

    Between a peer's tasks: the last task's gradients and activations, and another path's model,
    are freed into glibc's heap, which keeps them; the next task's allocations did not all land
    in them, so the peak crept up task by task (docs/benchmarks.md, *Fewer live copies*).
    Nothing where the C library is not glibc."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


# glibc's mallopt parameters, and how large a freed block the heap keeps while a batch trains.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_HELD_BLOCK = 32 << 20  # the most glibc lets the heap serve (half its 64 MiB heap limit)
_HELD_TOP = 1 << 30


def hold_heap() -> None:
    """Keep freed memory in the process's heap until ``trim_heap``, for the rest of the process.

    A stacked step allocates and frees the same blocks of several MiB every step (16 ladder-sized
    paths: 8 MiB of logits and their gradient, 4 MiB per feed-forward). glibc's defaults gave each
    back to the system when freed (blocks above its mmap threshold, or the heap's top above its
    trim threshold) and the next step faulted them in again: ``bench/stacked_trainer.py
    --no-hold-heap`` measures the eager stack at 7,076 page faults and 15.7 ms of kernel time a
    step (docs/results.md). Here blocks up to 32 MiB come from the heap and its top is kept up to
    1 GiB; the peer gives it back between
    tasks (``PathTrainer.let_go`` calls ``trim_heap``). Nothing where the C library is not
    glibc."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, _HELD_BLOCK)
        libc.mallopt(_M_TRIM_THRESHOLD, _HELD_TOP)


def resolve_device(name: str) -> str:
    """``auto`` is the first CUDA GPU when there is one, else the CPU."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def training_features(device: str, precision: str = "auto", compile: str = "auto") -> dict:
    """What the inner loop uses on this device: autocast dtype, torch.compile, fused AdamW.

    ``precision``: "auto" (bfloat16 autocast on a GPU that has it, float32 elsewhere), "fp32"
    or "bf16". ``compile``: "auto" (on a GPU), "on" or "off". The fused AdamW kernel is used
    wherever torch has one (CPU and CUDA), see ``dipaco.model.optim.make_optimizer``.
    """
    if precision not in ("auto", "fp32", "bf16"):
        raise ConfigError(f"precision must be auto, fp32 or bf16, not {precision!r}")
    if compile not in ("auto", "on", "off"):
        raise ConfigError(f"compile must be auto, on or off, not {compile!r}")
    gpu = device.startswith("cuda") and torch.cuda.is_available()
    bf16 = precision == "bf16" or (precision == "auto" and gpu and torch.cuda.is_bf16_supported())
    return {
        "autocast": torch.bfloat16 if bf16 else None,
        "compile": compile == "on" or (compile == "auto" and gpu),
        "fused": fused_adamw_available(device),
    }


def path_parameter_count(model_cfg: ModelConfig) -> int:
    """Parameters of one path: embedding, blocks, final norm and an untied output head."""
    d, v, h = model_cfg.dim, model_cfg.vocab_size, model_cfg.hidden
    per_layer = 4 * d * d + 3 * d * h + 2 * d  # q/k/v/o, gate/up/down, two RMSNorms
    return 2 * v * d + model_cfg.n_layers * per_layer + d


def activation_bytes(
    model_cfg: ModelConfig, micro_batch: int, seq_len: int, *, bf16: bool = False
) -> int:
    """Activations autograd keeps for one forward/backward of ``micro_batch`` windows.

    Per layer and token (fp32 elements): the two RMSNorms (input, float copy, output: ~3 * dim
    each), q/k/v and their rotary copies (~7 * dim), the attention output and residual (~3 * dim),
    the SwiGLU intermediates (gate, up, silu, product: 4 * hidden) and, in case the math attention
    kernel runs (CPU), the attention probabilities (n_heads * seq_len). On top: the embedding
    output, the final norm, and the logits with their gradient (B * T * vocab * 4 * 2).
    With ``bf16`` (autocast) the blocks' and edges' activations take 2 bytes an element; the
    logits stay float32 (the loss upcasts them).
    """
    d, h = model_cfg.dim, model_cfg.hidden
    tokens = micro_batch * seq_len
    per_token_layer = 16 * d + 4 * h + model_cfg.n_heads * seq_len
    blocks = model_cfg.n_layers * tokens * per_token_layer
    edges = tokens * 4 * d  # embedding output, final norm (input, float copy, output)
    logits = tokens * model_cfg.vocab_size * 2  # logits and their gradient / softmax
    return (blocks + edges) * (2 if bf16 else _FP32) + logits * _FP32


def path_memory_bytes(
    model_cfg: ModelConfig,
    micro_batch: int,
    seq_len: int,
    *,
    optimizer: bool = True,
    bf16: bool = False,
) -> int:
    """Estimated peak bytes to train one path at ``micro_batch`` windows of ``seq_len`` tokens.

    fp32 parameters and gradients, AdamW's two moments when ``optimizer``, and the activations
    of one micro-batch (mostly bf16 with ``bf16``: autocast keeps the master weights fp32).
    """
    if micro_batch < 1 or seq_len < 1:
        raise ValueError(f"micro_batch and seq_len must be positive, got {micro_batch}, {seq_len}")
    copies = 4 if optimizer else 2  # params, grads (+ exp_avg, exp_avg_sq)
    state = path_parameter_count(model_cfg) * _FP32 * copies
    return state + activation_bytes(model_cfg, micro_batch, seq_len, bf16=bf16)


def device_memory_bytes(device: str) -> int | None:
    """Free memory on ``device`` in bytes, or ``None`` when it cannot be told.

    CUDA: the driver's free memory; CPU: ``MemAvailable`` from ``/proc/meminfo``; anything else
    (MPS, ...): unknown.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return None
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free)
    if dev.type == "cpu":
        return _mem_available()
    return None


def _mem_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            parts = line.split()
            try:
                value = int(parts[1])
            except (IndexError, ValueError):
                return None
            unit = parts[2].lower() if len(parts) > 2 else "b"
            return value * 1024 if unit == "kb" else value
    return None


def _budget(device: str, memory_bytes: int | None, headroom: float) -> float | None:
    if not 0 < headroom <= 1:
        raise ValueError(f"headroom must be in (0, 1], got {headroom}")
    memory = memory_bytes if memory_bytes is not None else device_memory_bytes(device)
    return None if memory is None else memory * headroom


def pick_micro_batch(
    model_cfg: ModelConfig,
    batch_size: int,
    seq_len: int,
    device: str,
    *,
    memory_bytes: int | None = None,
    headroom: float = 0.8,
    bf16: bool = False,
) -> int:
    """The largest micro-batch (``batch_size``, then halving, at least 1) that fits the device.

    It fits when its estimate is within ``headroom`` of the available memory; ``memory_bytes``
    replaces the probe. When the memory cannot be told, ``batch_size``. When not even 1 fits, 1:
    :func:`check_fits` is the one that refuses.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    budget = _budget(device, memory_bytes, headroom)
    if budget is None:
        return batch_size
    mb = batch_size
    while mb > 1 and path_memory_bytes(model_cfg, mb, seq_len, bf16=bf16) > budget:
        mb //= 2
    return mb


def check_fits(
    model_cfg: ModelConfig,
    seq_len: int,
    device: str,
    *,
    memory_bytes: int | None = None,
    headroom: float = 0.8,
    bf16: bool = False,
) -> None:
    """Raise :class:`ConfigError` when one path cannot train on ``device`` even at micro-batch 1
    (in bf16 autocast with ``bf16``, the precision the peer will train in).

    Nothing is checked when the device's memory cannot be told.
    """
    budget = _budget(device, memory_bytes, headroom)
    if budget is None:
        return
    need = path_memory_bytes(model_cfg, 1, seq_len, bf16=bf16)
    if need > budget:
        have = _gib(budget / headroom)
        where = (
            f"device {device} has {have} GiB free"
            if memory_bytes is None
            else f"device {device} is capped at {have} GiB (--memory-gb)"
        )
        raise ConfigError(
            f"{where}, one path needs {_gib(need)} GiB even at "
            f"micro-batch 1 in {'bf16' if bf16 else 'fp32'} (seq_len {seq_len}, {path_parameter_count(model_cfg):,} parameters, "
            f"keeping {headroom:.0%} of the memory for it); use a smaller model or sequence "
            "length, or a device with more memory",
            reason="device-too-small",
        )


def fit_micro_batch(
    model_cfg: ModelConfig,
    train_cfg: dict,
    device: str,
    memory_bytes: int | None = None,
    *,
    bf16: bool = False,
) -> int:
    """The micro-batch for the run's batch on ``device`` (:func:`pick_micro_batch`), after
    :func:`check_fits` has refused a device on which not even one window fits. With
    ``memory_bytes`` on a CUDA device, it is also the most this process may allocate there
    (``torch.cuda.set_per_process_memory_fraction``: ``--memory-gb`` caps what dipaco takes)."""
    seq_len, batch_size = train_cfg["seq_len"], train_cfg["batch_size"]
    check_fits(model_cfg, seq_len, device, memory_bytes=memory_bytes, bf16=bf16)
    cap_memory(device, memory_bytes)
    return pick_micro_batch(
        model_cfg, batch_size, seq_len, device, memory_bytes=memory_bytes, bf16=bf16
    )


def cap_memory(device: str, memory_bytes: int | None) -> None:
    """On a CUDA device, let this process allocate at most ``memory_bytes`` there."""
    dev = torch.device(device)
    if memory_bytes is None or dev.type != "cuda" or not torch.cuda.is_available():
        return
    # set_per_process_memory_fraction wants an index: "cuda" alone means the current device.
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    _free, total = torch.cuda.mem_get_info(index)
    torch.cuda.set_per_process_memory_fraction(min(1.0, memory_bytes / total), index)


def _gib(n: float) -> str:
    return f"{n / _GIB:.3g}"
