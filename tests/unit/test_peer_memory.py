"""What a peer holds between tasks: its module cache keeps one path's modules (fetching a task
of another path drops the modules the new path lacks, and the ones it keeps no longer hold the
reply they came in), and what a task freed goes back to the system before the next one."""

import ctypes

import numpy as np
import torch

from dipaco.peer.device import trim_heap
from dipaco.peer.modules import keep_path_modules


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def test_the_cache_keeps_the_new_paths_modules_in_memory_of_their_own():
    reply = bytearray(4 * 1000)  # one received buffer, both modules views of it
    flat = torch.from_numpy(np.frombuffer(reply, dtype=np.float32))
    flat.copy_(torch.arange(1000.0))
    cache = {
        "L0.0": (3, {"w": flat[:900]}),
        "S.embed": (2, {"weight": flat[900:]}),
    }
    start, end = flat.data_ptr(), flat.data_ptr() + 4 * 1000
    keep_path_modules(cache, {"S.embed": 2, "L0.1": 3})
    assert list(cache) == ["S.embed"] and cache["S.embed"][0] == 2
    kept = cache["S.embed"][1]["weight"]
    assert not start <= kept.data_ptr() < end  # its own memory: the reply can go
    assert torch.equal(kept, torch.arange(900.0, 1000.0))


def test_the_same_path_again_copies_nothing():
    t = torch.ones(4)
    cache = {"L0.0": (1, {"w": t})}
    keep_path_modules(cache, {"L0.0": 2})
    assert cache["L0.0"][1]["w"] is t


def test_memory_freed_into_the_heap_goes_back_to_the_system():
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    block = 48 << 10  # under glibc's mmap threshold: from the heap, kept there once freed
    blocks = [libc.malloc(block) for _ in range(6000)]  # about 280 MiB
    for b in blocks:
        ctypes.memset(b, 1, block)  # touched: resident
    for b in blocks[::2]:
        libc.free(b)  # holes between live blocks: glibc keeps them, resident
    held = _rss()
    trim_heap()
    released = held - _rss()
    for b in blocks[1::2]:
        libc.free(b)
    assert released > 100 << 20, f"only {released >> 20} MiB went back"
