"""Fault injection from inside a job, for scripts/soak.py: one signal, at one phase of one rank.

Importable as ``soak_toy.X`` in every rank (the soak puts tests/ on PYTHONPATH, as helpers.jobs.job_env does).
A job names three parts in its config; they do nothing unless the soak's environment asks:

model._target_=soak_toy.SoakMLP  dataset._target_=soak_toy.soak_digits
+callbacks.soak._target_=soak_toy.SoakCallback

(``dataset._target_=soak_toy.soak_stream``: the same digits as a user's IterableDataset, ddplab's stream path;
``task=lm dataset=tokens dataset._target_=soak_toy.soak_tokens model._target_=soak_toy.SoakGPT``: a token
file.)

Environment (set by the soak driver; the reference run of a config gets none of it, so its config is the
same):

* ``SOAK_DELAY_S`` / ``SOAK_EVAL_DELAY_S``: sleep per training micro-batch forward / per evaluation batch, in
  the processes started before the fault fired (those after it run at full speed);
* ``SOAK_FAULT``: JSON ``{"phase", "k", "rank", "target", "signal", "dir", "fault", "disk", "storage"}``: on
  its ``k``-th call of ``phase`` rank ``rank`` fills the file system of ``disk`` (fault ``disk_full``) or
  deletes the study's ``storage`` (``storage_loss``), and sends ``signal`` (if any) to ``target`` — ``self``,
  ``peer`` (the next rank), ``launcher`` (its parent: torchrun's agent or the self-launching parent) or
  ``all`` (every process of the trial) — once per trial: ``dir/fired``
  is created first (exclusively), so a resumed run never faults again. It records when and at which step.
* ``SOAK_TRIAL_ID``: every process of the trial carries it (how ``all`` and the driver find them).

Phases: ``fetch`` (collating a micro-batch; the driver picks the first micro-batch of a step for "data" and a
later one for "between micro-batches"), ``forward``, ``backward`` (a gradient hook, inside autograd),
``optimizer`` (a step pre-hook), ``evaluation`` (an eval batch's forward inside the epoch-end evaluation) and
``checkpoint`` (the callback's ``state_dict``, called inside ``CheckpointManager.save`` before rank 0 writes
the file)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
from helpers.compare import same  # noqa: F401  (scripts/soak.py compares checkpoints with it)
from helpers.disk import fill
from torch.utils.data import Dataset, IterableDataset, default_collate

from ddplab.callbacks import Callback
from ddplab.data import Splits, digits, token_shards, tokens
from ddplab.models import MLP, TinyGPT


def _rank() -> int:  # srun's tasks: SLURM_PROCID (ddplab reads it; RANK is torchrun's and the self-launch's)
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def trial_pids(trial_id: str, containing: bool = False) -> list[int]:
    """Every live process whose environment carries ``SOAK_TRIAL_ID=trial_id`` (orphans and torchrun's
    workers, which run in sessions of their own, included); ``containing``: an id that contains
    ``trial_id``."""
    key = f"SOAK_TRIAL_ID={trial_id}".encode()
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            entries = (d / "environ").read_bytes().split(b"\0")
            if (
                key in entries
                or containing
                and any(e.startswith(b"SOAK_TRIAL_ID=") and trial_id.encode() in e for e in entries)
            ):
                found.append(int(d.name))
        except OSError:
            continue
    return found


# ------------------------------------------------------------------------ in the job
class _Injector:
    """This process's phase counters and the one fault it may send."""

    def __init__(self) -> None:
        spec = os.environ.get("SOAK_FAULT")
        self.spec: dict[str, Any] | None = json.loads(spec) if spec else None
        if self.spec is not None and self.spec["rank"] != _rank():
            self.spec = None  # another rank's fault
        self.calls: dict[str, int] = {}
        self.state: Any = None  # the job's State, set by SoakCallback.setup: the step a fault lands at
        self.in_eval = False

    def wants(self, phase: str) -> bool:
        return self.spec is not None and self.spec["phase"] == phase

    def tick(self, phase: str) -> None:
        if not self.wants(phase):
            return
        self.calls[phase] = n = self.calls.get(phase, 0) + 1
        if n == self.spec["k"]:
            self.fire()

    def fire(self) -> None:
        spec = self.spec
        try:  # once per trial, whichever attempt and rank gets here first
            fd = os.open(Path(spec["dir"]) / "fired", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return
        targets = self._targets(spec["target"]) if spec["signal"] else []
        step = self.state.loop.step if self.state is not None else -1
        run_dir = str(self.state.run_dir) if self.state is not None else None
        record = {
            "time": time.time(),
            "step": step,
            "pid": os.getpid(),
            "targets": targets,
            "phase": spec["phase"],
            "run_dir": run_dir,
        }
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(record))
        # tracking=mlflow, server=killed: the tracking server dies with the fault, for good
        if spec.get("server"):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(spec["server"], signal.SIGKILL)
        if spec.get("fault") == "disk_full":  # the run dir's file system fills up (the driver frees it after)
            fill(Path(spec["disk"]) / "soak-filler")
        elif spec.get("fault") == "storage_loss":  # the study's database is gone from under its workers
            Path(spec["storage"]).unlink()
        if not spec["signal"]:
            return
        sig = getattr(signal, spec["signal"])
        others = [str(p) for p in targets if p != os.getpid()]
        if spec["target"] == "all" and others:  # from a process of its own, as SLURM's step daemon signals a
            # job: a rank's loader workers take a SIGTERM their own rank sends as its order to end
            subprocess.run(
                ["kill", "-s", spec["signal"].removeprefix("SIG"), *others],
                check=False,
                stderr=subprocess.DEVNULL,
            )  # one gone already: kill says so, and signals the rest
            targets = [os.getpid()] if os.getpid() in targets else []
        for pid in sorted(targets, key=lambda p: p == os.getpid()):  # itself last: SIGKILL ends it here
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def _targets(self, target: str) -> list[int]:
        if target == "self":
            return [os.getpid()]
        # under srun: srun itself (the rank's parent is SLURM's slurmstepd, a daemon's)
        if target == "launcher":
            if "SLURM_STEP_ID" in os.environ:
                return [p for p in trial_pids(os.environ["SOAK_TRIAL_ID"]) if _comm(p) == "srun"]
            # the process the user started: torchrun's agent, the self-launch parent (its ranks' parent is the
            # fork server it started, which ignores stop signals by design: not a process anyone signals)
            from ddplab.runtime import env

            return [env.launcher_pid() or os.getppid()]
        if target == "peer":  # the next rank (of 2: the other one)
            world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "2")))
            return [int((Path(self.spec["dir"]) / f"pid.{(_rank() + 1) % world}").read_text())]
        return trial_pids(os.environ["SOAK_TRIAL_ID"])  # "all"


_INJ: _Injector | None = None


def injector() -> _Injector:
    global _INJ
    if _INJ is None:
        _INJ = _Injector()
    return _INJ


def _fault_fired() -> bool:
    """The trial's fault has fired already (its ``fired`` marker exists)."""
    spec = os.environ.get("SOAK_FAULT")
    return bool(spec) and (Path(json.loads(spec)["dir"]) / "fired").exists()


def _sleep_around(seconds: float, phase: str) -> None:
    """Half the delay, the phase's tick, the other half: a signal sent to another process lands mid-phase."""
    if seconds:
        time.sleep(seconds / 2)
    injector().tick(phase)
    if seconds:
        time.sleep(seconds / 2)


class _Soaked:
    """A model whose training forward sleeps ``SOAK_DELAY_S`` (an evaluation batch ``SOAK_EVAL_DELAY_S``), and
    ticks the forward / backward / evaluation phases: mixed into a ddplab model."""

    def __init__(self, **kw: Any):
        super().__init__(**kw)
        # The delays shape where the one fault lands (a signal meeting a long step, a write in flight). A
        # process whose model is built after the fault fired (a resume, a restarted worker, verify_resume's
        # later legs) meets no fault: it runs at full speed, since sleeping changes none of what the soak
        # compares.
        slow = not _fault_fired()
        self.delay_s = float(os.environ.get("SOAK_DELAY_S", "0")) * slow
        self.eval_delay_s = float(os.environ.get("SOAK_EVAL_DELAY_S", "0")) * slow

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inj = injector()
        if not self.training:
            if inj.in_eval:  # the epoch-end evaluation, not the FLOP count's one forward
                _sleep_around(self.eval_delay_s, "evaluation")
            return super().forward(x)
        _sleep_around(self.delay_s, "forward")
        out = super().forward(x)
        if inj.wants("backward") and out.requires_grad:
            out.register_hook(lambda g: inj.tick("backward"))  # runs inside loss.backward()
        return out


class SoakMLP(_Soaked, MLP):
    """The digits' MLP, soaked."""


class SoakGPT(_Soaked, TinyGPT):
    """task=lm's TinyGPT, soaked."""


class _Samples(Dataset):
    """A plain map-style view of a TensorData: the trainer then batches it through a DataLoader (and
    ``_collate``), where a fetch can be ticked, instead of indexing a whole batch on the device."""

    def __init__(self, data: Any):
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Any:
        return self.data[i]


def _collate(samples: list[Any]) -> Any:
    injector().tick("fetch")
    return default_collate(samples)


def soak_digits(**kw: Any) -> Splits:
    """digits, its training split served per sample through a DataLoader (validation stays in memory)."""
    s = digits(**kw)
    return Splits(_Samples(s.train), s.val, s.num_classes, _collate)


def soak_stream(**kw: Any) -> Splits:
    """digits' training split as a user's IterableDataset (tests/toy.py's, with its position as state), read
    through ddplab's stream path; each rank's slice of a micro-batch is collated (a fetch) through
    ``_collate``."""
    from toy import StatefulDigitStream

    s = digits(**kw)
    return Splits(
        StatefulDigitStream(s.train.x, s.train.y, kw.get("split_seed", 0)), s.val, s.num_classes, _collate
    )


def soak_tokens(**kw: Any) -> Splits:
    """dataset=tokens (a token file read a window at a time), each micro-batch collated through
    ``_collate``."""
    s = tokens(**kw)
    return Splits(s.train, s.val, s.num_classes, _collate)


def soak_shards(**kw: Any) -> Splits:
    """dataset=token_shards (a folder of token files streamed shard by shard), collated through
    ``_collate``."""
    s = token_shards(**kw)
    return Splits(s.train, s.val, s.num_classes, _collate)


def soak_hf(**kw: Any) -> Splits:
    """dataset=hf (local JSONL text through a BPE tokenizer; ``streaming=true``: read row by row), each
    micro-batch collated through ``_collate``."""
    from ddplab.data.hf import hf

    s = hf(**kw)
    # held in memory it is a TensorData, which the trainer indexes a batch at a time on the device (no fetch
    # to fault): served per sample through a DataLoader instead, as soak_digits does
    train = s.train if isinstance(s.train, IterableDataset) else _Samples(s.train)
    return Splits(train, s.val, s.num_classes, _collate)


class SoakCallback(Callback):
    """Ticks the optimizer-step and checkpoint phases, marks the evaluation, and notes this rank's pid for a
    peer's ``peer`` fault. Checkpointed (as ``callbacks.soak``) so that ``state_dict`` runs in every save."""

    def setup(self, state: Any) -> None:
        inj = injector()
        inj.state = state
        soak_dir = os.environ.get("SOAK_DIR")
        if soak_dir:
            (Path(soak_dir) / f"pid.{_rank()}").write_text(str(os.getpid()))
        if inj.wants("optimizer"):
            state.optimizer.register_step_pre_hook(lambda *_: inj.tick("optimizer"))
        evaluate = state.evaluator.evaluate

        def evaluating(*args: Any, **kw: Any) -> Any:
            inj.in_eval = True
            try:
                return evaluate(*args, **kw)
            finally:
                inj.in_eval = False

        state.evaluator.evaluate = evaluating

    def state_dict(self) -> dict[str, Any]:
        injector().tick("checkpoint")
        return {"version": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
