"""The language-model path against a nanoGPT-style loop: TinyGPT on a token file, same job, whole processes.

    python scripts/bench_lm.py                          # 2 ranks, 50 and 250 steps, 3 rounds (about 6 min)
    python scripts/bench_lm.py --steps 50 250 --rounds 3 --nproc 2
    python scripts/bench_lm.py --same-allocator         # nanoGPT's side with ddplab's malloc thresholds too

Both sides are launched by ``torchrun --standalone --nproc_per_node=N`` and train the same model (ddplab's
``TinyGPT``: 2 layers, 4 heads, 64 wide, block 64, vocabulary 256) with AdamW (fused), a global batch of
64 windows of 64 tokens, DDP over gloo, a cosine schedule with 20 warmup steps, and the loss reduced across
ranks every 10 steps into a rank-0 TensorBoard writer:

* **nanoGPT**: nanoGPT's ``train.py`` loop, cut to what this job uses: random windows from an
  ``np.memmap`` of the file (``get_batch``), forward, backward, step, ``zero_grad``, the lr set each step;
* **ddplab**: ``train.py task=lm dataset=tokens model=gpt optimizer=adamw scheduler=cosine max_steps=N``
  with its defaults (metrics, stall watch, stop agreement, exact evaluation and a checkpoint at the end,
  and ``perf.host_allocator=tuned``: glibc's malloc keeps a step's freed blocks for the next step).
  ``--same-allocator`` gives the nanoGPT side the same two thresholds (``MALLOC_MMAP_THRESHOLD_``,
  ``MALLOC_TRIM_THRESHOLD_``), to compare the loops alone.

A step's cost is the difference of two run lengths divided by their steps: (wall(250) − wall(50)) / 200,
each wall a whole process from launch to exit, so start-up, the last evaluation and the checkpoint drop
out. The sides alternate within each round. Reported: the per-step ms of each round and side, their
medians and the ratio ddplab / nanoGPT.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BLOCK, VOCAB, BATCH, LOG_EVERY, LR, WARMUP = 64, 256, 64, 10, 1e-3, 20


def write_tokens(folder: Path, mb: float) -> tuple[Path, Path]:
    """train.bin (``mb`` MB) and a small val.bin of random uint16 tokens, with ddplab's sidecars."""
    import numpy as np

    sys.path.insert(0, str(REPO / "src"))
    from ddplab.data.tokens import write_sidecar

    rng = np.random.default_rng(0)
    paths = []
    for name, n in (("train.bin", int(mb * (1 << 20)) // 2), ("val.bin", 64 * 1024)):
        path = folder / name
        rng.integers(0, VOCAB, size=n, dtype=np.uint16).tofile(path)
        write_sidecar(path, "uint16", n, VOCAB)
        paths.append(path)
    return paths[0], paths[1]


# ------------------------------------------------------------------ the nanoGPT-style side (one rank)
def nanogpt_rank(train_bin: str, steps: int, out_dir: str) -> None:
    import math

    import numpy as np
    import torch
    import torch.distributed as torch_dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.tensorboard import SummaryWriter

    sys.path.insert(0, str(REPO / "src"))
    from ddplab.models.gpt import TinyGPT

    torch_dist.init_process_group("gloo")
    rank, world = torch_dist.get_rank(), torch_dist.get_world_size()
    torch.manual_seed(1337 + rank)  # nanoGPT: each rank draws its own windows
    per_rank = BATCH // world

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        data = np.memmap(train_bin, dtype=np.uint16, mode="r")  # re-opened per batch, as nanoGPT does
        ix = torch.randint(len(data) - BLOCK - 1, (per_rank,))
        x = torch.stack([torch.from_numpy(data[i : i + BLOCK].astype(np.int64)) for i in ix.tolist()])
        y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + BLOCK].astype(np.int64)) for i in ix.tolist()])
        return x, y

    def get_lr(it: int) -> float:  # linear warmup, then cosine to 0.1 x lr
        if it < WARMUP:
            return LR * (it + 1) / WARMUP
        ratio = (it - WARMUP) / max(1, steps - WARMUP)
        return LR * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * ratio)))

    torch.manual_seed(0)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    model = DDP(TinyGPT(vocab_size=VOCAB, block_size=BLOCK))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    writer = SummaryWriter(out_dir) if rank == 0 else None
    torch.manual_seed(1337 + rank)
    x, y = get_batch()
    for it in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = get_lr(it)
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        x, y = get_batch()  # nanoGPT fetches the next batch while the backward is queued (on a GPU)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (it + 1) % LOG_EVERY == 0:
            reduced = loss.detach().clone()
            torch_dist.all_reduce(reduced)
            if writer is not None:
                writer.add_scalar("train/loss", reduced.item() / world, it + 1)
    if writer is not None:
        writer.close()
    torch_dist.barrier()  # gloo aborts a rank that tears down while its peer still talks to it
    torch_dist.destroy_process_group()


# ------------------------------------------------------------------ whole processes
def command(
    side: str, a: argparse.Namespace, steps: int, train_bin: Path, val_bin: Path, out: Path
) -> list[str]:
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.nproc}"]
    if side == "nanogpt":
        return launch + [
            __file__,
            "--rank-of",
            "nanogpt",
            "--train-bin",
            str(train_bin),
            "--run-steps",
            str(steps),
            "--out",
            str(out),
        ]
    return launch + [
        str(REPO / "train.py"),
        "task=lm",
        "dataset=tokens",
        f"dataset.path={train_bin}",
        f"dataset.val_path={val_bin}",
        f"dataset.block_size={BLOCK}",
        f"dataset.vocab_size={VOCAB}",
        "model=gpt",
        "optimizer=adamw",
        f"optimizer.lr={LR}",
        "scheduler=cosine",
        f"scheduler.warmup_steps={WARMUP}",
        f"batch_size={BATCH}",
        f"log_every_n_steps={LOG_EVERY}",
        f"max_steps={steps}",
        "num_epochs=null",
        "progress=none",
        f"hydra.run.dir={out}",
    ]


# What ddplab's perf.host_allocator=tuned sets in its CPU ranks (ddplab.runtime.allocator), as glibc's
# variables.
SAME_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(512 << 20)}


def wall(cmd: list[str], extra_env: dict[str, str]) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **extra_env}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    took = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, nargs=2, default=[50, 250], help="the two run lengths")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--mb", type=float, default=20, help="the token file's size")
    p.add_argument("--json", help="also write the figures here")
    p.add_argument(
        "--same-allocator",
        action="store_true",
        help="give the nanoGPT side ddplab's malloc thresholds too (its loop against ddplab's, alone)",
    )
    p.add_argument("--rank-of", help=argparse.SUPPRESS)
    p.add_argument("--train-bin", help=argparse.SUPPRESS)
    p.add_argument("--run-steps", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank_of == "nanogpt":
        nanogpt_rank(a.train_bin, a.run_steps, a.out)
        return
    short, long = a.steps
    per_step: dict[str, list[float]] = {"nanogpt": [], "ddplab": []}
    with tempfile.TemporaryDirectory(prefix="bench-lm-") as tmp:
        train_bin, val_bin = write_tokens(Path(tmp), a.mb)
        for r in range(a.rounds):
            for side in ("nanogpt", "ddplab") if r % 2 == 0 else ("ddplab", "nanogpt"):
                extra = SAME_ALLOCATOR if side == "nanogpt" and a.same_allocator else {}
                walls = {
                    n: wall(command(side, a, n, train_bin, val_bin, Path(tmp) / f"{side}-{r}-{n}"), extra)
                    for n in (short, long)
                }
                per_step[side].append((walls[long] - walls[short]) / (long - short) * 1e3)
                print(
                    f"round {r + 1} {side:8s} {short} steps {walls[short]:.2f} s, {long} steps "
                    f"{walls[long]:.2f} s: "
                    f"{per_step[side][-1]:.2f} ms/step",
                    flush=True,
                )
    med = {k: statistics.median(v) for k, v in per_step.items()}
    # The two sides of a round ran back to back: their ratio is the least touched by the VM's drift over
    # minutes.
    paired = [d / n for d, n in zip(per_step["ddplab"], per_step["nanogpt"])]
    print(
        f"\nms per step (median of {a.rounds}): nanoGPT {med['nanogpt']:.2f}, ddplab {med['ddplab']:.2f}; "
        f"ratio ddplab / nanoGPT {med['ddplab'] / med['nanogpt']:.3f}; per round "
        f"{', '.join(f'{r:.3f}' for r in paired)} (median {statistics.median(paired):.3f})"
    )
    print(
        "| rounds | nanoGPT ms/step | ddplab ms/step | ratio of medians | ratio per round (median) "
        "|\n|---|---|---|---|---|"
    )
    print(
        f"| {a.rounds} | {', '.join(f'{v:.2f}' for v in per_step['nanogpt'])} | "
        f"{', '.join(f'{v:.2f}' for v in per_step['ddplab'])} | **{med['ddplab'] / med['nanogpt']:.3f}** | "
        f"{', '.join(f'{r:.3f}' for r in paired)} (**{statistics.median(paired):.3f}**) |"
    )
    if a.json:
        Path(a.json).write_text(
            json.dumps({"per_step_ms": per_step, "median": med, "paired": paired}, indent=1)
        )


if __name__ == "__main__":
    main()
