"""Resident memory of ``dataset=tokens`` as the token file grows: does it stay flat?

For each file size (default 40 MB and 400 MB, 10x apart) it writes a random uint16 token file and
measures, each in a fresh process:

* **read, pread**: one epoch over every window in the sampler's shuffled order, through
  ``ddplab.data.tokens`` (``os.pread``; what ``dataset=tokens`` uses), the order computed a batch at a time
  (``ddplab.data.bijection``: no permutation in memory);
* **read, pread-permutation**: the same reads in the order of a permutation tensor (8 bytes a window: ddplab's
  order before), for the memory and the throughput the constant-memory order is measured against;
* **read, np.memmap**: the same epoch through a memory map (what nanoGPT's ``get_batch`` does), for
  comparison: touched pages of a mapping count towards the process's resident set;
* **train**: ``train.py task=lm dataset=tokens`` on the file, one process, ``--train-steps`` steps.

It prints the peak resident set size (``ru_maxrss``) of each process, its resident size before the
epoch started, and the time taken. Run::

    python scripts/bench_tokens.py                      # 40 and 400 MB (about 2 min on 2 CPU cores)
    python scripts/bench_tokens.py --sizes-mb 40 4000 --max-windows 2000000   # 40 MB to 4 GB, 2M windows read
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from ddplab.data.tokens import write_sidecar  # noqa: E402

CHUNK = 1 << 24  # tokens generated and written at a time


def write_file(path: Path, mb: float) -> int:
    """A random uint16 token file of about ``mb`` MB (vocabulary 256), written in chunks; its token count."""
    total, rng = int(mb * (1 << 20)) // 2, np.random.default_rng(0)
    with open(path, "wb") as f:
        for start in range(0, total, CHUNK):
            rng.integers(0, 256, size=min(CHUNK, total - start), dtype=np.uint16).tofile(f)
    write_sidecar(path, "uint16", total, 256)
    return total


def rss_mib() -> float:
    """This process's resident set size now (MiB)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


class MemmapWindows:
    """nanoGPT's way: slices of a ``np.memmap`` of the whole file (the comparison, not ddplab's path)."""

    def __init__(self, path: str, block: int, count: int):
        self.data, self.block, self.count = np.memmap(path, dtype=np.uint16, mode="r"), block, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int):
        import torch

        w = torch.from_numpy(self.data[i * self.block : i * self.block + self.block + 1].astype(np.int64))
        return w[:-1], w[1:]


# mode -> sample order
MODES = {"pread": "bijection", "pread-permutation": "permutation", "memmap": "permutation"}


def read_epoch(path: str, mode: str, block: int, limit: int | None) -> dict:
    """Child process: one shuffled epoch over every window (the first ``limit`` of its order); figures as a
    dict. ``pread``: ddplab's reads in its constant-memory order; ``pread-permutation``: the same reads in the
    order of a permutation tensor (ddplab before issue 33); ``memmap``: nanoGPT's reads."""
    from ddplab.data.sampling import ShardedGlobalSampler
    from ddplab.data.tokens import tokens

    train = tokens(path, val_path=path, block_size=block).train
    data = MemmapWindows(path, block, len(train)) if mode == "memmap" else train
    before, t0, n = rss_mib(), time.perf_counter(), 0
    sampler = ShardedGlobalSampler(len(data), 64, 1, 0, seed=0, order=MODES[mode])
    for i in sampler:  # the epoch's order is made when it starts: its cost and memory are counted
        x, _ = data[i]
        n += 1
        if n == limit:
            break
    secs = time.perf_counter() - t0
    return {
        "windows": n,
        "rss_before_mib": round(before, 1),
        "seconds": round(secs, 2),
        "windows_per_s": n / secs,
    }


def peak_of(cmd: list[str]) -> tuple[dict, float, float]:
    """Figures (the last JSON line it printed), peak RSS (MiB, from wait4: this child alone) and wall s."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=out, stderr=err, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        out.seek(0), err.seek(0)
        if proc.returncode:
            sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{err.read()[-3000:]}")
        lines = [ln for ln in out.read().splitlines() if ln.startswith("{")]
    return (json.loads(lines[-1]) if lines else {}), usage.ru_maxrss / 1024, wall


def child(args: argparse.Namespace) -> None:
    print(json.dumps(read_epoch(args.read, args.mode, args.block_size, args.max_windows)))


def rows_for(path: Path, args: argparse.Namespace, tmp: Path) -> list[list[str]]:
    rows = []
    for mode in args.modes:  # each in a fresh process: its own peak RSS, cold or warm cache alike
        cmd = [
            sys.executable,
            __file__,
            "--read",
            str(path),
            "--mode",
            mode,
            "--block-size",
            str(args.block_size),
            *(["--max-windows", str(args.max_windows)] if args.max_windows else []),
        ]
        figs, peak, wall = peak_of(cmd)
        rows.append(
            [
                f"read, {mode}",
                f"{figs['windows']:,}",
                f"{figs['rss_before_mib']:.0f}",
                f"{peak:.0f}",
                f"{figs['seconds']:.1f}",
                f"{figs['windows_per_s']:,.0f}",
            ]
        )
    run_dir = tmp / f"run-{path.stem}"
    cmd = [
        sys.executable,
        str(REPO / "train.py"),
        "task=lm",
        "dataset=tokens",
        f"dataset.path={path}",
        f"dataset.val_path={path}",
        f"dataset.block_size={args.block_size}",
        "model.n_layer=1",
        "model.n_embd=64",
        "model.n_head=2",
        "batch_size=16",
        "num_epochs=1",
        f"limit_train_steps={args.train_steps}",
        "limit_val_batches=2",
        "progress=none",
        f"hydra.run.dir={run_dir}",
    ]
    _, peak, wall = peak_of(cmd)
    rows.append([f"train, {args.train_steps} steps", "", "", f"{peak:.0f}", f"{wall:.1f}", ""])
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[40, 400])
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--train-steps", type=int, default=20)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--max-windows", type=int, help="read only the first N windows of each epoch's order")
    p.add_argument("--read", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="pread", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.read:
        return child(args)
    print(
        "| file | what | windows | RSS before the epoch, MiB | peak RSS, MiB | s | windows/s |\n"
        "|---|---|---|---|---|---|---|"
    )
    with tempfile.TemporaryDirectory() as d:
        for mb in args.sizes_mb:
            path = Path(d) / f"tokens-{mb:g}mb.bin"
            write_file(path, mb)
            for row in rows_for(path, args, Path(d)):
                print(f"| {mb:g} MB | " + " | ".join(row) + " |", flush=True)
            path.unlink()


if __name__ == "__main__":
    main()
