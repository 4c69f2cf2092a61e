"""Wire encoding speed: a demo path's deltas through dipaco's frames vs torch.save/torch.load.

torch.save is the obvious (pickle-based) alternative that dipaco refuses on the network; this
prints the time of both in the same run and their ratio, so noise on a shared machine cancels.
It also prints what the signed envelope (dipaco/protocols/auth.py: seal, then open and verify,
on top of the frames) costs against the frames alone.

    python bench/wire.py [--dim 512] [--layers 8] [--repeat 5]
"""

from __future__ import annotations

import argparse
import io
import time

import torch

from dipaco.model.topology import Topology
from dipaco.model.transformer import ModelConfig, new_dense_model
from dipaco.protocols import auth
from dipaco.protocols import messages as m


def best_of(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    cfg = ModelConfig(
        vocab_size=4096, dim=args.dim, n_layers=args.layers, n_heads=8, max_seq_len=128
    )
    topo = Topology.parse("2x2", cfg.n_layers)
    modules = topo.split_path_state(0, new_dense_model(cfg, 0).state_dict())
    tensors = {f"{mid}/{k}": v for mid, ts in modules.items() for k, v in ts.items()}
    msg = m.SubmitDelta(
        peer_id="p",
        task_id="t",
        path=0,
        base_versions={mid: 0 for mid in modules},
        tokens=1,
        losses=[1.0],
        tensors=tensors,
    )
    mb = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20

    def ours():
        m.decode_message(m.encode_message(msg))

    def baseline():
        buf = io.BytesIO()
        torch.save(tensors, buf)
        buf.seek(0)
        torch.load(buf, weights_only=True)

    me = auth.Identity.generate()

    def signed():
        sealed, _ = auth.seal_request(me, m.encode_message(msg))
        m.decode_message(auth.open_request(sealed).body)

    t_ours, t_base = best_of(ours, args.repeat), best_of(baseline, args.repeat)
    t_signed = best_of(signed, args.repeat)
    print(
        f"payload {mb:.1f} MiB: dipaco frames {t_ours * 1e3:.1f} ms ({mb / t_ours:.0f} MiB/s), "
        f"torch.save+load {t_base * 1e3:.1f} ms ({mb / t_base:.0f} MiB/s)"
    )
    print(f"ratio dipaco / torch.save: {t_ours / t_base:.2f}")
    print(
        f"signed envelope: {t_signed * 1e3:.1f} ms ({mb / t_signed:.0f} MiB/s); "
        f"ratio signed / unsigned frames: {t_signed / t_ours:.2f}"
    )


if __name__ == "__main__":
    main()
