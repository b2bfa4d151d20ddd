"""The interpreter's teardown, made cheap.

After ``torch._dynamo`` is imported (a compile does; torch did at the first ``Optimizer(...)`` before
compat.defer_dynamo), Python spends 0.7-0.9 s of every process's exit (on the 2-core development VM) in
the cyclic collections it runs while tearing its modules down: each walks the millions of objects
torch's modules keep alive, none of which is garbage. A whole one-step job takes 3.5 s; that is a
quarter of it, on every rank and every sweep job.
"""

from __future__ import annotations

import atexit
import gc


def cheap_interpreter_exit() -> None:
    """Call first thing in a process (atexit runs its handlers last-registered first, so this one runs
    after every other, torch's, logging's and multiprocessing's included): at exit, collect once as usual,
    then freeze what is left, so the teardown's collections skip it. Called later (a spawned rank), it runs
    before the handlers registered earlier; what they then make is collected as usual.

    What had become garbage is finalized as in a plain interpreter: the one collection runs the ``__del__``
    of objects that only a reference cycle holds (a user's writer that flushes there). What the teardown
    itself frees goes by reference count as before; only the cycles that tearing the modules down leaves
    are not collected, which Python does not promise to finalize at exit anyway, and the operating
    system reclaims them with the process.
    """
    # once: a rank forked from a server that registered it registers too
    atexit.unregister(_freeze_what_is_left)
    atexit.register(_freeze_what_is_left)


def _freeze_what_is_left() -> None:
    gc.collect()
    gc.freeze()
