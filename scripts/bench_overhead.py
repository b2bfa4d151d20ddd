"""Framework overhead: ddplab's trainer against a hand-written DDP loop, same job.

    python scripts/bench_overhead.py                          # CPU (gloo): 1 and 2 ranks
    python scripts/bench_overhead.py --nproc 1 --launches 12 --epochs 6 --repeats 9
    python scripts/bench_overhead.py --model mlp --image-size 8   # the overhead-bound path (~1 ms steps)
    python scripts/bench_overhead.py --device cuda --model resnet18 --image-size 224 --amp --channels-last

Both sides train the same model on the same data with the same global batch,
optimizer, schedule and world size, and are timed the same way: a global
optimizer-step hook stamps every step in rank 0.

* Step times: BOTH sides run in the same processes, taking turns one optimizer
  step at a time (scripts/_overhead_pairs.py), so that both see the same
  machine state: on a shared VM, separate processes a few seconds apart differ
  by 5-20 % on their own, and even epochs taken in turns (``--pairing epoch``,
  the earlier design) spread 0.8-1.1 around 1.0. ``--launches`` such processes
  per world size: a process's own memory layout moves the ratio by about
  ±0.5 %, so the launches are the rounds the verdict is asked of.
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
  step ms    median time of a step (a whole loop iteration) within an epoch, its first left out
  mean ms    their mean (includes the log steps)
  first s    launch (process start) → first optimizer step done (median of launches)
  total s    launch → exit of a one-epoch run: evaluation, checkpoint, teardown

and a verdict for each bound (step ratio ≤ 1.0; epoch ratio, the steps' sum with the log steps in,
≤ 1.0; first step ddplab − hand ≤ +0.3 s): a 95 % bootstrap interval of the median over the paired
rounds (launches; epochs with ``--pairing epoch``; launches for the first step), "holds" only where the
whole interval is within the bound, "undecided" where the rounds were too few to beat the noise
(scripts/_bench_stats.py): then run more (``--launches``, ``--repeats``).
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
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_stats import judged  # noqa: E402  (the verdict against a bound, beyond the noise)
from _overhead_hand import HandLoop  # noqa: E402  (the hand-written side, in a module of its own)
from _overhead_pairs import PairedSteps, over_launches, per_epoch, summary  # noqa: E402  (the step-paired mode)


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


def both_sides(a: argparse.Namespace):
    """ddplab's Trainer (composed from the real conf/) and the hand loop, in this process."""
    from hydra import compose, initialize_config_dir

    from ddplab.config import register_configs
    from ddplab.runtime import group
    from ddplab.train.assemble import build_state
    from ddplab.train.loop import Trainer

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=ddplab_overrides(a) + [f"run_dir={a.workdir}/inproc"])
    state = group.init(cfg.distributed)
    return Trainer(build_state(cfg, state, Path(cfg.run_dir))), HandLoop(a, init_process_group=False)


def interleaved_worker(a: argparse.Namespace, out: str) -> None:
    """``--pairing epoch``: both sides in one process per rank, alternating epoch by epoch (hand, ddplab,
    ddplab, hand, ...): the per-step comparison then sees the same machine state, to within a second."""
    from ddplab.runtime import group

    clock = StepClock()
    trainer, hand = both_sides(a)
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


def paired_worker(a: argparse.Namespace, out: str) -> None:
    """``--pairing step`` (default): the two sides take turns one optimizer step at a time
    (scripts/_overhead_pairs.py)."""
    from ddplab.runtime import group

    trainer, hand = both_sides(a)
    pairs = PairedSteps(hand.all_steps(a.epochs))
    for _ in range(a.epochs):
        trainer.train_epoch()
    pairs.finish()
    trainer.state.writer.close()
    hand.close()
    if int(os.environ.get("RANK", 0)) == 0:
        Path(out).write_text(json.dumps({"ms": pairs.ms, "first_step_s": pairs.first_step_s}))
    group.teardown()


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
    steps = a.num_train // a.batch_size * epochs
    counts = [len(x) for x in r["ms"].values()] if "ms" in r else [len(r["stamps"])]
    if counts != [steps * (2 if worker == "interleaved" else 1)] * len(counts):
        raise SystemExit(f"{worker}: {counts} optimizer steps, expected {steps} a side")
    return r, total


def per_step(nproc: int, a: argparse.Namespace, argv: list[str]) -> dict:
    """Step times of both sides in one process per rank, taking turns step by step or epoch by epoch."""
    spe = a.num_train // a.batch_size
    if a.pairing == "step":
        runs = []
        for i in range(a.launches):
            r, _ = launch("paired", nproc, a, argv, a.epochs)
            runs.append(per_epoch(r["ms"], spe))
            ratio = runs[-1]["paired_median"]
            print(f"  nproc={nproc} step-time launch {i + 1}/{a.launches}: ratio {ratio:.3f}", flush=True)
        return over_launches(runs)
    r, _ = launch("interleaved", nproc, a, argv, a.epochs)
    stamps = r["stamps"]
    epochs: dict[str, list[list[float]]] = {"hand": [], "ddplab": []}
    for e in range(len(stamps) // spe):
        block = stamps[e * spe : (e + 1) * spe]
        epochs[block[0][0]].append(step_intervals_ms(block, spe)[block[0][0]])
    return summary(epochs)


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
    medians = {
        f"{side}_{k}": statistics.median(x[j] for x in rs)
        for side, rs in runs.items()
        for j, k in enumerate(("first_s", "total_s"))
    }
    # launch i of each side ran back to back: their difference is one pair's figure
    first = [d[0] - h[0] for h, d in zip(runs["hand"], runs["ddplab"])]
    return {**medians, "first_diffs": first}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--nproc", type=int, nargs="+", default=[1, 2], help="world sizes to run (default: 1 2)")
    p.add_argument("--epochs", type=int, default=8, help="epochs per side in the step-time run")
    p.add_argument(
        "--pairing",
        choices=["step", "epoch"],
        default="step",
        help="step times: the sides take turns a step at a time (default) or an epoch at a time",
    )
    p.add_argument(
        "--launches",
        type=int,
        default=6,
        help="--pairing step: processes per world size, --epochs epochs a side each (the verdict's rounds)",
    )
    p.add_argument(
        "--repeats", type=int, default=5, help="separate-process launches per side (start-up times)"
    )
    p.add_argument("--launch-epochs", type=int, default=1, help="epochs of each start-up run")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model", choices=["convnet", "mlp", "resnet18"], default="convnet")
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
    p.add_argument("--worker", choices=["hand", "ddplab", "interleaved", "paired"], help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    return p


def main() -> None:
    a = _parser().parse_args()
    if a.worker:
        workers = {"hand": hand_worker, "ddplab": ddplab_worker, "interleaved": interleaved_worker}
        {**workers, "paired": paired_worker}[a.worker](a, a.result)
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
        f"step times: {a.epochs} epochs per side, taking turns {a.pairing} by {a.pairing}"
        f"{f', {a.launches} launches (rounds: launches)' if a.pairing == 'step' else ' (rounds: epochs)'}; "
        f"start-up: median of {a.repeats} launches per "
        "side; "
        f"{platform.machine()}, {os.cpu_count()} cores\n"
    )
    print(
        "| ranks | step ms hand / ddplab | **step ratio** | per-round ratios (min–max) | mean ms hand / "
        "ddplab "
        "| first step s hand / ddplab | **first-step ratio** | total s hand / ddplab "
        "| step ratio ≤ 1.0 (95 % interval) | epoch ratio (log steps in) ≤ 1.0 (95 % interval) "
        "| first step ddplab − hand ≤ +0.3 s (95 % interval) |"
    )
    print("|---" * 11 + "|")
    for r in rows:
        print(
            f"| {r['nproc']} | {r['hand_step_ms']:.2f} / {r['ddplab_step_ms']:.2f} "
            f"| **{r['paired_median']:.3f}** "
            f"| {r['paired_min']:.3f}–{r['paired_max']:.3f} "
            f"| {r['hand_mean_ms']:.2f} / {r['ddplab_mean_ms']:.2f} "
            f"| {r['hand_first_s']:.2f} / {r['ddplab_first_s']:.2f} "
            f"| **{r['ddplab_first_s'] / r['hand_first_s']:.3f}** "
            f"| {r['hand_total_s']:.2f} / {r['ddplab_total_s']:.2f} "
            f"| {judged(r['paired'], 1.0)} | {judged(r.get('epoch_ratios', []), 1.0)} "
            f"| {judged(r['first_diffs'], 0.3, '{:+.2f}')} |"
        )


if __name__ == "__main__":
    main()
