"""Jobs as processes the tests signal and watch: started in their own session (logs to a file), waited
for, their descendants and ranks read from /proc."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from helpers import jobs
from helpers.proctree import children


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


def ranks_of(run: Path, pid: int) -> dict[int, int]:
    """{rank: pid} of the job under ``pid`` that runs in ``run``, as its provenance.json records them (rank 0
    writes it once every rank is up). Not /proc's environ or command line: a rank forked from the job server
    (helpers/spares.py) shows the server's there, not what it would have been exec'd with. Each one checked
    to be a process under ``pid``: the record is this job's."""
    import json

    ranks = {r["rank"]: r["pid"] for r in json.loads((run / "provenance.json").read_text())["world"]["ranks"]}
    under = set(children(pid))
    assert set(ranks.values()) <= under, (ranks, sorted(under))
    return ranks
