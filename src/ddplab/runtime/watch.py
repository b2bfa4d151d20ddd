"""Waits that say what they wait for: a deadline for joins that torch does not bound, and a
watcher that notices a step taking far longer than the steps before it (a peer is hung).

Both are threads: nothing can interrupt a C++ call that does not return, and a rank blocked
in a collective cannot speak for itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from typing import Iterator

log = logging.getLogger("ddplab")

GRACE_S = 5.0  # past distributed.timeout_s, a wait torch itself does not end is ended here
NOTICE_S = 5.0  # a waiting rank says what it waits for after this long, and again as often


# Whether a wait past its deadline may end the process: only where ddplab owns it (train.py, a
# self-launched rank). A library call (``ddplab.run`` from a notebook or a test) never kills its host
# process; there the watcher keeps saying what it waits for until torch's own timeout raises.
_may_exit = False


def own_the_process() -> None:
    global _may_exit
    _may_exit = True


@contextlib.contextmanager
def deadline(what: str, timeout_s: float) -> Iterator[None]:
    """A wait that says what it waits for and never outlives ``timeout_s`` by more than GRACE_S.

    torch's own timeouts do not bound every wait: a TCPStore client retries after its
    timeout (about 2x in all), and a FileStore in a missing directory waits its own 300 s.
    A watcher thread logs the wait every NOTICE_S seconds and, past the deadline, ends the
    process with the reason — nothing else can interrupt a C++ call that does not return.
    """
    done = threading.Event()
    t0 = time.monotonic()

    def watch() -> None:
        while not done.wait(NOTICE_S):
            waited = time.monotonic() - t0
            if waited > timeout_s + GRACE_S and _may_exit:
                sys.stderr.write(f"{what}: gave up after {waited:.0f}s (distributed.timeout_s={timeout_s}). Fix: "
                                 "start every rank with the same WORLD_SIZE and address (MASTER_ADDR/MASTER_PORT "
                                 "or distributed.init_method), or raise distributed.timeout_s\n")
                sys.stderr.flush()
                os._exit(1)
            log.warning("%s: %.0fs so far (gives up after distributed.timeout_s=%s)", what, waited, timeout_s)

    threading.Thread(target=watch, name="ddplab-deadline", daemon=True).start()
    try:
        yield
    finally:
        done.set()


class StallWatch:
    """Says, every NOTICE_S seconds, that a training step has run far longer than usual.

    On a healthy run it never speaks; when a rank hangs, every other rank blocks in that
    step's gradient all-reduce and says so long before ``distributed.timeout_s`` ends the job.
    Per step the trainer only calls :meth:`mark` (two attribute writes: no sync, no collective).
    """

    PATIENCE = 100  # a step this many times longer than the previous one is worth a word

    def __init__(self, rank: int, world_size: int, timeout_s: float):
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.step: int | None = None  # the step now running (None: between epochs, in eval)
        self.since = 0.0
        self.typical = NOTICE_S / self.PATIENCE
        self._done = threading.Event()
        if world_size > 1:  # a single process waits for nobody
            threading.Thread(target=self._watch, name="ddplab-stallwatch", daemon=True).start()

    def mark(self, next_step: int, now: float) -> None:
        """Step ``next_step`` starts at ``now`` (``time.perf_counter()``)."""
        if self.step is not None:
            self.typical = now - self.since
        self.step, self.since = next_step, now

    def pause(self) -> None:
        """Evaluation and checkpoints at the epoch's end are not steps."""
        self.step = None

    def close(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        last = 0.0
        while not self._done.wait(1.0):
            step, since = self.step, self.since
            if step is None:
                continue
            ran = time.perf_counter() - since
            if ran > max(NOTICE_S, self.PATIENCE * self.typical) and time.perf_counter() - last >= NOTICE_S:
                last = time.perf_counter()
                log.warning("rank %d/%d: step %d has run %.0fs (the one before took %.3gs): waiting for another "
                            "rank in a collective? The job fails after distributed.timeout_s=%s, naming the rank(s) "
                            "that never arrived", self.rank, self.world_size, step, ran, self.typical, self.timeout_s)
