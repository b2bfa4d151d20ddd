"""Preemption: SIGTERM, SIGINT and SIGUSR1 ask the job to stop at the next step boundary
that every rank agrees on, checkpoint there and exit with status ``preempted``.

A cluster sends SIGTERM (Kubernetes, SLURM at the end of a job or on preemption,
torchrun forwarding its own SIGTERM), SIGUSR1 (SLURM's ``--signal=USR1@N`` warning
before the time limit; ddplab then requeues the job, see :mod:`.requeue`), SIGUSR2
(submitit's warning) or SIGINT (Ctrl-C). The handler only sets a flag: the trainer
reads it where it already synchronises, so a normal step pays nothing (see
:class:`ddplab.metrics.TrainMetrics`, which carries the flag in the log interval's
one collective). A second signal, a second or more after the first, exits at once
without a checkpoint: the way out when the graceful stop itself is stuck. (Ctrl-C
in a terminal reaches torchrun's workers twice, from the terminal and forwarded
by torchrun, within milliseconds: that pair counts as one.)
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType

log = logging.getLogger("ddplab")

# SIGUSR2: submitit's preemption / time-limit signal (ddplab checkpoints, then hands it on to submitit).
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
_SAME_EVENT_S = 1.0  # repeats closer than this are one event delivered twice


class Preempted(Exception):
    """The job stopped on a signal after checkpointing at ``step`` (the Session records it)."""

    def __init__(self, signal_name: str, step: int, checkpoint: str | None):
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint
        where = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint"
        super().__init__(f"stopped by {signal_name} at step {step} ({where}); run the same command with "
                         "resume=auto to continue")

    @property
    def exit_code(self) -> int:
        """128 + the signal number, as a shell reports a process ended by that signal."""
        return 128 + int(getattr(signal, self.signal_name, signal.SIGTERM))


class StopSignal:
    """Installed for the job's life on the main thread (a no-op elsewhere); restores the old handlers."""

    def __init__(self) -> None:
        self.name: str | None = None  # the first signal's name, once one arrived
        self.at = 0.0  # monotonic time of the first signal
        self._old: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.name is not None

    def install(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)  # type: ignore[arg-type]
        self._old.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.name is None:
            self.name, self.at = name, now
            log.warning("%s received: stopping at the next step boundary all ranks agree on, after a checkpoint "
                        "(send it again to exit at once, without one)", name)
        elif now - self.at >= _SAME_EVENT_S:
            log.error("second signal (%s): exiting now, without a checkpoint", name)
            logging.shutdown()
            os._exit(128 + signum)
