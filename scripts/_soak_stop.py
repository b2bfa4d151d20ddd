"""A soak stopped (SIGTERM: a CI timeout; SIGINT: a user's Ctrl-C) starts nothing more and ends what it
started."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time

from soak_driver import kill
from soak_toy import trial_pids

STOP_SCAN_S = 30.0  # the longest a stop goes on looking for processes to kill
STOPPING = threading.Event()  # set by the stop: the driver reports no trial it cut short and starts no other


def end_everything_when_stopped() -> None:
    """On SIGTERM or SIGINT: every trial's and reference's processes and the MLflow servers (in sessions of
    their own, they would outlive the driver) are killed, found by the id in their environment: this run's pid
    is in each (``soak-<pid>-...``; the servers get ``soak-<pid>-servers`` from this process's environment,
    which the jobs' leave out). The trials' threads go on meanwhile (a killed attempt is followed by a resume,
    a failed trial by the next), so from the signal on they start no process at all, and the scan ends only
    after three in a row found none (a process started just before the signal is seen once it has exec'd)."""
    me = os.getpid()
    os.environ["SOAK_TRIAL_ID"] = f"soak-{me}-servers"
    popen_init = subprocess.Popen.__init__

    def refused_once_stopping(self, *args, **kwargs) -> None:
        # the stop's own: run
        if STOPPING.is_set() and threading.current_thread() is not threading.main_thread():
            raise RuntimeError("the soak was stopped: its trials start no more processes")
        popen_init(self, *args, **kwargs)

    def stop(signum: int, _frame) -> None:
        STOPPING.set()
        quiet, deadline = 0, time.monotonic() + STOP_SCAN_S
        while quiet < 3 and time.monotonic() < deadline:
            left = [p for p in trial_pids(f"-{me}-", containing=True) if p != me]
            kill(left)
            quiet = 0 if left else quiet + 1
            time.sleep(0.1)
        if shutil.which("squeue"):  # a killed srun's allocation outlives it (as run_attempt's scancel says)
            jobs = subprocess.run(
                ["squeue", "-h", "-o", "%i %j"], capture_output=True, text=True
            ).stdout.split("\n")
            ids = [line.split()[0] for line in jobs if f"-{me}-" in line]
            if ids:
                subprocess.run(["scancel", *ids], capture_output=True)
        os._exit(128 + signum)  # the trials' threads would otherwise wait for their processes

    subprocess.Popen.__init__ = refused_once_stopping
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
