"""The hook protocol: code that runs at a few points of a job, from the ``callbacks`` config group.

    python train.py 'callbacks=[ema,early_stopping]' callbacks.ema.decay=0.998

Each entry of ``cfg.callbacks`` is a ``_target_`` (ddplab's or a user's own class, named
from a yaml in their own config dir) made once per job. Every hook is optional; the
trainer calls only the hooks a callback overrides (:class:`ddplab.train.hooks.Hook` shows where each fires).
Hooks get the job's :class:`ddplab.train.state.State` (``state.module``, ``.optimizer``, ``.loop``,
``.results``, ``.dist``, ``.run_dir``, ``.evaluator``, ``.strategy``, ``.writer``), never the Trainer:

* ``setup(state)`` — the parts exist, nothing resumed yet;
* ``on_fit_start(state)``;
* ``on_step_end(state, step)`` — after EVERY optimizer step: keep it on the device
  (no ``.item()``, no collective), or say otherwise in the callback's docstring;
* ``on_log(state, values, step)`` — each log step, with the reduced values (the same on every rank);
* ``on_eval_end(state, metrics) -> dict | None`` — after each evaluation; returns extra metrics
  to log and record (``objective`` may name those listed in ``logged_names``);
* ``on_save(state, path)`` / ``on_load(state, path)`` — once a checkpoint is on disk (it loads) / after a
  load; with ``checkpoint.async_save`` on_save comes at the next save, the stop's or the run's end;
* ``on_exception(state, exc)``; ``on_fit_end(state, metrics)``.

A callback with ``state_dict()``/``load_state_dict()`` is checkpointed as entry
``callbacks.<name>`` by the CheckpointManager and restored on resume. To stop training,
call ``state.request_stop(reason)`` (all ranks must decide alike: decide from reduced values).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ddplab.train.state import State


class Callback:
    """The base of every callback (optional: any object with some of these methods works); each hook a
    no-op."""

    logged_names: tuple[str, ...] = ()  # metric tags it logs, e.g. ("val_ema/acc",)
    # mode=eval evaluates with the callbacks the run trained with (EMA's val_ema/* is part of its evaluation);
    # one that only serves training (a study trial's reporter, which would report to a finished trial) says
    # so.
    training_only: bool = False

    def setup(self, state: State) -> None: ...
    def on_fit_start(self, state: State) -> None: ...
    def on_step_end(self, state: State, step: int) -> None: ...
    def on_log(self, state: State, values: dict[str, float], step: int) -> None: ...
    def on_eval_end(self, state: State, metrics: dict[str, float]) -> dict[str, float] | None: ...
    def on_save(self, state: State, path: str) -> None: ...
    def on_load(self, state: State, path: str) -> None: ...
    def on_exception(self, state: State, exc: BaseException) -> None: ...
    def on_fit_end(self, state: State, metrics: dict[str, float]) -> None: ...
