"""Write token files for ``dataset=tokens``: a text file's bytes as token ids (vocabulary 256),
split into ``train.bin`` and ``val.bin`` (the last ``--val-fraction``), each with its sidecar.

    python scripts/make_tokens.py book.txt --out data/
    python scripts/make_tokens.py --generated-mb 200 --out /tmp/big/     # a generated corpus of ~200 MB
    python train.py task=lm dataset=tokens dataset.path=data/train.bin dataset.val_path=data/val.bin
    python scripts/make_tokens.py book.txt --out data/ --shards 8        # train/shard-0000.bin ...: token_shards

Bytes need no tokenizer and no download. For a subword vocabulary, write the ids your own tokenizer
produces with ``ddplab.data.write_tokens(ids, path, dtype, vocab_size)`` (uint32 above 65,536 ids).
Files are written in chunks, so a corpus larger than memory works too.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from ddplab.data.tabular import generated_corpus  # noqa: E402
from ddplab.data.tokens import DTYPES, write_sidecar  # noqa: E402

CHUNK = 64 << 20  # bytes read and written at a time


def chunks(args: argparse.Namespace):
    """The corpus as byte chunks."""
    if args.generated_mb:
        left, seed = int(args.generated_mb * (1 << 20)), 0
        while left > 0:
            part = generated_corpus(sentences=20000, seed=seed).encode()[:left]
            left, seed = left - len(part), seed + 1
            yield part
        return
    with open(args.text, "rb") as f:
        while part := f.read(CHUNK):
            yield part


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("text", nargs="?", help="a text file (read as bytes)")
    p.add_argument("--generated-mb", type=float, default=0, help="instead of a file: a generated corpus this big")
    p.add_argument("--out", default=".", help="folder for train.bin and val.bin")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="uint16")
    p.add_argument("--shards", type=int, default=1, help="N > 1: the training tokens as N files in train/ "
                   "(dataset=token_shards) instead of train.bin")
    args = p.parse_args()
    if not args.text and not args.generated_mb:
        p.error("give a text file, or --generated-mb N")
    if not 0 < args.val_fraction < 1:
        p.error(f"--val-fraction={args.val_fraction}: must be in (0, 1)")
    total = int(args.generated_mb * (1 << 20)) if args.generated_mb else os.path.getsize(args.text)
    n_val = max(1, int(total * args.val_fraction))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = [(out / "train.bin", total - n_val), (out / "val.bin", n_val)]
    tmps = [open(path.with_name(path.name + ".tmp"), "wb") for path, _ in files]
    done = 0
    for part in chunks(args):  # the first total - n_val bytes to train.bin, the rest to val.bin
        cut = max(0, min(len(part), total - n_val - done))
        for f, piece in ((tmps[0], part[:cut]), (tmps[1], part[cut:])):
            np.frombuffer(piece, dtype=np.uint8).astype(DTYPES[args.dtype]).tofile(f)
        done += len(part)
    for f, (path, n) in zip(tmps, files):
        f.close()
        os.replace(f.name, path)  # a reader never sees half a file
        write_sidecar(path, args.dtype, n, 256)
    if args.shards > 1:
        shard(files[0][0], args.shards, args.dtype)
        print(f"{out / 'train'}: {args.shards} shards, {files[0][1]:,} tokens; {files[1][0]}: {n_val:,} tokens "
              f"({args.dtype}, vocabulary 256)")
        return
    print(f"{files[0][0]}: {files[0][1]:,} tokens; {files[1][0]}: {n_val:,} tokens ({args.dtype}, vocabulary 256)")


def shard(train: Path, n: int, dtype: str) -> None:
    """Cut ``train`` into ``n`` contiguous shard files ``train/shard-XXXX.bin`` (for dataset=token_shards)."""
    data = np.memmap(train, dtype=DTYPES[dtype], mode="r")
    folder = train.parent / "train"
    folder.mkdir(exist_ok=True)
    bounds = np.linspace(0, len(data), n + 1).astype(np.int64)
    for k in range(n):
        path = folder / f"shard-{k:04d}.bin"
        np.asarray(data[bounds[k]:bounds[k + 1]]).tofile(path.with_name(path.name + ".tmp"))
        os.replace(path.with_name(path.name + ".tmp"), path)
        write_sidecar(path, dtype, int(bounds[k + 1] - bounds[k]), 256)
    del data
    train.unlink()
    Path(f"{train}.json").unlink()


if __name__ == "__main__":
    main()
