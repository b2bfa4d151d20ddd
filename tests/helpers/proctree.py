"""A job's process tree from /proc: its descendants (a launcher's ranks in sessions of their own too), and
what to do with a job that hung: say where each of its processes is, then end them all."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path


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


def stacks_then_kill(pid: int) -> str:
    """Every Python and native stack of ``pid`` and its descendants (py-spy's, from the dev extra; a line
    saying it is missing otherwise), then SIGKILL to each of them. Killing only the job's process group
    leaves torchrun's ranks (each in a session of its own) running, holding the job's pipes, and a hang's
    report said nothing about where it hung."""
    procs = [pid, *children(pid)]  # before any is killed: an orphan's parent is no longer the job
    spy = shutil.which("py-spy")
    said = []
    for p in procs:
        if spy is None:
            said.append(f"pid {p}: py-spy is not installed (pip install -e '.[dev]'): no stack")
            continue
        try:
            dump = subprocess.run(
                [spy, "dump", "--native", "--pid", str(p)], capture_output=True, text=True, timeout=30
            )
            text = dump.stdout or dump.stderr
        except subprocess.TimeoutExpired:
            text = "py-spy took over 30 s"
        # the frames of code without symbols are addresses only
        said.append("\n".join(ln for ln in text.splitlines() if not ln.strip().startswith("0x")))
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    return "\n".join(said)
