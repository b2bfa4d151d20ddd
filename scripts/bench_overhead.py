"""Framework overhead: ddplab's trainer against a hand-written DDP loop, same job.

    python scripts/bench_overhead.py                          # CPU (gloo): 1 and 2 ranks
    python scripts/bench_overhead.py --nproc 2 --epochs 16 --repeats 9
    python scripts/bench_overhead.py --device cuda --model resnet18 --image-size 224 --amp --channels-last

Both sides train the same model on the same data with the same global batch,
optimizer, schedule and world size, and are timed the same way: a global
optimizer-step hook stamps every step in rank 0.

* Step times: one launch per world size runs BOTH sides in the same
  processes, alternating epoch by epoch (hand, ddplab, ddplab, hand, ...), so
  that both see the same machine state; on a shared VM, separate processes a
  few seconds apart differ by 5-20 % on their own.
* Start-up: separate launches per side (plain ``python`` for one rank,
  ``torchrun --standalone`` for more), alternating, from process start to the
  first optimizer step, and to exit.

The hand-written side is the DDP-tutorial pattern done well: DistributedSampler
+ ``set_epoch``, DDP, autocast (+ GradScaler for fp16), ``reduce_tensor`` of
the loss every log step to a rank-0 SummaryWriter, a per-epoch evaluation
reduced across ranks and a rank-0 ``torch.save`` each epoch. ``--hand-data
loader`` feeds it through a DataLoader (per-sample ``__getitem__`` + collate,
as the tutorials do); ``tensor`` (default, the stricter baseline) indexes
whole batches from tensors already on the device, like ddplab.

ddplab's side is its Trainer with metrics, TensorBoard logging, per-epoch evaluation
and checkpoints on (its defaults); its start-up runs are the real ``train.py``, Hydra included.

Reported per side:
  step ms    median time between consecutive optimizer steps within an epoch
  mean ms    their mean (includes the log steps)
  first s    launch (process start) → first optimizer step done (median of launches)
  total s    launch → exit of a one-epoch run: evaluation, checkpoint, teardown
"""

from __future__ import annotations

import argparse
import json
import math
import os
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------ measurement
class StepClock:
    """Stamps every optimizer step (any optimizer in the process) in rank 0, labelled with ``side``."""

    def __init__(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.side = ""
        self.stamps: list[tuple[str, float]] = []
        self.first_step_s = math.nan
        self.t0 = float(os.environ.get("BENCH_T0", time.time()))
        register_optimizer_step_post_hook(self._hook)

    def _hook(self, *_: object) -> None:
        if not self.stamps:
            self.first_step_s = time.time() - self.t0
        self.stamps.append((self.side, time.perf_counter()))

    def save(self, path: str) -> None:
        if int(os.environ.get("RANK", 0)) == 0:
            Path(path).write_text(json.dumps({"stamps": self.stamps, "first_step_s": self.first_step_s}))


def step_intervals_ms(stamps: list, steps_per_epoch: int) -> dict[str, list[float]]:
    """Intervals between consecutive steps of the same epoch, per side (epoch boundaries left out:
    they also hold evaluation and checkpointing, which ``total s`` covers)."""
    out: dict[str, list[float]] = {}
    for k in range(1, len(stamps)):
        if k % steps_per_epoch:
            (side, t), (_, t_prev) = stamps[k], stamps[k - 1]
            out.setdefault(side, []).append((t - t_prev) * 1e3)
    return out


# ------------------------------------------------------------ the two sides
def ddplab_worker(a: argparse.Namespace, out: str) -> None:
    """Exactly ``python train.py OVERRIDES`` (or its torchrun twin), with the clock installed."""
    clock = StepClock()
    clock.side = "ddplab"
    sys.argv = [str(REPO / "train.py"), *ddplab_overrides(a), f"hydra.run.dir={a.workdir}/ddplab"]
    try:
        runpy.run_path(str(REPO / "train.py"), run_name="__main__")
    finally:
        clock.save(out)


def ddplab_overrides(a: argparse.Namespace) -> list[str]:
    return [
        f"model={a.model}",
        "dataset=synthetic",
        f"dataset.num_train={a.num_train}",
        f"dataset.num_val={a.num_val}",
        f"dataset.image_size={a.image_size}",
        "dataset.in_channels=3",
        f"batch_size={a.batch_size}",
        f"num_epochs={a.epochs}",
        "log_every_n_steps=10",
        "progress=none",
        f"amp={str(a.amp).lower()}",
        f"perf.channels_last={str(a.channels_last).lower()}",
        f"distributed.device={a.device}",
        *a.ddplab_args,
    ]


def hand_worker(a: argparse.Namespace, out: str) -> None:
    clock = StepClock()
    clock.side = "hand"
    try:
        loop = HandLoop(a, init_process_group=True)
        for _ in range(a.epochs):
            loop.epoch()
        loop.close()
    finally:
        clock.save(out)


def interleaved_worker(a: argparse.Namespace, out: str) -> None:
    """Both sides in one process per rank, alternating epoch by epoch (hand, ddplab, ddplab, hand, ...):
    the per-step comparison then sees the same machine state, to within a second."""
    from hydra import compose, initialize_config_dir

    from ddplab.config import register_configs
    from ddplab.runtime import group
    from ddplab.train.assemble import build_state
    from ddplab.train.loop import Trainer

    register_configs()

    clock = StepClock()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=ddplab_overrides(a) + [f"run_dir={a.workdir}/inproc"])
    state = group.init(cfg.distributed)
    trainer = Trainer(build_state(cfg, state, Path(cfg.run_dir)))
    hand = HandLoop(a, init_process_group=False)
    try:
        for i in range(a.epochs):
            for side in ("hand", "ddplab") if i % 2 == 0 else ("ddplab", "hand"):
                clock.side = side
                trainer.train_epoch() if side == "ddplab" else hand.epoch()
        trainer.state.writer.close()
        hand.close()
    finally:
        clock.save(out)
    group.teardown()


class HandLoop:
    """What a careful user writes by hand today (one ``epoch()`` at a time)."""

    def __init__(self, a: argparse.Namespace, init_process_group: bool):
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
        from torch.utils.tensorboard import SummaryWriter

        from ddplab.data import synthetic  # the same tensors ddplab's dataset=synthetic makes
        from ddplab.models import ConvNet, resnet18

        self.a = a
        self.rank, self.world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        local = int(os.environ.get("LOCAL_RANK", 0))
        cuda = a.device == "cuda"
        self.device = torch.device("cuda", local) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        if self.world > 1 and init_process_group:
            dist.init_process_group("nccl" if cuda else "gloo")

        torch.manual_seed(0)
        data = synthetic(num_train=a.num_train, num_val=a.num_val, in_channels=3, image_size=a.image_size)
        if a.model == "convnet":
            model = ConvNet(num_classes=10, in_channels=3)
        else:
            model = resnet18(num_classes=10, in_channels=3, small_input=a.image_size < 64)
        self.fmt = torch.channels_last if a.channels_last else torch.contiguous_format
        self.model = model.to(self.device).to(memory_format=self.fmt)
        self.ddp = DDP(self.model, device_ids=[local] if cuda else None) if self.world > 1 else self.model
        self.per_rank = a.batch_size // self.world
        total = a.num_train // a.batch_size * a.epochs
        self.opt = torch.optim.SGD(
            self.ddp.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4, nesterov=True
        )
        warm = min(20, total - 1)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt,
            lambda s: (
                (s + 1) / warm
                if s < warm
                else 0.5 * (1 + math.cos(math.pi * min((s - warm) / max(total - warm, 1), 1.0)))
            ),
        )
        self.dtype = torch.bfloat16 if (not cuda or torch.cuda.is_bf16_supported()) else torch.float16
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=a.amp and self.dtype == torch.float16)
        self.writer = SummaryWriter(f"{a.workdir}/hand/tb") if self.rank == 0 else None

        train_set = TensorDataset(data.train.x, data.train.y)
        self.sampler = DistributedSampler(
            train_set, self.world, self.rank, shuffle=True, seed=0, drop_last=True
        )
        self.loader = DataLoader(
            train_set, batch_size=self.per_rank, sampler=self.sampler, drop_last=True, pin_memory=cuda
        )
        self.xs, self.ys = data.train.x.to(self.device), data.train.y.to(self.device)  # "tensor" path
        val_set = TensorDataset(data.val.x, data.val.y)
        self.val_loader = DataLoader(
            val_set, batch_size=256, sampler=DistributedSampler(val_set, self.world, self.rank, shuffle=False)
        )
        self.step = self.epochs_done = 0

    def reduce_tensor(self, t):
        import torch.distributed as dist

        if self.world == 1:
            return t
        rt = t.clone()
        dist.all_reduce(rt)
        return rt / self.world

    def batches(self):
        import torch

        if self.a.hand_data == "loader":
            for x, y in self.loader:
                yield x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        else:
            for idx in torch.tensor(list(self.sampler)).to(self.device).split(self.per_rank):
                if len(idx) == self.per_rank:
                    yield self.xs[idx], self.ys[idx]

    def epoch(self) -> None:
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F

        dev = self.device
        self.sampler.set_epoch(self.epochs_done)
        self.ddp.train()
        for x, y in self.batches():
            x = x.contiguous(memory_format=self.fmt)
            with torch.autocast(dev.type, dtype=self.dtype, enabled=self.a.amp):
                loss = F.cross_entropy(self.ddp(x), y)
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
            self.opt.zero_grad(set_to_none=True)
            self.sched.step()
            self.step += 1
            if self.step % 10 == 0:
                reduced = self.reduce_tensor(loss.detach())
                if self.writer:
                    self.writer.add_scalar("train/loss", reduced.item(), self.step)
        self.ddp.eval()
        sums = torch.zeros(3, device=dev, dtype=torch.float64)
        with torch.no_grad():
            for x, y in self.val_loader:
                x, y = x.to(dev).contiguous(memory_format=self.fmt), y.to(dev)
                with torch.autocast(dev.type, dtype=self.dtype, enabled=self.a.amp):
                    logits = self.model(x)
                sums += torch.stack(
                    [
                        F.cross_entropy(logits.float(), y, reduction="sum").double(),
                        (logits.argmax(1) == y).sum().double(),
                        torch.tensor(len(y), device=dev),
                    ]
                )
        if self.world > 1:
            dist.all_reduce(sums)
        if self.rank == 0:
            self.writer.add_scalar("val/loss", (sums[0] / sums[2]).item(), self.step)
            self.writer.add_scalar("val/acc", (sums[1] / sums[2]).item(), self.step)
            torch.save(
                {
                    "model": self.model.state_dict(),
                    "optimizer": self.opt.state_dict(),
                    "scheduler": self.sched.state_dict(),
                    "scaler": self.scaler.state_dict(),
                    "epoch": self.epochs_done,
                },
                f"{self.a.workdir}/hand/ckpt.pt",
            )
        self.epochs_done += 1

    def close(self) -> None:
        import torch.distributed as dist

        if self.writer:
            self.writer.close()
        if self.world > 1 and dist.is_initialized():
            dist.barrier()


# ------------------------------------------------------------ the driver
def launch(
    worker: str, nproc: int, a: argparse.Namespace, argv: list[str], epochs: int
) -> tuple[dict, float]:
    """Run one worker (``python`` or ``torchrun``); returns rank 0's clock and the wall time."""
    out = Path(a.workdir) / f"{worker}.json"
    out.unlink(missing_ok=True)
    me = [
        str(Path(__file__).resolve()),
        "--worker",
        worker,
        "--result",
        str(out),
        *argv,
        "--epochs",
        str(epochs),
    ]
    cmd = (
        [sys.executable, *me]
        if nproc == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *me]
    )
    env = {**os.environ, "BENCH_T0": repr(time.time())}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    total = time.perf_counter() - t0
    if proc.returncode != 0 or not out.is_file():
        raise SystemExit(f"{worker} run failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
    r = json.loads(out.read_text())
    sides = 2 if worker == "interleaved" else 1
    expected = a.num_train // a.batch_size * epochs * sides
    if len(r["stamps"]) != expected:
        raise SystemExit(f"{worker}: {len(r['stamps'])} optimizer steps, expected {expected}")
    return r, total


def per_step(nproc: int, a: argparse.Namespace, argv: list[str]) -> dict:
    """Step times of both sides, interleaved epoch by epoch in one process per rank."""
    r, _ = launch("interleaved", nproc, a, argv, a.epochs)
    spe = a.num_train // a.batch_size
    stamps = r["stamps"]
    epochs: dict[str, list[float]] = {"hand": [], "ddplab": []}  # per-epoch median step time
    for e in range(len(stamps) // spe):
        block = stamps[e * spe : (e + 1) * spe]
        epochs[block[0][0]].append(statistics.median(step_intervals_ms(block, spe)[block[0][0]]))
    every = step_intervals_ms(stamps, spe)
    paired = sorted(d / h for h, d in zip(epochs["hand"], epochs["ddplab"]))
    return {
        "hand_step_ms": statistics.median(every["hand"]),
        "ddplab_step_ms": statistics.median(every["ddplab"]),
        "hand_mean_ms": statistics.fmean(every["hand"]),
        "ddplab_mean_ms": statistics.fmean(every["ddplab"]),
        "paired_min": paired[0],
        "paired_max": paired[-1],
        "paired_median": statistics.median(paired),
    }


def start_up(nproc: int, a: argparse.Namespace, argv: list[str]) -> dict:
    """Launch → first step and launch → exit, each side in its own processes, alternating."""
    runs: dict[str, list[tuple[float, float]]] = {"hand": [], "ddplab": []}
    for i in range(a.repeats):
        for side in ("hand", "ddplab") if i % 2 == 0 else ("ddplab", "hand"):
            r, total = launch(side, nproc, a, argv, a.launch_epochs)
            runs[side].append((r["first_step_s"], total))
            print(
                f"  nproc={nproc} launch {i + 1}/{a.repeats} {side:6s} first step {r['first_step_s']:.2f} s, "
                f"total {total:.2f} s",
                flush=True,
            )
    return {
        f"{side}_{k}": statistics.median(x[j] for x in rs)
        for side, rs in runs.items()
        for j, k in enumerate(("first_s", "total_s"))
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--nproc", type=int, nargs="+", default=[1, 2], help="world sizes to run (default: 1 2)")
    p.add_argument("--epochs", type=int, default=8, help="epochs per side in the interleaved step-time run")
    p.add_argument(
        "--repeats", type=int, default=5, help="separate-process launches per side (start-up times)"
    )
    p.add_argument("--launch-epochs", type=int, default=1, help="epochs of each start-up run")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model", choices=["convnet", "resnet18"], default="convnet")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--num-train", type=int, default=4096)
    p.add_argument("--num-val", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=64, help="global batch")
    p.add_argument("--amp", action="store_true", help="autocast: bf16 (fp16 + GradScaler on pre-Ampere GPUs)")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--hand-data", choices=["tensor", "loader"], default="tensor")
    p.add_argument(
        "--ddplab-args", nargs="*", default=[], help="extra train.py overrides for the ddplab side"
    )
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--worker", choices=["hand", "ddplab", "interleaved"], help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        {"hand": hand_worker, "ddplab": ddplab_worker, "interleaved": interleaved_worker}[a.worker](
            a, a.result
        )
        return

    with tempfile.TemporaryDirectory(prefix="ddplab-bench-") as work:
        a.workdir = work
        argv = _drop_option(_drop_option(sys.argv[1:], "--nproc"), "--epochs") + ["--workdir", work]
        rows = []
        for nproc in a.nproc:
            if a.batch_size % nproc:
                raise SystemExit(f"--batch-size {a.batch_size} does not split over {nproc} ranks")
            row = {"nproc": nproc, **per_step(nproc, a, argv)}
            print(
                f"nproc={nproc} step ms: hand {row['hand_step_ms']:.2f}, ddplab {row['ddplab_step_ms']:.2f}",
                flush=True,
            )
            row.update(start_up(nproc, a, argv))
            rows.append(row)
    print_table(rows, a)
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=2))


def _drop_option(argv: list[str], name: str) -> list[str]:
    """argv without ``name`` and its values (the driver loops over them itself)."""
    out, skipping = [], False
    for x in argv:
        if x == name or x.startswith(name + "="):
            skipping = x == name
            continue
        if skipping and not x.startswith("--"):
            continue
        skipping = False
        out.append(x)
    return out


def print_table(rows: list[dict], a: argparse.Namespace) -> None:
    import platform

    print(
        f"\n{a.model}, synthetic 3x{a.image_size}x{a.image_size}, global batch {a.batch_size}, "
        f"{a.num_train // a.batch_size} steps/epoch, device {a.device}"
        f"{', amp' if a.amp else ''}{', channels_last' if a.channels_last else ''}, hand data: "
        f"{a.hand_data}; "
        f"step times: {a.epochs} interleaved epochs per side; start-up: median of {a.repeats} launches per "
        "side; "
        f"{platform.machine()}, {os.cpu_count()} cores\n"
    )
    print(
        "| ranks | step ms hand / ddplab | **step ratio** | per-epoch ratios (min–max) | mean ms hand / "
        "ddplab "
        "| first step s hand / ddplab | **first-step ratio** | total s hand / ddplab |"
    )
    print("|---" * 8 + "|")
    for r in rows:
        print(
            f"| {r['nproc']} | {r['hand_step_ms']:.2f} / {r['ddplab_step_ms']:.2f} "
            f"| **{r['ddplab_step_ms'] / r['hand_step_ms']:.3f}** "
            f"| {r['paired_min']:.3f}–{r['paired_max']:.3f} "
            f"| {r['hand_mean_ms']:.2f} / {r['ddplab_mean_ms']:.2f} "
            f"| {r['hand_first_s']:.2f} / {r['ddplab_first_s']:.2f} "
            f"| **{r['ddplab_first_s'] / r['hand_first_s']:.3f}** "
            f"| {r['hand_total_s']:.2f} / {r['ddplab_total_s']:.2f} |"
        )


if __name__ == "__main__":
    main()
