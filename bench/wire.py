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
import sys
from pathlib import Path

import torch

from dipaco.protocols import auth
from dipaco.protocols import messages as m

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import best, path_modules, submit_delta  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    modules = path_modules(args.dim, args.layers)
    tensors = {f"{mid}/{k}": v for mid, ts in modules.items() for k, v in ts.items()}
    msg = submit_delta(modules, tensors)
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
        room = auth.ENVELOPE_ROOM  # what the transports do: the envelope sealed in place
        sealed, _ = auth.seal_request(me, m.encode_message(msg, room=room), room=room)
        m.decode_message(auth.open_request(sealed).body)

    t_ours, t_base = best(ours, args.repeat), best(baseline, args.repeat)
    t_signed = best(signed, args.repeat)
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
