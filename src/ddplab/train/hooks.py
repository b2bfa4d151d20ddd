"""Where a job's callbacks are called: :class:`Hook` (each point of the loop) and :class:`Callbacks` (the
job's callbacks; per hook, those that implement it). What a callback is: :mod:`ddplab.train.callback`."""

from __future__ import annotations

import enum
from typing import Any


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


def _overrides(cb: Any, hook: str) -> bool:
    """Whether ``cb``'s class has its own ``hook``, not only the no-op of
    :class:`ddplab.train.callback.Callback` (named here, not imported: the base class's hooks take the State,
    and the State holds a :class:`Callbacks`)."""
    mine = getattr(type(cb), hook, None)
    base = (getattr(mine, "__module__", ""), getattr(mine, "__qualname__", ""))
    return mine is not None and base != ("ddplab.train.callback", f"Callback.{hook}")


class Callbacks:
    """The job's callbacks by name, and per hook the list of those that implement it."""

    def __init__(self, named: dict[str, Any]):
        self.named = named
        self.hooks = {Hook(h): [getattr(cb, h) for cb in named.values() if _overrides(cb, h)] for h in HOOKS}

    def __call__(self, hook: Hook, *args: Any) -> list[Any]:
        return [fn(*args) for fn in self.hooks[hook]]

    def stateful(self) -> dict[str, Any]:
        return {
            f"callbacks.{name}": cb
            for name, cb in self.named.items()
            if hasattr(cb, "state_dict") and hasattr(cb, "load_state_dict")
        }

    def logged_names(self) -> list[str]:
        return [n for cb in self.named.values() for n in getattr(cb, "logged_names", ())]

    def describe(self) -> list[str]:
        return list(self.named)
