"""What a tracker costs the training loop: the same ``train.py`` job with TensorBoard alone, and with W&B
beside it in a given state, launched alternately; the loop's own time (result.json's ``time_s``: fit,
evaluations and checkpoints included, start-up and the tracker's end excluded) compared pair by pair.

    python scripts/bench_trackers.py                       # W&B that cannot start vs TensorBoard alone
    python scripts/bench_trackers.py --wandb offline --rounds 7
    python scripts/bench_trackers.py --against offline     # W&B that cannot start vs W&B that can (offline)
    python scripts/bench_trackers.py --threads 1           # training leaves a core free
    python scripts/bench_trackers.py -- model=convnet num_epochs=20

``--wandb down`` (default): a key, and a W&B server that never answers (a closed loopback port): the start
fails after ``wandb.init_timeout_s`` and the run is logged offline; ``offline``: no key, W&B logs to its files
from the start. ``--against``: the other side, TensorBoard alone (``none``, default) or W&B offline
(``offline``: what the outage itself costs, W&B's own cost set aside). Reported: the median loop time of
each side, and whether the difference stays < 1 s beyond the noise (scripts/_bench_stats.py: a bootstrap
interval of the paired rounds' median difference).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_stats import judged  # noqa: E402  (the verdict against a bound, beyond the noise)

JOB = ["model=mlp", "num_epochs=300", "progress=none"]  # 6,600 steps, ~11 s: W&B's whole start falls inside


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loop_seconds(run_dir: Path, state: str, job: list[str], threads: int | None) -> float:
    """The loop's seconds of one ``train.py`` run with W&B in ``state`` (none: TensorBoard alone)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["NETRC"] = str(run_dir.parent / "no.netrc")
    if (
        threads
    ):  # training's intra-op threads: fewer than the cores leaves one to the rest, as on a GPU machine
        env["OMP_NUM_THREADS"] = str(threads)
    env["WANDB_DATA_DIR"] = env["WANDB_CACHE_DIR"] = env["WANDB_CONFIG_DIR"] = str(run_dir.parent / "home")
    if state == "down":
        env["WANDB_API_KEY"] = "k" * 40
        env["WANDB_BASE_URL"] = f"http://127.0.0.1:{closed_port()}"
    logger = (
        ["logger=[tensorboard]"]
        if state == "none"
        else ["logger=[tensorboard,wandb]", "wandb.init_timeout_s=5"]
    )
    cmd = [sys.executable, str(REPO / "train.py"), *job, *logger, f"run_dir={run_dir}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=run_dir.parent)
    if proc.returncode != 0:
        raise SystemExit(f"failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return float(json.loads((run_dir / "result.json").read_text())["metrics"]["time_s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wandb", choices=["down", "offline"], default="down")
    p.add_argument("--against", choices=["none", "offline"], default="none", help="the other side")
    p.add_argument("--rounds", type=int, default=5, help="launches per side (default 5)")
    p.add_argument(
        "--threads", type=int, help="training's intra-op threads (OMP_NUM_THREADS; default: torch's)"
    )
    p.add_argument("job", nargs="*", help="train.py overrides (default: " + " ".join(JOB) + ")")
    a = p.parse_args()
    job = a.job or JOB
    sides = (a.against, a.wandb)
    times: dict[str, list[float]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory(prefix="ddplab-bench-") as work:
        for i in range(a.rounds):
            for k, side in enumerate(sides if i % 2 == 0 else sides[::-1]):
                t = loop_seconds(Path(work) / f"r{i}-{k}", side, job, a.threads)
                times[side].append(t)
                print(f"round {i + 1}/{a.rounds} W&B {side:8s} {t:.2f} s", flush=True)
    diffs = [w - t for t, w in zip(times[a.against], times[a.wandb])]
    print(
        f"\n| job | W&B / against | loop s (median of {a.rounds}) | difference | "
        "< 1 s (95 % interval) |\n|---|---|---|---|---|\n"
        f"| {' '.join(job)} | {a.wandb} / {a.against} | {statistics.median(times[a.wandb]):.2f} / "
        f"{statistics.median(times[a.against]):.2f} | {statistics.median(diffs):+.2f} s | "
        f"{judged(diffs, 1.0, '{:+.2f}')} |"
    )


if __name__ == "__main__":
    main()
