"""The callbacks ddplab ships (``ema``, ``early_stopping``, ``profiler``, ``samples``), and the names a user's
own callback imports: ``from ddplab.callbacks import Callback``.

The hook protocol belongs to the loop: what a callback is and receives, :mod:`ddplab.train.callback`; where
each hook fires, :mod:`ddplab.train.hooks`. The callbacks here stand on the loop as a user's do.
"""

from ddplab.train.callback import Callback
from ddplab.train.hooks import HOOKS, Callbacks, Hook

__all__ = ["HOOKS", "Callback", "Callbacks", "Hook"]
