"""What a tracker costs the training loop: the same ``train.py`` job with TensorBoard alone, and with W&B
beside it in a given state, launched alternately; the loop's own time (result.json's ``time_s``: fit,
evaluations and checkpoints included, start-up and the tracker's end excluded) compared pair by pair.

    python scripts/bench_trackers.py                       # W&B that cannot start vs TensorBoard alone
    python scripts/bench_trackers.py --wandb offline --rounds 7
    python scripts/bench_trackers.py -- model=convnet num_epochs=20

``--wandb down`` (default): a key, and a W&B server that never answers (a closed loopback port): the start
fails after ``wandb.init_timeout_s`` and the run is logged offline; ``offline``: no key, W&B logs to its files
from the start. Reported: the median loop time of each side, and whether "W&B costs the loop < 1 s in total"
(with - without) holds beyond the noise (scripts/_bench_stats.py: a bootstrap interval of the paired rounds'
median difference).
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


def loop_seconds(run_dir: Path, tracker: bool, state: str, job: list[str]) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["NETRC"] = str(run_dir.parent / "no.netrc")
    env["WANDB_DATA_DIR"] = env["WANDB_CACHE_DIR"] = env["WANDB_CONFIG_DIR"] = str(run_dir.parent / "home")
    if state == "down":
        env["WANDB_API_KEY"] = "k" * 40
        env["WANDB_BASE_URL"] = f"http://127.0.0.1:{closed_port()}"
    logger = ["logger=[tensorboard,wandb]", "wandb.init_timeout_s=5"] if tracker else ["logger=[tensorboard]"]
    cmd = [sys.executable, str(REPO / "train.py"), *job, *logger, f"run_dir={run_dir}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=run_dir.parent)
    if proc.returncode != 0:
        raise SystemExit(f"failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return float(json.loads((run_dir / "result.json").read_text())["metrics"]["time_s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wandb", choices=["down", "offline"], default="down")
    p.add_argument("--rounds", type=int, default=5, help="launches per side (default 5)")
    p.add_argument("job", nargs="*", help="train.py overrides (default: " + " ".join(JOB) + ")")
    a = p.parse_args()
    job = a.job or JOB
    times: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="ddplab-bench-") as work:
        for i in range(a.rounds):
            for tracker in (False, True) if i % 2 == 0 else (True, False):
                t = loop_seconds(Path(work) / f"r{i}-{int(tracker)}", tracker, a.wandb, job)
                times[tracker].append(t)
                side = f"wandb {a.wandb}" if tracker else "tensorboard"
                print(f"round {i + 1}/{a.rounds} {side:14s} {t:.2f} s", flush=True)
    diffs = [w - t for t, w in zip(times[False], times[True])]
    print(
        f"\n| job | W&B | loop s TensorBoard / + W&B (median of {a.rounds}) | with − without | "
        "< 1 s (95 % interval) |\n|---|---|---|---|---|\n"
        f"| {' '.join(job)} | {a.wandb} | {statistics.median(times[False]):.2f} / "
        f"{statistics.median(times[True]):.2f} | {statistics.median(diffs):+.2f} s | "
        f"{judged(diffs, 1.0, '{:+.2f}')} |"
    )


if __name__ == "__main__":
    main()
