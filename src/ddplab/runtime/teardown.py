"""The interpreter's teardown, made cheap, and what must outlive its one collection.

After ``torch._dynamo`` is imported (a compile does; torch did at the first ``Optimizer(...)`` before
compat.defer_dynamo), Python spends 0.7-0.9 s of every process's exit (on the 2-core development VM) in
the cyclic collections it runs while tearing its modules down: each walks the millions of objects
torch's modules keep alive, none of which is garbage. A whole one-step job takes 3.5 s; that is a
quarter of it, on every rank and every sweep job.

The process group is held past that collection (group.teardown): freed there by DDP's reducer, its
destructor ran with the GIL held and could wait forever on gloo's worker thread.
"""

from __future__ import annotations

import atexit
import gc
from typing import Any

# What must outlive the exit's collection (hold_past_collection); dropped right after it.
_HELD: list[Any] = []
_COLLECTING_AT_EXIT = False  # cheap_interpreter_exit's handler is registered: it drops _HELD


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
    global _COLLECTING_AT_EXIT
    # once: a rank forked from a server that registered it registers too
    atexit.unregister(_freeze_what_is_left)
    atexit.register(_freeze_what_is_left)
    _COLLECTING_AT_EXIT = True


def hold_past_collection(obj: Any) -> None:
    """Keep ``obj`` until the exit's collection has run (or :func:`drop_held`), then drop it: whatever the
    collection frees then no longer holds the last reference to it. Without cheap_interpreter_exit (ddplab
    as a library), a handler of its own collects, then drops it."""
    if not _HELD and not _COLLECTING_AT_EXIT:
        atexit.unregister(_collect_then_drop)
        atexit.register(_collect_then_drop)
    _HELD.append(obj)


def drop_held() -> None:
    _HELD.clear()


def _collect_then_drop() -> None:
    gc.collect()
    drop_held()


def _freeze_what_is_left() -> None:
    _collect_then_drop()
    gc.freeze()
