"""The stop agreement: when every rank stops together after a preemption signal (or a dead launcher).

A signal reaches one rank, some ranks or all of them, at different moments; the ranks must
still stop at the *same* step, checkpoint it together and leave. They learn of each other's
requests only through a collective, so the agreement is a tiny all-reduce of the stop flag —
held at step boundaries every rank reaches, and spaced in *time*, not in steps:

* log steps already run one collective (``TrainMetrics.reduce``); the flag rides in its row;
* between them, a check falls due about every ``period_s`` seconds of training. The spacing is
  counted in steps, so every rank checks at the same step, and re-derived after each check from
  the slowest rank's measured time per step (a number every rank receives from the same
  collective, so all derive the same count). 10 ms steps: a check every ~100 steps; 4 s steps:
  after every step. A signal is acted on within max(1 step, ~``period_s``) of its arrival, at a
  cost of one tiny collective per ~``period_s`` of training and nothing on the other steps;
* evaluation runs its own cadence over the batches every rank has (a shard may be one short).

A single process needs no agreement: it reads its own flag at every step for free.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from ddplab.runtime import env
from ddplab.runtime.collectives import all_ranks_rows
from ddplab.runtime.group import Dist
from ddplab.runtime.signals import StopSignal

log = logging.getLogger("ddplab")

PERIOD_S = 1.0  # target time between two agreements; the budget is one per ~second
EXIT_MARGIN_S = 5.0  # of the launcher's grace, kept for the exit itself after a tracker's last sends
_MAX_INTERVAL = 1_000_000


class _Cadence:
    """Steps (or eval batches) until the next check, and the time since the last one."""

    def __init__(self) -> None:
        self.interval = 1  # the first check after one step: it measures the step time
        self.left = 1
        self.since = time.perf_counter()
        self.steps = 0

    def restart(self, now: float) -> None:
        self.left, self.since, self.steps = self.interval, now, 0


class StopAgreement:
    """Owns "do all ranks stop here?": ``agreed`` turns true on every rank at the same step."""

    def __init__(self, signal: StopSignal, dist: Dist, period_s: float = PERIOD_S):
        self.signal, self.dist, self.period_s = signal, dist, period_s
        self.alone = not dist.is_distributed
        self.agreed = False
        self.checks = 0  # agreements held outside log steps (what the counting tests budget)
        self._train, self._eval = _Cadence(), _Cadence()
        self.grace_s = env.launcher_grace_s()  # how long a launcher waits for a stopping rank (None: forever)

    @property
    def requested(self) -> bool:
        """This rank was asked to stop (a signal, or its launcher died)."""
        return self.signal.requested

    @property
    def reason(self) -> str:
        return self.signal.reason() or "a signal to another rank"

    def hurry(self, writer: Any, stopped: bool = False) -> None:
        """After a stop signal (this rank's, or a peer's the ranks ``stopped`` on) the launcher's grace bounds
        the job's end (none known: no one kills the job, nothing to hurry): the checkpoint came first, and a
        tracking server still being sent to gets what is left of it but EXIT_MARGIN_S (a dead server otherwise
        held the exit for ``mlflow.close_timeout_s``, past the grace)."""
        if self.grace_s is not None and (stopped or self.signal.requested):
            since = time.monotonic() - self.signal.at if self.signal.requested else 0.0
            writer.hurry(max(1.0, self.grace_s - since - EXIT_MARGIN_S))

    # ----------------------------------------------------------- training steps
    def after_step(self) -> bool:
        """After an optimizer step that is not a log step: True if every rank stops here.

        Per step this is an integer decrement; the collective runs only when a check falls due."""
        return self._tick(self._train)

    def heard_at_log_step(self, any_rank_stops: bool) -> bool:
        """A log step's collective carried every rank's flag: that was this interval's check."""
        self.agreed = self.agreed or any_rank_stops
        c = self._train
        c.restart(time.perf_counter())
        return self.agreed

    # --------------------------------------------------------------- evaluation
    def start_eval(self) -> None:
        self._eval.left, self._eval.since, self._eval.steps = self._eval.interval, time.perf_counter(), 0

    def after_eval_batch(self, index: int, common: int) -> bool:
        """After eval batch ``index`` (0-based); only batches below ``common`` (the fewest any rank
        has) may hold a check, as every rank must reach it."""
        if index >= common and not self.alone:
            return False
        return self._tick(self._eval)

    # ------------------------------------------------------------------ internal
    def _tick(self, c: _Cadence) -> bool:
        """One more step (or batch) of cadence ``c``: a single process reads its own flag; ranks check
        together when the check falls due."""
        if self.alone:
            self.agreed = self.signal.requested
            return self.agreed
        c.steps += 1
        c.left -= 1
        return self._check(c) if c.left <= 0 else False

    def _check(self, c: _Cadence) -> bool:
        now = time.perf_counter()
        row = torch.tensor(
            [float(self.signal.requested), now - c.since], dtype=torch.float64, device=self.dist.device
        )
        rows = all_ranks_rows(row, self.dist).tolist()  # the one tiny collective (and host read) of a check
        self.checks += 1
        self.agreed = self.agreed or any(r[0] > 0 for r in rows)
        per_step = max(r[1] for r in rows) / max(c.steps, 1)  # the slowest rank sets everyone's pace
        # Same numbers on every rank → the same next interval everywhere.
        c.interval = int(
            min(_MAX_INTERVAL, max(1, self.period_s // per_step if per_step > 0 else _MAX_INTERVAL))
        )
        c.restart(time.perf_counter())
        return self.agreed


def slow_save_warning(took: float, grace_s: float | None, what: str) -> None:
    """Say so when a checkpoint took longer than the launcher's grace after its stop signal
    (``runtime.env.launcher_grace_s``): on preemption such a save would be killed half-written."""
    if grace_s is not None and took > grace_s:
        log.warning(
            "%s took %.1fs to write, longer than the %.0fs a launcher waits after its stop signal "
            "(torchrun's close timeout, SLURM's KillWait): a preempted run would be killed before its "
            "checkpoint is written. Fix: a faster file system for the run dir, smaller state, or a longer "
            "grace (SLURM: --signal=USR1@<s> ahead of the time limit)",
            what,
            took,
            grace_s,
        )
