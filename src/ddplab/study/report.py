"""The trial's side of a study, inside its job: report the objective at every evaluation, and stop when
the study's pruner says so — decided on rank 0 (the one that talks to the storage), agreed by every rank."""

from __future__ import annotations

import logging
from typing import Any

from ddplab.runtime import collectives
from ddplab.train.callback import Callback
from ddplab.train.state import State

log = logging.getLogger("ddplab")

PRUNED = "pruned by the study's pruner"  # the start of the job's stop reason: the worker tells PRUNED


class ReportToStudy(Callback):
    """``callbacks.study`` of a trial's config (the worker adds it): rank 0 reports ``objective`` after each
    evaluation as the trial's intermediate value at that epoch, asks the pruner, and every rank gets the
    answer; a pruned trial stops after this epoch's checkpoint, like early stopping."""

    training_only = True  # mode=eval of a trial's checkpoint must not report to its finished trial

    def __init__(
        self,
        storage: str,
        study_name: str,
        trial: int,
        objective: str,
        pruner: Any = None,
        timeout_s: float = 20.0,
    ):
        self.url, self.name, self.number, self.objective = storage, study_name, trial, objective
        self.pruner, self.timeout_s = pruner, timeout_s
        self._trial: Any = None

    def setup(self, state: State) -> None:
        if state.dist.rank != 0:
            return
        import optuna
        from hydra.utils import instantiate

        from ddplab import compat
        from ddplab.study.storage import open_storage

        # ddplab's callback builder instantiates nested _target_s: the pruner usually arrives made.
        pruner = instantiate(self.pruner) if isinstance(self.pruner, dict) else self.pruner
        study = optuna.load_study(
            study_name=self.name,
            storage=open_storage(self.url, self.timeout_s),
            pruner=pruner or optuna.pruners.NopPruner(),
        )
        self._trial = compat.optuna_trial(study, self.number)

    def on_eval_end(self, state: State, metrics: dict[str, float]) -> None:
        value = metrics.get(self.objective)
        prune = False
        if self._trial is not None and value is not None:
            try:
                # Optuna's step: the epoch (the pruner's warmup counts epochs), or with eval_every_n_steps the
                # optimizer step (several evaluations an epoch). A resumed one again: Optuna keeps the first.
                at = state.loop.step if state.cfg.get("eval_every_n_steps") else state.loop.epoch
                self._trial.report(float(value), at)
                prune = bool(self._trial.should_prune())
            except Exception as e:  # Optuna's own wrapper hides the cause (a full disk reads "invalid data")
                from ddplab.study.storage import StorageLost, failed

                if not failed(e):
                    raise
                raise StorageLost(self.url, e) from None
        if collectives.broadcast_object(prune, state.dist):
            where = (
                f"step {state.loop.step}"
                if state.cfg.get("eval_every_n_steps")
                else f"epoch {state.loop.epoch}"
            )
            state.request_stop(f"{PRUNED} at {where} ({self.objective}={value:.6g})")
