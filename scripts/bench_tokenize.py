"""How fast scripts/make_tokens.py turns text into a subword tokenizer's ids (MB of text per second), by
``--workers``, as whole processes (launch to exit, the files written).

    python scripts/bench_tokenize.py         # 40 MB of generated text, a BPE of 8192, workers 1 and 2
    python scripts/bench_tokenize.py --mb 200 --workers 1 2 4 --vocab 32000

The text is generated (lines of sentences, nothing downloaded); the BPE is learnt on its first 8 MB once,
outside the timing; each run encodes the whole file with it (``--tokenizer``), alternating the worker counts.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def corpus(path: Path, mb: float) -> None:
    from ddplab.data.tabular import generated_corpus

    left, seed = int(mb * (1 << 20)), 0
    with open(path, "w", encoding="utf-8") as f:
        while left > 0:
            said = generated_corpus(sentences=20000, seed=seed).strip().split(". ")
            text = "".join(". ".join(said[i : i + 5]) + ".\n" for i in range(0, len(said), 5))[:left]
            f.write(text)
            left, seed = left - len(text.encode()), seed + 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=40)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from ddplab.data import tokenizer as tz

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus(tmp / "text.txt", args.mb)
        head = (tmp / "text.txt").read_text(encoding="utf-8")[: 8 << 20]
        tz.train_bpe(head.splitlines(True), args.vocab).save(str(tmp / "tokenizer.json"))
        size = (tmp / "text.txt").stat().st_size / (1 << 20)
        walls: dict[int, list[float]] = {w: [] for w in args.workers}
        for _ in range(args.repeats):
            for w in args.workers:
                t0 = time.perf_counter()
                subprocess.run(
                    [
                        sys.executable,
                        str(REPO / "scripts" / "make_tokens.py"),
                        str(tmp / "text.txt"),
                        "--out",
                        str(tmp / f"out{w}"),
                        "--tokenizer",
                        str(tmp / "tokenizer.json"),
                        "--workers",
                        str(w),
                    ],
                    check=True,
                    capture_output=True,
                )
                walls[w].append(time.perf_counter() - t0)
        print(f"| text MB | vocabulary | workers | median s (of {args.repeats}) | MB/s |")
        print("|---|---|---|---|---|")
        for w, ws in walls.items():
            med = statistics.median(ws)
            print(f"| {size:.1f} | {args.vocab} | {w} | {med:.2f} | {size / med:.2f} |")


if __name__ == "__main__":
    main()
