"""Where a job's start-up goes: one process of ``python train.py`` (the default digits job, one optimizer
step), profiled, split into the phases a user waits through before the first step, and its plain wall time.

    python scripts/bench_startup.py                 # 5 plain launches + 1 profiled, one process
    python scripts/bench_startup.py --repeats 9 -- model=resnet18 dataset=synthetic
    python scripts/bench_startup.py --vs-hand --nproc 1 2 --repeats 7   # whole processes against a hand loop

The split comes from cProfile's cumulative times (the profiler adds its own overhead, so the phases sum to
more than the plain wall time; read them as shares).

``--vs-hand``: ddplab's fixed cost as whole processes, launch to exit: ``train.py`` (the default job, one
step) against ``scripts/_hand_default_job.py`` (the same job written by hand: the same digits reader, model,
process group and TensorBoard writer opened before its first step, one evaluation, a checkpoint), launched
alike (``python`` for one rank, ``torchrun --standalone`` for more), alternating, median of ``--repeats``,
and whether ddplab − hand ≤ +0.3 s holds beyond the noise (scripts/_bench_stats.py: a bootstrap interval of
the paired launches' median difference).
"""

from __future__ import annotations

import argparse
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_stats import judged  # noqa: E402  (the verdict against a bound, beyond the noise)

JOB = ["num_epochs=1", "limit_train_steps=1", "progress=none", "log_every_n_steps=1"]

# phase -> (a pattern of the profiled function, what it is). Each is a cumulative time inside the run.
PHASES = {
    "hydra: compose the config (twice: Hydra's get_mode, then run)": (
        "hydra/_internal/hydra.py:*(compose_config)"
    ),
    "ddplab: session (process group, run dir, lock, provenance)": "ddplab/session.py:*(__enter__)",
    "ddplab: dataset": "ddplab/build.py:*(train_data)",
    "ddplab: model built, prepared and wrapped": "ddplab/build.py:*(model)",
    "ddplab: optimizer, schedule": "ddplab/optim.py:*(make_optimizer)",
    "ddplab: checkpoints registered, resume looked for": "ddplab/train/resuming.py:*(resume)",
    "ddplab: first words (config, HParams, charts to TensorBoard)": "ddplab/train/reporting.py:*(announce)",
    "ddplab: the first step (incl. its checks)": "ddplab/train/first_step.py:*(__call__)",
    "ddplab: the whole State (build_state: parts, setup, resume)": "ddplab/train/assemble.py:*(build_state)",
    "ddplab: the Session's end (result.json, process group torn down)": "ddplab/session.py:*(__exit__)",
    "hydra + ddplab: the whole job function": "hydra/core/utils.py:*(run_job)",
}


def cumulative(stats: pstats.Stats, pattern: str) -> float:
    """Summed cumulative seconds of the functions whose 'file:line(name)' matches ``pattern`` (fnmatch)."""
    from fnmatch import fnmatch

    total = 0.0
    for (file, line, name), (_, _, _, cum, _) in stats.stats.items():  # type: ignore[attr-defined]
        if fnmatch(f"{file}:{line}({name})", "*" + pattern):
            total += cum
    return total


def wall(cmd: list[str], cwd: Path) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def vs_hand(nprocs: list[int], repeats: int, work: Path) -> None:
    """Launch → exit of ddplab's default job and the hand-written one, alternating; medians and the
    difference."""
    print(
        "| ranks | hand s (median) | ddplab s (median) | **ddplab − hand s** | launches a side | failed, "
        "rerun (hand / ddplab) | ddplab − hand ≤ +0.3 s (95 % interval of the paired launches) |"
        "\n|---|---|---|---|---|---|---|"
    )
    for n in nprocs:
        launch = (
            [sys.executable]
            if n == 1
            else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]
        )
        times: dict[str, list[float]] = {"hand": [], "ddplab": []}
        failed = {"hand": 0, "ddplab": 0}
        for i in range(repeats):
            for side in ("hand", "ddplab") if i % 2 == 0 else ("ddplab", "hand"):
                for attempt in range(3):  # a failed launch is rerun (and counted): its time measures nothing
                    out = work / f"{side}-{n}-{i}-{attempt}"
                    out.mkdir()
                    cmd = (
                        [
                            *launch,
                            str(REPO / "scripts" / "_hand_default_job.py"),
                            "--steps",
                            "1",
                            "--out",
                            str(out),
                        ]
                        if side == "hand"
                        else [*launch, str(REPO / "train.py"), *JOB, f"hydra.run.dir={out}"]
                    )
                    try:
                        times[side].append(wall(cmd, work))
                        break
                    except SystemExit as e:
                        failed[side] += 1
                        if attempt == 2:
                            raise
                        print(
                            f"<!-- {side} launch failed, rerun: {str(e).splitlines()[0][:200]} -->",
                            flush=True,
                        )
        hand, ours = statistics.median(times["hand"]), statistics.median(times["ddplab"])
        pairs = [d - h for h, d in zip(times["hand"], times["ddplab"])]  # launch i of each ran back to back
        print(
            f"| {n} | {hand:.2f} | {ours:.2f} | **{ours - hand:+.2f}** | {repeats} | {failed['hand']} / "
            f"{failed['ddplab']} | {judged(pairs, 0.3, '{:+.2f}')} |",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="plain launches timed (median)")
    ap.add_argument("--vs-hand", action="store_true", help="whole processes against a hand-written loop")
    ap.add_argument("--nproc", type=int, nargs="+", default=[1, 2], help="with --vs-hand: the world sizes")
    ap.add_argument("overrides", nargs="*", help="train.py overrides after --")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ddplab-startup-"))
    if a.vs_hand:
        vs_hand(a.nproc, a.repeats, work)
        return
    args = [*JOB, *a.overrides]
    plain = [
        wall([sys.executable, str(REPO / "train.py"), *args, f"hydra.run.dir={work}/plain{i}"], work)
        for i in range(a.repeats)
    ]
    imports = [wall([sys.executable, "-c", "import torch, hydra, omegaconf"], work) for _ in range(a.repeats)]
    prof = work / "train.prof"
    wall(
        [
            sys.executable,
            "-m",
            "cProfile",
            "-o",
            str(prof),
            str(REPO / "train.py"),
            *args,
            f"hydra.run.dir={work}/profiled",
        ],
        work,
    )
    stats = pstats.Stats(str(prof))
    total = max(s[3] for s in stats.stats.values())  # type: ignore[attr-defined]
    print(
        f"python train.py {' '.join(args)}: median wall {statistics.median(plain):.2f} s over {a.repeats} "
        f"launches (min {min(plain):.2f}, max {max(plain):.2f}); python -c 'import torch, hydra, omegaconf': "
        f"median {statistics.median(imports):.2f} s\n"
    )
    print("| phase (profiled run) | s | share |\n|---|---|---|")
    print(f"| the whole process, profiled | {total:.2f} | 100 % |")
    for what, pattern in PHASES.items():
        t = cumulative(stats, pattern)
        print(f"| {what} | {t:.2f} | {100 * t / total:.0f} % |")


if __name__ == "__main__":
    main()
