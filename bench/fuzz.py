"""The fuzz tests, long form: 20,000 generated hostile inputs per decoder, 0 uncaught exceptions.

    .venv/bin/python bench/fuzz.py                         # every decoder, about an hour
    .venv/bin/python bench/fuzz.py --examples 2000 --only fields wire

CI runs the same tests with 200 examples each (``pytest tests/fuzz``). Each test here is one
decoder of untrusted bytes (frames, messages field by field, signed envelopes, a live
coordinator's ``handle``, tickets, delta codecs, the store's files, downloads, router files and
config files), run by hypothesis with ``DIPACO_FUZZ_EXAMPLES`` examples. Prints, per test, the
examples hypothesis ran (``passing``) and whether any failed, and writes ``fuzz.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FUZZ_DIR = REPO / "tests" / "fuzz"


def run(files: list[Path], examples: int) -> tuple[int, str]:
    env = {**os.environ, "DIPACO_FUZZ_EXAMPLES": str(examples)}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--hypothesis-show-statistics",
        *map(str, files),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr


def parse(output: str) -> dict[str, dict]:
    """Per test: examples that passed, failed or were invalid (hypothesis's own counts), and
    why it stopped (``max_examples``, or the strategy ran out of distinct inputs)."""
    out: dict[str, dict] = {}
    current = None
    for line in output.splitlines():
        head = re.match(r"^(tests/\S+::\S+):$", line.strip())
        if head:
            current = head.group(1)
            out[current] = {"passing": 0, "failing": 0, "invalid": 0}
            continue
        counts = re.search(r"(\d+) passing, (\d+) failing, and (\d+) invalid", line)
        stopped = re.search(r"Stopped because (.+)$", line)
        if current and stopped:
            out[current]["stopped"] = stopped.group(1)
        if current and counts:
            for name, n in zip(("passing", "failing", "invalid"), counts.groups(), strict=True):
                out[current][name] += int(n)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--examples", type=int, default=20_000, help="examples per test")
    ap.add_argument(
        "--only", nargs="*", help="test files by their middle name (wire, fields, envelopes...)"
    )
    ap.add_argument("--out", default=str(REPO / "runs" / "fuzz"), help="results folder")
    args = ap.parse_args(argv)
    files = sorted(FUZZ_DIR.glob("test_fuzz_*.py"))
    if args.only:
        files = [f for f in files if f.stem.removeprefix("test_fuzz_") in args.only]
    t0 = time.monotonic()
    results: dict[str, dict] = {}
    failed = []
    for f in files:
        t1 = time.monotonic()
        print(f"{f.name}: {args.examples} examples per test ...", flush=True)
        code, output = run([f], args.examples)
        tests = parse(output)
        for name, counts in tests.items():
            counts["seconds"] = round(time.monotonic() - t1, 1)
            results[name] = counts
            print(
                f"  {name.split('::')[1]}: {counts['passing']} passing, "
                f"{counts['failing']} failing, {counts['invalid']} invalid "
                f"({counts.get('stopped', '?')})",
                flush=True,
            )
        if code != 0:
            failed.append(f.name)
            print(output[-3000:], flush=True)
    total = sum(c["passing"] for c in results.values())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fuzz.json").write_text(
        json.dumps({"examples": args.examples, "tests": results, "failed": failed}, indent=1)
    )
    print(
        f"{len(results)} tests, {total} examples in {time.monotonic() - t0:.0f} s; "
        f"failed files: {failed or 'none'}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
