"""A user's callbacks that meet a disk: one that fills it, slow or dying writes, a reader of each save
(re-exported by toy_callbacks, where the tests' overrides name them)."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import torch
from toy_models import _rank

HELD: list[tuple[str, bool]] = []  # (step file, let go by the loop rather than by the clock), in-process runs


class FillsDiskAtFitEnd:
    """Rank 0 fills the file system of ``disk`` once training is over: the last checkpoint is written, the
    job's record (result.json) is not (the soak's seed 4908357: the disk filled as the last save ended)."""

    def __init__(self, disk: str):
        self.disk = disk

    def on_fit_end(self, state, metrics):
        if _rank() == 0:
            from helpers.disk import fill

            fill(Path(self.disk) / "filler")


class SlowDisk:
    """A slow file system under the checkpoints: every step file takes ``delay_s`` longer to write.
    ``signal_at``: rank 0 sends ``signal`` as that step's file starts being written (the write is then in
    flight, in the background with checkpoint.async_save): to its whole process group (``to="group"``, what
    SLURM does) or to its launcher only (``to="launcher"``: torchrun's agent, its parent). ``note``: a file
    the signal's wall time is written to (a test measures from the signal, not from the process's start)."""

    def __init__(
        self,
        delay_s: float = 0.0,
        signal_at: int = 0,
        signal: str = "SIGTERM",
        to: str = "group",
        note: str = "",
    ):
        self.delay_s, self.signal_at, self.signal, self.to, self.note = delay_s, signal_at, signal, to, note
        self._real = None

    def setup(self, state):
        from ddplab.checkpoint import files

        real = self._real = files.save_atomic

        def slow(obj, path):
            if self.signal_at and path.name == f"step-{self.signal_at:08d}.pt":
                sig = getattr(signal, self.signal)
                if self.note:
                    Path(self.note).write_text(repr(time.time()))
                os.kill(os.getppid(), sig) if self.to == "launcher" else os.killpg(os.getpgid(0), sig)
            time.sleep(self.delay_s)
            real(obj, path)

        files.save_atomic = slow  # files.save looks it up at each call

    def _restore(self):  # an in-process run leaves the next one a normal disk
        from ddplab.checkpoint import files

        if self._real is not None:
            files.save_atomic, self._real = self._real, None

    def on_fit_end(self, state, metrics):
        self._restore()

    def on_exception(self, state, exc):
        self._restore()


class DiskHeldForTwoSteps(SlowDisk):
    """A disk that holds the write of each step file in ``steps`` until the loop has taken two more optimizer
    steps, or ``wait_s`` went by: a write running beside the loop is let go by the loop; one the loop waits
    for (a synchronous save) only by the clock. HELD records which, per file."""

    def __init__(self, steps=(), wait_s: float = 60.0):
        super().__init__()
        self.steps, self.wait_s, self._reached, self._lock = set(steps), wait_s, {}, threading.Lock()

    def _reached_step(self, step):
        with self._lock:  # the loop's thread and the writer's both ask
            return self._reached.setdefault(step, threading.Event())

    def setup(self, state):
        from ddplab.checkpoint import files

        real = self._real = files.save_atomic

        def held(obj, path):
            named = re.fullmatch(r"step-(\d+)\.pt", path.name)
            if named and int(named[1]) in self.steps:
                HELD.append((path.name, self._reached_step(int(named[1]) + 2).wait(self.wait_s)))
            real(obj, path)

        files.save_atomic = held

    def on_step_end(self, state, step):
        self._reached_step(state.loop.step).set()


class LoadsEachSave:
    """A user's on_save that uploads each checkpoint: it opens ``path`` with torch.load and appends
    "<loop step now> <the file's loop step>" (or the error's type) to ``<record>-rank<r>.txt``."""

    def __init__(self, record: str):
        self.record = record

    def on_save(self, state, path):
        try:
            got = str(torch.load(path, map_location="cpu", weights_only=True)["loop"]["step"])
        except Exception as e:
            got = type(e).__name__
        with open(f"{self.record}-rank{_rank()}.txt", "a") as f:
            f.write(f"{state.loop.step} {got}\n")


def saves_seen(record: str, rank: int = 0) -> list[tuple[int, str]]:
    """LoadsEachSave's record of one rank: (loop step when on_save fired, the file's step or the error)."""
    with open(f"{record}-rank{rank}.txt") as f:
        return [(int(a), b) for a, b in (line.split() for line in f)]


class _DyingFile:
    """What torch.save writes through, for DiesMidWrite: after ``after_bytes`` the bytes so far are flushed,
    noted, and the process is SIGKILLed — from inside torch.save, on whatever thread writes."""

    def __init__(self, f, after_bytes: int, note: str):
        self.f, self.after, self.note, self.written = f, after_bytes, note, 0

    def write(self, data):
        n = self.f.write(data)
        self.written += len(data)
        if self.written >= self.after:
            self.f.flush()
            inner = self.f
            while not hasattr(inner, "fileno"):  # ddplab's own wrapper around the open file
                inner = inner.f
            inner.flush()
            os.fsync(inner.fileno())
            import threading

            with open(self.note, "w") as out:
                out.write(f"{threading.current_thread().name} {inner.name} {os.path.getsize(inner.name)}")
            os.kill(os.getpid(), signal.SIGKILL)
        return n

    def flush(self):
        self.f.flush()


class DiesMidWrite:
    """The process dies by SIGKILL inside the real checkpoint writer's torch.save, once ``after_bytes`` of
    step ``at``'s checkpoint are on disk. ``note`` gets "<thread> <file being written> <its size>" just
    before."""

    def __init__(self, at: int, note: str, after_bytes: int = 65536):
        self.at, self.note, self.after = at, note, after_bytes

    def setup(self, state):
        real = torch.save

        def save(obj, f, *a, **k):
            loop = obj.get("loop") if isinstance(obj, dict) else None
            if isinstance(loop, dict) and loop.get("step") == self.at:
                f = _DyingFile(f, self.after, self.note)
            return real(obj, f, *a, **k)

        torch.save = save
