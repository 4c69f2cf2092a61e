"""Delta codecs against memcpy: encode and decode throughput, and bytes on the wire.

For a path's module deltas (a dense path split into its modules, random values at the scale of
a real delta), each codec of dipaco.protocols.codecs is timed:
  encode    codecs.encode (float32 -> wire tensors), as the peer runs it without feedback
  feedback  ErrorFeedback.compress: encode plus keeping the residual (what a peer runs)
  decode    codecs.decode (wire tensors -> float32, validated), as the owner runs it
against a plain copy (memcpy) of the same float32 bytes into buffers already touched, measured
in the same run. The ratio printed is copy time / codec time: 1.0 means the codec runs at memory
speed. Bytes on the wire are the SubmitDelta frames' full length (headers included), against the
float32 payload.

    python bench/codecs.py [--dim 512] [--layers 8] [--repeat 5] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from dipaco.protocols import codecs
from dipaco.protocols import messages as m
from dipaco.protocols.feedback import ErrorFeedback

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import add_report_args, best, path_modules, record, submit_delta  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="CI's short form: a small path, 2 runs")
    add_report_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.dim, args.layers, args.repeat = 128, 2, 2
    gen = torch.Generator().manual_seed(0)
    modules = path_modules(args.dim, args.layers)
    delta = {
        f"{mid}/{k}": torch.randn(v.shape, generator=gen) * 1e-3
        for mid, ts in modules.items()
        for k, v in ts.items()
    }
    raw = codecs.wire_bytes(delta)
    names = list(delta)
    dst = [torch.empty_like(delta[n]) for n in names]
    torch._foreach_zero_(dst)
    t_copy = best(lambda: torch._foreach_copy_(dst, [delta[n] for n in names]), args.repeat)
    print(
        f"path delta: {raw / 2**20:.1f} MiB float32 in {len(delta)} tensors; "
        f"memcpy {t_copy * 1e3:.1f} ms ({raw / t_copy / 1e9:.2f} GB/s); "
        f"torch threads {torch.get_num_threads()}"
    )
    values = [delta[n] for n in names]
    t_aminmax = best(lambda: [codecs._all_finite(t) for t in values], args.repeat)
    t_isfinite = best(lambda: [bool(torch.isfinite(t).all()) for t in values], args.repeat)
    print(
        f"finiteness check (every codec, both ways): aminmax {t_aminmax * 1e3:.1f} ms "
        f"(ratio {t_copy / t_aminmax:.2f}), isfinite().all() {t_isfinite * 1e3:.1f} ms "
        f"(ratio {t_copy / t_isfinite:.2f})"
    )
    print(
        f"{'codec':>9} {'encode ms':>9} {'ratio':>6} {'feedback ms':>11} {'ratio':>6} "
        f"{'decode ms':>9} {'ratio':>6} {'wire MiB':>9} {'vs fp32':>7} {'max err':>9}"
    )
    rows = []
    for codec in codecs.CODECS:
        wire = codecs.encode(codec, delta)
        t_enc = best(lambda c=codec: codecs.encode(c, delta), args.repeat)
        ef = ErrorFeedback()
        t_fb = best(lambda c=codec, f=ef: f.compress(c, "P0", delta), args.repeat)
        t_dec = best(lambda c=codec, w=wire: codecs.decode(c, w, delta), args.repeat)
        decoded = codecs.decode(codec, wire, delta)
        err = max(float((decoded[n] - delta[n]).abs().max()) for n in names)
        frame = m.encode_message(submit_delta(modules, wire))
        row = {
            "codec": codec,
            "encode": t_copy / t_enc,
            "feedback": t_copy / t_fb,
            "decode": t_copy / t_dec,
            "wire": len(frame) / raw,
        }
        rows.append(row)
        print(
            f"{codec:>9} {t_enc * 1e3:>9.1f} {row['encode']:>6.2f} {t_fb * 1e3:>11.1f} "
            f"{row['feedback']:>6.2f} {t_dec * 1e3:>9.1f} {row['decode']:>6.2f} "
            f"{len(frame) / 2**20:>9.2f} {row['wire']:>7.3f} {err:>9.2e}",
            flush=True,
        )
    print("ratio = memcpy time / codec time (1.0 = memory speed); vs fp32 = frame bytes / payload")
    lossy = [r for r in rows if r["codec"] != "lossless"]
    print(
        "ratio codec / memcpy (lossy codecs): encode median "
        f"{statistics.median(r['encode'] for r in lossy):.2f}, decode median "
        f"{statistics.median(r['decode'] for r in lossy):.2f}"
    )
    result = "; ".join(
        f"{r['codec']} enc {r['encode']:.2f} dec {r['decode']:.2f} wire {r['wire']:.3f}"
        for r in rows
    )
    record(args, "codecs", f"{raw / 2**20:.0f} MiB delta, ratio to memcpy: {result}")


if __name__ == "__main__":
    main()
