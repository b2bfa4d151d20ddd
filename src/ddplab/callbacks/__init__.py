"""Callbacks: code that runs at a few points of a job, from the ``callbacks`` config group.

    python train.py 'callbacks=[ema,early_stopping]' callbacks.ema.decay=0.998

Each entry of ``cfg.callbacks`` is a ``_target_`` (ddplab's or a user's own class, named
from a yaml in their own config dir) made once per job. Every hook is optional; the
trainer calls only the hooks a callback overrides (:class:`Hook` shows where each fires).
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

import enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddplab.train.state import State


class Hook(str, enum.Enum):
    """Where a callback's hooks fire, as the loop runs (``ddplab.train.loop``); each value is the method name.

    .. code-block:: text

        build the parts (model, optimizer, data, strategy)
        SETUP(state)                                  # parts exist; nothing resumed yet
        resume from a checkpoint                      -> ON_LOAD(state, path)
        ON_FIT_START(state)
        for each epoch:
            for each optimizer step:
                micro-batches: forward, backward; optimizer step
                ON_STEP_END(state, step)              # EVERY step: device work only, no sync
                every log_every_n_steps: one collective -> ON_LOG(state, values, step)
                a checkpoint falls due                -> ON_SAVE(state, path)
            evaluation (exact, all ranks)             -> ON_EVAL_END(state, metrics) -> extra metrics
            the epoch's checkpoint                    -> ON_SAVE(state, path)
            (async_save: each ON_SAVE once that file is on disk: the next save, a stop's, or the end below)
        ON_FIT_END(state, metrics)
        any exception on the way                      -> ON_EXCEPTION(state, exc), then it propagates
        (a preemption too: every rank's checkpoint, ON_SAVE, then ON_EXCEPTION with ``Preempted``)
    """

    SETUP = "setup"
    ON_FIT_START = "on_fit_start"
    ON_STEP_END = "on_step_end"
    ON_LOG = "on_log"
    ON_EVAL_END = "on_eval_end"
    ON_SAVE = "on_save"
    ON_LOAD = "on_load"
    ON_EXCEPTION = "on_exception"
    ON_FIT_END = "on_fit_end"


HOOKS = tuple(h.value for h in Hook)


class Callback:
    logged_names: tuple[str, ...] = ()  # metric tags it logs, e.g. ("val_ema/acc",)
    # mode=eval evaluates with the callbacks the run trained with (EMA's val_ema/* is part of its evaluation);
    # one that only serves training (a study trial's reporter, which would report to a finished trial) says so.
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


def _overrides(cb: Any, hook: str) -> bool:
    mine = getattr(type(cb), hook, None)
    return mine is not None and mine is not getattr(Callback, hook, None)


class Callbacks:
    """The job's callbacks by name, and per hook the list of those that implement it."""

    def __init__(self, named: dict[str, Any]):
        self.named = named
        self.hooks = {Hook(h): [getattr(cb, h) for cb in named.values() if _overrides(cb, h)] for h in HOOKS}

    def __call__(self, hook: Hook, *args: Any) -> list[Any]:
        return [fn(*args) for fn in self.hooks[hook]]

    def stateful(self) -> dict[str, Any]:
        return {f"callbacks.{name}": cb for name, cb in self.named.items()
                if hasattr(cb, "state_dict") and hasattr(cb, "load_state_dict")}

    def logged_names(self) -> list[str]:
        return [n for cb in self.named.values() for n in getattr(cb, "logged_names", ())]

    def describe(self) -> list[str]:
        return list(self.named)
