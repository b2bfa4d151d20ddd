"""What a job's console says, ddplab's lines only."""

from __future__ import annotations


def ddplab_lines(out: str) -> list[str]:
    """What ddplab and Hydra printed, without torchrun's own failure summary (its E/W log lines, its
    ChildFailedError traceback and the ==== block), which no rank can shorten."""
    keep, in_summary = [], False
    for line in out.splitlines():
        if line.startswith(("E1", "W1", "I1")) or line.startswith("*****") or "OMP_NUM_THREADS" in line:
            continue
        if line.startswith("Traceback") and "torch/distributed/run.py" in out.split(line, 1)[1][:400]:
            in_summary = True
        if not in_summary and line.strip():
            keep.append(line)
    return keep
