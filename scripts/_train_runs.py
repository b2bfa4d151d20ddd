"""Shared by the throughput scripts: run train.py once, read its training throughput back."""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def train_throughput(cmd: list[str], run_dir: Path) -> float:
    """Run ``cmd + [hydra.run.dir=run_dir]`` (a train.py command line); return the median
    ``vitals/samples_per_s`` over its log intervals, the first one left out as warm-up."""
    sys.path.insert(0, str(REPO / "src"))
    from ddplab.events import read_scalars

    proc = subprocess.run(
        [*cmd, f"hydra.run.dir={run_dir}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    if proc.returncode:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stdout[-3000:]}")
    values = [v for _, v in read_scalars(run_dir / "tb")["vitals/samples_per_s"]][1:]
    return statistics.median(values)
