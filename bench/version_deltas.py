"""How much smaller a module download would be as a version delta (measured; not built).

A peer holding version v of a module could fetch v+1 as what changed since v, but the result
must still be the owner's signed version bit for bit, so the delta can only be lossless: here,
the XOR of the two versions' bytes, each tensor's bytes regrouped by their position in the
element (all the sign-and-exponent bytes together, and so on), then zlib. A real lossless run
of the tiny 2x2 (``bench/communication.py``'s, H = 8, 12 rounds) trains the modules; the last
two versions each module's store keeps are compared, against zlib on the newer version alone.

    python bench/version_deltas.py [--source builtin:mixed]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import communication  # noqa: E402

from dipaco.prepare.pipeline import prepare  # noqa: E402
from dipaco.protocols.wire import read_tensor_file  # noqa: E402


def regrouped(tensors: dict[str, torch.Tensor]) -> bytes:
    """The tensors' bytes in name order, each tensor's bytes grouped by position in an element."""
    parts = []
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        raw = t.reshape(-1).view(torch.uint8)
        parts.append(raw.view(-1, t.element_size()).t().contiguous().view(-1))
    return torch.cat(parts).numpy().tobytes()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", default="builtin", help="corpus (builtin, builtin:mixed, a file)")
    ap.add_argument("--steps", type=int, default=96, help="inner steps per path in all (H = 8)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dipaco-vdelta-") as tmp:
        work = Path(tmp)
        prepared = work / "prepared"
        prepare(prepared, communication.tiny(args.source))
        result = communication.one_run(
            prepared, work, "lossless", 8, args.steps, 4, source=args.source
        )
        store = next(work.glob("lossless-H8/**/modules"))
        raw_total = delta_total = alone_total = 0
        for folder in sorted(p for p in store.iterdir() if p.is_dir()):
            versions = sorted(int(f.stem[1:]) for f in folder.glob("v*.dpt"))
            if len(versions) < 2:
                continue
            old = read_tensor_file(folder / f"v{versions[-2]}.dpt").tensors
            new = read_tensor_file(folder / f"v{versions[-1]}.dpt").tensors
            xor = {k: old[k].contiguous().view(torch.uint8) ^ new[k].contiguous().view(torch.uint8)
                   for k in new}  # fmt: skip
            # The XOR keeps each tensor's element size for the regrouping: view it back.
            xor = {k: v.view(new[k].dtype) for k, v in xor.items()}
            raw = sum(t.numel() * t.element_size() for t in new.values())
            delta = len(zlib.compress(regrouped(xor), 6))
            alone = len(zlib.compress(regrouped(new), 6))
            raw_total, delta_total, alone_total = (
                raw_total + raw, delta_total + delta, alone_total + alone
            )  # fmt: skip
            print(
                f"{folder.name}: v{versions[-2]} -> v{versions[-1]}: version delta "
                f"{raw / delta:.2f}x smaller, the version alone {raw / alone:.2f}x"
            )
        print(
            f"all modules ({args.source}, perplexity {result['ppl']:.2f}): version delta "
            f"{raw_total / delta_total:.2f}x smaller, the version alone "
            f"{raw_total / alone_total:.2f}x"
        )


if __name__ == "__main__":
    main()
