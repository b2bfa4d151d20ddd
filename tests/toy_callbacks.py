"""tests/toy.py's callbacks: a user's callbacks that record hooks and checkpoint stalls, signal or kill the
job at chosen points, slow the disk under the checkpoints, load each save, fail on one rank, or die mid-write.
Named by `_target_=toy.X` (toy.py re-exports them)."""

import gc
import os
import resource
import signal
import subprocess
import time
from pathlib import Path

import torch
from toy_disks import (  # noqa: F401  (toy_callbacks.<name> in the tests' overrides)
    HELD,
    DiesMidWrite,
    DiskHeldForTwoSteps,
    FillsDiskAtFitEnd,
    LoadsEachSave,
    SlowDisk,
    _DyingFile,
    saves_seen,
)
from toy_models import _rank

RECORDED: list[tuple[str, int]] = []  # (hook, loop step) per Recorder call, in order (in-process runs)
UNSET_AT_SETUP: list[list[str]] = []  # per Recorder setup: the State's fields that were None then


class Recorder:
    """A user's callback (not a ddplab.callbacks.Callback subclass: duck typing is enough) that records
    every hook it receives."""

    def _note(self, hook, state):
        RECORDED.append((hook, state.loop.step))

    def setup(self, state):
        from dataclasses import fields

        UNSET_AT_SETUP.append([f.name for f in fields(state) if getattr(state, f.name) is None])
        self._note("setup", state)

    def on_fit_start(self, state):
        self._note("on_fit_start", state)

    def on_step_end(self, state, step):
        self._note("on_step_end", state)

    def on_log(self, state, values, step):
        self._note("on_log", state)

    def on_eval_end(self, state, metrics):
        self._note("on_eval_end", state)

    def on_save(self, state, path):
        self._note("on_save", state)

    def on_load(self, state, path):
        self._note("on_load", state)

    def on_exception(self, state, exc):
        self._note("on_exception", state)

    def on_fit_end(self, state, metrics):
        self._note("on_fit_end", state)


class TrainingOnlyRecorder(Recorder):
    """A Recorder that serves training only (like a study trial's reporter): mode=eval leaves it out."""

    training_only = True

    def _note(self, hook, state):
        RECORDED.append((f"training_only.{hook}", state.loop.step))


class SignalJobAtLastSave:
    """Rank 0 sends SIGINT to every process of the job (a Ctrl-C in the terminal) right after the last
    checkpoint of the run, noting the time in ``stamp``: too late to stop anything, the job completes."""

    def __init__(self, last: int, stamp: str):
        self.last, self.stamp = last, stamp

    def on_save(self, state, path):
        if _rank() == 0 and state.loop.step == self.last and not os.path.exists(self.stamp):
            with open(self.stamp, "w") as f:
                f.write(repr(time.time()))
            os.killpg(os.getpgid(0), signal.SIGINT)


class KillLauncherAtFitEnd:
    """Rank 0 SIGKILLs its launcher (torchrun's agent) once training is over, and waits to be re-parented:
    the job then completes with no launcher (as when the agent dies during the last steps)."""

    def on_fit_end(self, state, metrics):
        if _rank() == 0:
            parent = os.getppid()
            os.kill(parent, signal.SIGKILL)
            t0 = time.monotonic()
            while os.getppid() == parent and time.monotonic() - t0 < 10:
                time.sleep(0.05)


STALLS: list[tuple[int, float]] = []  # (step, seconds the loop paused) per checkpoint, in-process runs


class StallRecorder:
    """Records how long each checkpoint held the loop (the manager's ``last_stall_s``)."""

    def on_save(self, state, path):
        STALLS.append((state.loop.step, state.checkpoints.last_stall_s))


class FailsOnRank:
    """A user's callback with a bug that shows on one rank only: ``rank`` raises after optimizer step
    ``step``."""

    def __init__(self, rank: int = 1, step: int = 3):
        self.rank, self.step = rank, step

    def on_step_end(self, state, step):
        if step == self.step and state.dist.rank == self.rank:
            raise RuntimeError(f"FailsOnRank: a callback's own bug on rank {self.rank} at step {step}")


class SignalWhenResumed:
    """Rank 0 of a run that resumed (its first step is not step 1) sends ``sig`` to its own process after step
    ``step``: a stop from outside that only a resumed run meets (verify_resume's third run)."""

    def __init__(self, sig: str, step: int):
        import signal

        self.sig, self.step, self.first = getattr(signal, sig), step, None

    def on_step_end(self, state, step):
        import os

        self.first = step if self.first is None else self.first
        if state.dist.rank == 0 and step == self.step and self.first > 1:
            os.kill(os.getpid(), self.sig)


class SignalAtStep:
    """Rank 0 sends ``sig`` to its own process after step ``step`` (a stop from outside, in-process too)."""

    def __init__(self, sig: str, step: int):
        import signal

        self.sig, self.step = getattr(signal, sig), step

    def on_step_end(self, state, step):
        import os

        if state.dist.rank == 0 and step == self.step:
            os.kill(os.getpid(), self.sig)


class SignalParentToo:
    """Rank 0 sends ``sig`` to its parent and to itself after step ``step``, once per test (``marker``):
    Ctrl-C in a terminal, which reaches every process of the foreground job (verify_resume and its leg)."""

    def __init__(self, sig: str, step: int, marker: str):
        import signal
        from pathlib import Path

        self.sig, self.step, self.marker = getattr(signal, sig), step, Path(marker)

    def on_step_end(self, state, step):
        import os

        if state.dist.rank == 0 and step == self.step and not self.marker.exists():
            self.marker.write_text(str(step))
            os.kill(os.getppid(), self.sig)
            os.kill(os.getpid(), self.sig)


class InfGradAtStep:
    """Makes the first parameter's gradient inf in the backward of optimizer step ``step`` (1-based): a
    step fp16's GradScaler must skip, as it does at the start of most fp16 runs (its first scale, 65536,
    overflows), here on purpose and on any model."""

    def __init__(self, step: int = 1):
        self.step = step

    def setup(self, state):
        def hook(grad):
            return torch.full_like(grad, float("inf")) if state.loop.step + 1 == self.step else grad

        state.params[0].register_hook(hook)


LOADED: list[dict] = []  # per OptimizerStateOnLoad.on_load: where the resumed run's state lives


class OptimizerStateOnLoad:
    """Records, as a resume loads, the devices of the optimizer's step counts and of its moments."""

    def on_load(self, state, path):
        opt = [v for v in state.optimizer.state.values() if "step" in v]
        LOADED.append(
            {"step": {str(v["step"].device) for v in opt}, "exp_avg": {str(v["exp_avg"].device) for v in opt}}
        )


class NotesTheFreeze:
    """Writes ``<dir>/frozen-rank<r>`` when the process's exit freezes its heap (ddplab.runtime.teardown),
    with the number of objects frozen: ``gc.freeze`` is wrapped at the run's end, so only the exit's call is
    seen."""

    def __init__(self, dir: str):
        self.dir = dir

    def on_fit_end(self, state, metrics):
        freeze, path = gc.freeze, os.path.join(self.dir, f"frozen-rank{_rank()}")

        def noted():
            freeze()
            with open(path, "w") as f:
                f.write(str(gc.get_freeze_count()))

        gc.freeze = noted


class CountsPageFaults:
    """Writes ``<dir>/faults-rank<r>``: the page faults this rank's process took per optimizer step, from step
    ``first`` to step ``last`` (after the warm-up steps that build the heap)."""

    def __init__(self, dir: str, first: int = 10, last: int = 40):
        self.dir, self.first, self.last, self.at = dir, first, last, {}

    def on_step_end(self, state, step):
        if step in (self.first, self.last):
            self.at[step] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        if step == self.last:
            with open(os.path.join(self.dir, f"faults-rank{_rank()}"), "w") as f:
                f.write(str((self.at[self.last] - self.at[self.first]) / (self.last - self.first)))


class Uploader:
    """A user's callback that uploads with a token from the config (``+callbacks.up.token=...``)."""

    def __init__(self, token: str):
        self.token = token

    def on_fit_end(self, state, metrics):
        assert self.token.startswith("T0ken")  # the job itself gets the real value


class LeavesAWriterBehind:
    """At the fit's end, starts a process of its own session that holds the job's stdout and writes to it 2 s
    later, after the job has exited: a reader of the job's output to its end (``communicate()``) waits for
    it."""

    def on_fit_end(self, state, metrics):
        subprocess.Popen(["sh", "-c", "sleep 2; echo written-after-the-job-exited"], start_new_session=True)


class NotesItsProcess:
    """Adds, per rank and job, a line to ``{out}/rank{rank}``: this process's command line, a tab, its
    parent's (a self-launch's rank server: ``-c from multiprocessing.forkserver ...`` where it is a fresh
    one)."""

    def __init__(self, out: str):
        self.out = out

    def setup(self, state):
        own, parent = (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().replace("\n", " ")
            for pid in (os.getpid(), os.getppid())
        )
        with open(Path(self.out, f"rank{state.dist.rank}"), "a") as f:
            f.write(f"{own}\t{parent}\n")
