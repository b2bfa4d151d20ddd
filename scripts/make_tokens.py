"""Write token files for ``dataset=tokens``: a text file's bytes as token ids (vocabulary 256),
split into ``train.bin`` and ``val.bin`` (the last ``--val-fraction``), each with its sidecar.

    python scripts/make_tokens.py book.txt --out data/
    python scripts/make_tokens.py --generated-mb 200 --out /tmp/big/     # a generated corpus of ~200 MB
    python train.py task=lm dataset=tokens dataset.path=data/train.bin dataset.val_path=data/val.bin
    python scripts/make_tokens.py book.txt --out data/ --shards 8        # train/shard-0000.bin ...

Bytes need no tokenizer and no download. A subword vocabulary (Hugging Face ``tokenizers``: the ``hf`` extra):

    python scripts/make_tokens.py book.txt --out data/ --tokenizer my/tokenizer.json   # a local tokenizer
    python scripts/make_tokens.py book.txt --out data/ --train-bpe 4096 --workers 2    # a BPE of the text
    python train.py task=lm dataset=tokens dataset.path=data/train.bin dataset.val_path=data/val.bin \
        dataset.vocab_size=4096

The tokenizer is saved beside the files (``data/tokenizer.json``) and named in their sidecars with its hash
and vocabulary, so a run whose ``dataset.vocab_size`` is smaller is refused in one line. Files are written in
chunks (encoded in ``--workers`` processes), so a corpus larger than memory works too; the ids are those of
the whole text (ddplab.data.tokenizer). Ids from elsewhere: ``ddplab.data.write_tokens(ids, path, dtype,
vocab)``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from ddplab.config import InputError  # noqa: E402
from ddplab.data.tabular import generated_corpus  # noqa: E402
from ddplab.data.tokens import DTYPES, write_sidecar  # noqa: E402

CHUNK = 64 << 20  # bytes read and written at a time
TEXT_CHUNK = 4 << 20  # bytes of text a tokenizer worker encodes at a time (--tokenizer, --train-bpe)


def chunks(args: argparse.Namespace, size: int | None = None):
    """The corpus as byte chunks (of ``size`` bytes, CHUNK by default, when read from a file)."""
    if args.generated_mb:
        left, seed = int(args.generated_mb * (1 << 20)), 0
        while left > 0:
            part = generated_corpus(sentences=20000, seed=seed).encode()[:left]
            left, seed = left - len(part), seed + 1
            yield part
        return
    with open(args.text, "rb") as f:
        while part := f.read(size or CHUNK):
            yield part


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("text", nargs="?", help="a text file (read as bytes)")
    p.add_argument(
        "--generated-mb", type=float, default=0, help="instead of a file: a generated corpus this big"
    )
    p.add_argument("--out", default=".", help="folder for train.bin and val.bin")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="uint16")
    p.add_argument(
        "--shards",
        type=int,
        default=1,
        help="N > 1: the training tokens as N files in train/ (dataset=token_shards) instead of train.bin",
    )
    p.add_argument("--tokenizer", help="a local Hugging Face tokenizer.json: its ids instead of bytes")
    p.add_argument(
        "--train-bpe",
        type=int,
        metavar="VOCAB",
        help="train a byte-level BPE of VOCAB ids on the text (its first --train-mb) and write its ids",
    )
    p.add_argument(
        "--train-mb", type=float, default=100, help="--train-bpe: how much of the text it learns from"
    )
    p.add_argument("--workers", type=int, default=1, help="processes that encode with the tokenizer")
    return p


def main(argv: list[str] | None = None) -> None:
    p = _parser()
    args = p.parse_args(argv)
    if not args.text and not args.generated_mb:
        p.error("give a text file, or --generated-mb N")
    if not 0 < args.val_fraction < 1:
        p.error(f"--val-fraction={args.val_fraction}: must be in (0, 1)")
    if args.tokenizer and args.train_bpe:
        p.error("--tokenizer and --train-bpe: one tokenizer, either a file or one trained on the text")
    total = int(args.generated_mb * (1 << 20)) if args.generated_mb else os.path.getsize(args.text)
    n_val = max(1, int(total * args.val_fraction))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.tokenizer or args.train_bpe:
        try:
            write_subword(args, out, total - n_val)
        except InputError as e:
            sys.exit(f"make_tokens.py: {e}")
        return
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
        print(
            f"{out / 'train'}: {args.shards} shards, {files[0][1]:,} tokens; {files[1][0]}: {n_val:,} tokens "
            f"({args.dtype}, vocabulary 256)"
        )
        return
    print(
        f"{files[0][0]}: {files[0][1]:,} tokens; {files[1][0]}: {n_val:,} tokens ({args.dtype}, vocabulary "
        "256)"
    )


def write_subword(args: argparse.Namespace, out: Path, split_at: int) -> None:
    """train.bin / val.bin of a tokenizer's ids (the text's bytes before / after the first exact cut at or
    after ``split_at``), the tokenizer saved as out/tokenizer.json and named in both sidecars."""
    from ddplab.data import tokenizer as tz

    if args.train_bpe:
        budget = int(args.train_mb * (1 << 20))
        head = tz.pieces(_prefix(chunks(args, TEXT_CHUNK), budget), budget, last_errors="ignore")
        tok = tz.train_bpe((line for _, text in head for line in text.splitlines(True)), args.train_bpe)
    else:
        tok = tz.load(args.tokenizer)
    vocab = tok.get_vocab_size()
    if args.train_bpe and vocab < args.train_bpe:
        print(
            f"make_tokens.py: the BPE stopped at {vocab} ids (--train-bpe {args.train_bpe}): the text has no "
            "pair left to merge; the files and sidecars say {vocab}".replace("{vocab}", str(vocab))
        )
    dtype = args.dtype if vocab <= np.iinfo(DTYPES[args.dtype]).max + 1 else "uint32"
    saved = out / "tokenizer.json"
    tok.save(str(saved))
    files = [out / "train.bin", out / "val.bin"]
    tmps, counts = [open(f.with_name(f.name + ".tmp"), "wb") for f in files], [0, 0]
    for part, ids in tz.encode(tok, tz.pieces(chunks(args, TEXT_CHUNK), split_at), args.workers):
        ids.astype(DTYPES[dtype]).tofile(tmps[part])
        counts[part] += ids.size
    meta = tz.describe(tok, saved)
    for f, path, n in zip(tmps, files, counts):
        f.close()
        os.replace(f.name, path)
        write_sidecar(path, dtype, n, vocab, tokenizer=meta)
    if args.shards > 1:
        shard(files[0], args.shards, dtype, vocab, meta)
    train = f"{out / 'train'}: {args.shards} shards" if args.shards > 1 else f"{files[0]}"
    print(
        f"{train}: {counts[0]:,} tokens; {files[1]}: {counts[1]:,} tokens ({dtype}, {meta['model']} "
        f"vocabulary {vocab}, {saved})"
    )


def _prefix(parts, budget: int):
    """The first ``budget`` bytes of a stream of byte chunks."""
    for part in parts:
        if budget <= 0:
            return
        yield part[:budget]
        budget -= len(part)


def shard(train: Path, n: int, dtype: str, vocab: int = 256, tokenizer: dict | None = None) -> None:
    """Cut ``train`` into ``n`` contiguous shard files ``train/shard-XXXX.bin`` (for dataset=token_shards)."""
    data = np.memmap(train, dtype=DTYPES[dtype], mode="r")
    folder = train.parent / "train"
    folder.mkdir(exist_ok=True)
    bounds = np.linspace(0, len(data), n + 1).astype(np.int64)
    for k in range(n):
        path = folder / f"shard-{k:04d}.bin"
        np.asarray(data[bounds[k] : bounds[k + 1]]).tofile(path.with_name(path.name + ".tmp"))
        os.replace(path.with_name(path.name + ".tmp"), path)
        write_sidecar(path, dtype, int(bounds[k + 1] - bounds[k]), vocab, tokenizer=tokenizer)
    del data
    train.unlink()
    Path(f"{train}.json").unlink()


if __name__ == "__main__":
    main()
