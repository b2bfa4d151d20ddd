"""Framework overhead: ddplab's trainer against a hand-written DDP loop, same job.

    python scripts/bench_overhead.py                          # CPU (gloo): 1 and 2 ranks
    python scripts/bench_overhead.py --nproc 2 --repeats 5
    python scripts/bench_overhead.py --device cuda --model resnet18 --image-size 224 --amp --channels-last

Both sides train the same model on the same data with the same global batch,
optimizer, schedule and world size. They are launched the same way (plain
``python`` for one rank, ``torchrun --standalone`` for more) and timed the
same way: a global optimizer-step hook stamps every step in rank 0. Runs
alternate (hand, ddplab, ddplab, hand, ...) so drift on a busy machine hits
both sides alike.

The hand-written side is the DDP-tutorial pattern done well: DistributedSampler
+ ``set_epoch``, DDP, autocast (+ GradScaler for fp16), ``reduce_tensor`` of
the loss every log step to a rank-0 SummaryWriter, a per-epoch evaluation
reduced across ranks and a rank-0 ``torch.save`` each epoch. ``--hand-data
loader`` feeds it through a DataLoader (per-sample ``__getitem__`` + collate,
as the tutorials do); ``tensor`` (default, the stricter baseline) indexes
whole batches from tensors already on the device, like ddplab.

ddplab runs the real ``train.py`` with metrics, TensorBoard logging, per-epoch
evaluation and checkpoints on (its defaults).

Reported per side (median over repeats):
  step ms    median time between consecutive optimizer steps within an epoch
  mean ms    their mean (includes the log steps)
  first s    launch (process start) → first optimizer step done
  total s    launch → exit (all epochs, evaluation, checkpoints, teardown)
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
    """Stamps every optimizer step (any optimizer in the process) in rank 0."""

    def __init__(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.stamps: list[float] = []
        self.first_step_s = math.nan
        self.t0 = float(os.environ.get("BENCH_T0", time.time()))
        register_optimizer_step_post_hook(self._hook)

    def _hook(self, *_: object) -> None:
        if not self.stamps:
            self.first_step_s = time.time() - self.t0
        self.stamps.append(time.perf_counter())

    def save(self, path: str) -> None:
        if int(os.environ.get("RANK", 0)) == 0:
            Path(path).write_text(json.dumps({"stamps": self.stamps, "first_step_s": self.first_step_s}))


# ------------------------------------------------------------ the two sides
def ddplab_worker(a: argparse.Namespace, out: str) -> None:
    """Exactly ``python train.py OVERRIDES`` (or its torchrun twin), with the clock installed."""
    clock = StepClock()
    sys.argv = [str(REPO / "train.py"), *ddplab_overrides(a)]
    try:
        runpy.run_path(str(REPO / "train.py"), run_name="__main__")
    finally:
        clock.save(out)


def ddplab_overrides(a: argparse.Namespace) -> list[str]:
    return [f"model={a.model}", "dataset=synthetic", f"dataset.num_train={a.num_train}",
            f"dataset.num_val={a.num_val}", f"dataset.image_size={a.image_size}", "dataset.in_channels=3",
            f"batch_size={a.batch_size}", f"num_epochs={a.epochs}", "log_every_n_steps=10", "progress=none",
            f"amp={str(a.amp).lower()}", f"perf.channels_last={str(a.channels_last).lower()}",
            f"hydra.run.dir={a.workdir}/ddplab", *a.ddplab_args]


def hand_worker(a: argparse.Namespace, out: str) -> None:
    clock = StepClock()
    try:
        hand_loop(a)
    finally:
        clock.save(out)


def hand_loop(a: argparse.Namespace) -> None:
    """What a careful user writes by hand today."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
    from torch.utils.tensorboard import SummaryWriter

    from ddplab.data import synthetic  # the same tensors ddplab's dataset=synthetic makes
    from ddplab.models import ConvNet, resnet18

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    cuda = a.device == "cuda"
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo")

    def reduce_tensor(t: torch.Tensor) -> torch.Tensor:
        if world == 1:
            return t
        rt = t.clone()
        dist.all_reduce(rt)
        return rt / world

    torch.manual_seed(0)
    data = synthetic(num_train=a.num_train, num_val=a.num_val, in_channels=3, image_size=a.image_size)
    if a.model == "convnet":
        model = ConvNet(num_classes=10, in_channels=3)
    else:
        model = resnet18(num_classes=10, in_channels=3, small_input=a.image_size < 64)
    model = model.to(device)
    fmt = torch.channels_last if a.channels_last else torch.contiguous_format
    model = model.to(memory_format=fmt)
    ddp = DDP(model, device_ids=[local] if cuda else None) if world > 1 else model
    per_rank = a.batch_size // world
    steps_per_epoch = a.num_train // a.batch_size
    total = steps_per_epoch * a.epochs
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4, nesterov=True)
    warm = min(20, total - 1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (
        1 + math.cos(math.pi * min((s - warm) / max(total - warm, 1), 1.0))))
    dtype = torch.bfloat16 if (not cuda or torch.cuda.is_bf16_supported()) else torch.float16
    scaler = torch.amp.GradScaler(device.type, enabled=a.amp and dtype == torch.float16)
    writer = SummaryWriter(f"{a.workdir}/hand/tb") if rank == 0 else None

    train_set = TensorDataset(data.train.x, data.train.y)
    sampler = DistributedSampler(train_set, world, rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(train_set, batch_size=per_rank, sampler=sampler, drop_last=True, pin_memory=cuda)
    xs, ys = data.train.x.to(device), data.train.y.to(device)  # the "tensor" path's resident copy
    val_set = TensorDataset(data.val.x, data.val.y)
    val_loader = DataLoader(val_set, batch_size=256, sampler=DistributedSampler(val_set, world, rank, shuffle=False))

    def batches():
        if a.hand_data == "loader":
            for x, y in loader:
                yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        else:
            for idx in torch.tensor(list(sampler)).to(device).split(per_rank):
                if len(idx) == per_rank:
                    yield xs[idx], ys[idx]

    step = 0
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        for x, y in batches():
            x = x.contiguous(memory_format=fmt)
            with torch.autocast(device.type, dtype=dtype, enabled=a.amp):
                loss = F.cross_entropy(ddp(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            sched.step()
            step += 1
            if step % 10 == 0:
                reduced = reduce_tensor(loss.detach())
                if writer:
                    writer.add_scalar("train/loss", reduced.item(), step)
        ddp.eval()
        sums = torch.zeros(3, device=device, dtype=torch.float64)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device).contiguous(memory_format=fmt), y.to(device)
                with torch.autocast(device.type, dtype=dtype, enabled=a.amp):
                    logits = model(x)
                sums += torch.stack([F.cross_entropy(logits.float(), y, reduction="sum").double(),
                                     (logits.argmax(1) == y).sum().double(), torch.tensor(len(y), device=device)])
        if world > 1:
            dist.all_reduce(sums)
        if rank == 0:
            writer.add_scalar("val/loss", (sums[0] / sums[2]).item(), step)
            writer.add_scalar("val/acc", (sums[1] / sums[2]).item(), step)
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch}, f"{a.workdir}/hand/ckpt.pt")
    if writer:
        writer.close()
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


# ------------------------------------------------------------ the driver
def launch(side: str, nproc: int, a: argparse.Namespace, argv: list[str]) -> dict:
    out = Path(a.workdir) / f"{side}.json"
    out.unlink(missing_ok=True)
    me = [str(Path(__file__).resolve()), "--worker", side, "--result", str(out), *argv]
    cmd = [sys.executable, *me] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *me]
    env = {**os.environ, "BENCH_T0": repr(time.time())}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    total = time.perf_counter() - t0
    if proc.returncode != 0 or not out.is_file():
        raise SystemExit(f"{side} run failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
    r = json.loads(out.read_text())
    spe = a.num_train // a.batch_size
    s = r["stamps"]
    # Intervals inside an epoch: the first step of each epoch also pays for the
    # previous epoch's evaluation and checkpoint (reported in total s).
    dts = [(s[k] - s[k - 1]) * 1e3 for k in range(1, len(s)) if k % spe]
    if len(s) != spe * a.epochs:
        raise SystemExit(f"{side}: {len(s)} optimizer steps, expected {spe * a.epochs}")
    return {"step_ms": statistics.median(dts), "mean_ms": statistics.fmean(dts), "first_s": r["first_step_s"],
            "total_s": total}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nproc", type=int, nargs="+", default=[1, 2], help="world sizes to run (default: 1 2)")
    p.add_argument("--repeats", type=int, default=3, help="runs per side and world size, alternating")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model", choices=["convnet", "resnet18"], default="convnet")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--num-train", type=int, default=4096)
    p.add_argument("--num-val", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=64, help="global batch")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--amp", action="store_true", help="autocast: bf16 (fp16 + GradScaler on pre-Ampere GPUs)")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--hand-data", choices=["tensor", "loader"], default="tensor")
    p.add_argument("--ddplab-args", nargs="*", default=[], help="extra train.py overrides for the ddplab side")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--worker", choices=["hand", "ddplab"], help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        (hand_worker if a.worker == "hand" else ddplab_worker)(a, a.result)
        return

    with tempfile.TemporaryDirectory(prefix="ddplab-bench-") as work:
        a.workdir = work
        argv = _drop_option(sys.argv[1:], "--nproc") + ["--workdir", work]
        rows = []
        for nproc in a.nproc:
            if a.batch_size % nproc:
                raise SystemExit(f"--batch-size {a.batch_size} does not split over {nproc} ranks")
            runs: dict[str, list[dict]] = {"hand": [], "ddplab": []}
            for i in range(a.repeats):
                for side in ("hand", "ddplab") if i % 2 == 0 else ("ddplab", "hand"):
                    runs[side].append(launch(side, nproc, a, argv))
                    print(f"nproc={nproc} run {i + 1}/{a.repeats} {side:6s} "
                          + "  ".join(f"{k}={v:.4g}" for k, v in runs[side][-1].items()), flush=True)
            med = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for side, rs in runs.items()}
            # Paired ratios (run i of each side ran back to back): robust to slow drift of the machine.
            paired = sorted(d["step_ms"] / h["step_ms"] for h, d in zip(runs["hand"], runs["ddplab"]))
            rows.append({"nproc": nproc, **{f"{side}_{k}": v for side, m in med.items() for k, v in m.items()},
                         "paired_step_ratio": statistics.median(paired), "paired_min": paired[0],
                         "paired_max": paired[-1],
                         "hand_step_spread": _spread(runs["hand"]), "ddplab_step_spread": _spread(runs["ddplab"])})
    print_table(rows, a)
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=2))


def _spread(runs: list[dict]) -> float:
    """(max - min) / median of the per-run step medians: how noisy the machine was."""
    xs = [r["step_ms"] for r in runs]
    return (max(xs) - min(xs)) / statistics.median(xs)


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

    print(f"\n{a.model}, synthetic 3x{a.image_size}x{a.image_size}, global batch {a.batch_size}, "
          f"{a.num_train // a.batch_size} steps/epoch x {a.epochs} epochs, device {a.device}"
          f"{', amp' if a.amp else ''}{', channels_last' if a.channels_last else ''}, hand data: {a.hand_data}; "
          f"median of {a.repeats} runs each; {platform.processor() or platform.machine()}, {os.cpu_count()} cores\n")
    print("| ranks | step ms hand / ddplab | **step ratio** | paired ratios (min–max) | run-to-run spread "
          "| mean ms hand / ddplab | mean ratio | first step s hand / ddplab | **first-step ratio** "
          "| total s hand / ddplab |")
    print("|---" * 10 + "|")
    for r in rows:
        print(f"| {r['nproc']} | {r['hand_step_ms']:.2f} / {r['ddplab_step_ms']:.2f} "
              f"| **{r['ddplab_step_ms'] / r['hand_step_ms']:.3f}** "
              f"| {r['paired_step_ratio']:.3f} ({r['paired_min']:.3f}–{r['paired_max']:.3f}) "
              f"| {100 * r['hand_step_spread']:.0f}% / {100 * r['ddplab_step_spread']:.0f}% "
              f"| {r['hand_mean_ms']:.2f} / {r['ddplab_mean_ms']:.2f} | {r['ddplab_mean_ms'] / r['hand_mean_ms']:.3f} "
              f"| {r['hand_first_s']:.2f} / {r['ddplab_first_s']:.2f} "
              f"| **{r['ddplab_first_s'] / r['hand_first_s']:.3f}** "
              f"| {r['hand_total_s']:.2f} / {r['ddplab_total_s']:.2f} |")


if __name__ == "__main__":
    main()
