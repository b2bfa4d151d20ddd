"""Callbacks and a pruner for the study tests (tests/integration/test_study*.py) and verify_resume's, named
by `_target_` (tests/ is on every rank's PYTHONPATH)."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import optuna


class SignalOnce:
    """Rank 0 sends ``sig`` to its own process after optimizer step ``step``, once per test (``marker``):
    the worker of a one-process trial is preempted (SIGTERM) or killed (SIGKILL) mid-trial."""

    def __init__(self, step: int, sig: str, marker: str):
        self.step, self.sig, self.marker = step, getattr(signal, sig), Path(marker)

    def on_step_end(self, state, step):
        if state.dist.rank == 0 and step == self.step and not self.marker.exists():
            self.marker.write_text(json.dumps({"step": step, "pid": os.getpid(), "time": time.time()}))
            os.kill(os.getpid(), self.sig)


class RecordFitEnd:
    """Every rank notes where its training ended: ``<dir>/<trial dir name>-rank<r>.json``."""

    def __init__(self, dir: str):
        self.dir = Path(dir)

    def on_fit_end(self, state, metrics):
        self.dir.mkdir(parents=True, exist_ok=True)
        where = {"step": state.loop.step, "epoch": state.loop.epoch, "pid": os.getpid()}
        (self.dir / f"{state.run_dir.name}-rank{state.dist.rank}.json").write_text(json.dumps(where))


class PruneFrom(optuna.pruners.BasePruner):
    """Prunes trials numbered ``trial`` or later once they have reported epoch ``epoch``: a pruner whose
    decision the test knows in advance."""

    def __init__(self, trial: int = 1, epoch: int = 1):
        self.trial, self.epoch = trial, epoch

    def prune(self, study, trial):
        return trial.number >= self.trial and (trial.last_step or 0) >= self.epoch


class SignalAtFitEnd:
    """Rank 0 sends ``sig`` to its own process (``to="self"``) or to every process of the job (``"job"``: its
    process group, as a scheduler's stop reaches a self-launching worker, its rank server and its ranks) when
    training is over, once per test (``marker``): a stop that arrives after the job's last stop check, while
    the trial is completing."""

    def __init__(self, sig: str, marker: str, to: str = "self"):
        self.sig, self.marker, self.to = getattr(signal, sig), Path(marker), to

    def on_fit_end(self, state, metrics):
        if state.dist.rank == 0 and not self.marker.exists():
            self.marker.write_text("{}")
            if self.to == "job":
                os.killpg(os.getpgid(0), self.sig)
            else:
                os.kill(os.getpid(), self.sig)


class BreakStorage:
    """Rank 0 breaks the SQLite file ``db`` after optimizer step ``step``, once (``step=-1``: as the trial's
    training ends, after its last report, before it is told): fills its (small) file system (``how="full"``),
    makes it and its dir immutable (``"readonly"``: even root cannot write), or deletes it."""

    def __init__(self, step: int, how: str, db: str):
        self.step, self.how, self.db = step, how, Path(db)

    def on_fit_end(self, state, metrics):
        if self.step == -1 and state.dist.rank == 0 and self.db.exists():
            self._break()

    def on_step_end(self, state, step):
        if state.dist.rank != 0 or step != self.step:
            return
        self._break()

    def _break(self):
        if self.how == "full":
            from helpers.disk import fill

            fill(self.db.parent / "filler")
        elif self.how == "readonly":
            subprocess.run(["chattr", "+i", str(self.db), str(self.db.parent)], check=True)
        else:
            self.db.unlink()


class HoldAt:
    """Rank 0 writes ``held`` after optimizer step ``step`` and waits there until ``go`` exists (at most
    ``wait_s``): a trial the test keeps running while another worker looks at the study."""

    def __init__(self, step: int, held: str, go: str, wait_s: float = 240.0):
        self.step, self.held, self.go, self.wait_s = step, Path(held), Path(go), wait_s

    def on_step_end(self, state, step):
        if state.dist.rank != 0 or step != self.step:
            return
        self.held.write_text(str(os.getpid()))
        t0 = time.monotonic()
        while not self.go.exists() and time.monotonic() - t0 < self.wait_s:
            time.sleep(0.05)


class TallySteps:
    """Rank 0 appends "<trial dir name> <step>" to ``file`` after every optimizer step: how often each
    trial's steps were trained, whichever worker trained them."""

    def __init__(self, file: str):
        self.file = Path(file)

    def on_step_end(self, state, step):
        if state.dist.rank == 0:
            with open(self.file, "a") as f:
                f.write(f"{state.run_dir.name} {step}\n")


class KillRankOnce:
    """Rank ``rank`` SIGKILLs its own process after optimizer step ``step``, once per test (``marker``): a
    rank of a trial killed without a word (the OOM killer) while its peers and the worker live on."""

    def __init__(self, rank: int, step: int, marker: str):
        self.rank, self.step, self.marker = rank, step, Path(marker)

    def on_step_end(self, state, step):
        if state.dist.rank == self.rank and step == self.step and not self.marker.exists():
            self.marker.write_text(json.dumps({"step": step, "pid": os.getpid()}))
            os.kill(os.getpid(), signal.SIGKILL)
