"""Jobs as processes the tests signal and watch: started in their own session (logs to a file), waited
for, their descendants and ranks read from /proc."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

from helpers import jobs


def start(cmd: list[str], cwd: Path, log: Path, fresh: bool = False) -> subprocess.Popen:
    """Start in its own session (so a kill reaches torchrun's workers too), output to ``log``; forked from the
    job server where it allows (helpers.jobs.start), a real interpreter where ``fresh``."""
    with open(log, "w") as out:
        return jobs.start(cmd, cwd, out, subprocess.STDOUT, fresh=fresh)


def wait_for(path: Path, proc: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    t0 = time.monotonic()
    while not path.exists():
        if proc.poll() is not None or time.monotonic() - t0 > timeout:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"{path} never appeared (exit {proc.poll()})\n{log.read_text()[-4000:]}")
        time.sleep(0.02)


def finish(proc: subprocess.Popen, log: Path, timeout: float = 60) -> float:
    """Seconds until the process exits."""
    t0 = time.monotonic()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"still running {timeout}s after the signal\n{log.read_text()[-4000:]}")
    return time.monotonic() - t0


def children(pid: int) -> list[int]:
    """All descendants of ``pid`` (from /proc)."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int(re.search(r"^PPid:\s+(\d+)", (d / "status").read_text(), re.M).group(1))
            except (OSError, AttributeError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def ranks_of(pid: int) -> dict[int, int]:
    """{RANK: pid} of the training ranks under ``pid`` (from their environment)."""
    ranks = {}
    for p in children(pid):
        env = dict(kv.split("=", 1) for kv in Path(f"/proc/{p}/environ").read_text().split("\0") if "=" in kv)
        if "RANK" in env:
            ranks[int(env["RANK"])] = p
    return ranks
