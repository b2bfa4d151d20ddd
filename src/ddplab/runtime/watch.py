"""Waits that say what they wait for: a deadline for joins that torch does not bound, and a
watcher that notices a step taking far longer than the steps before it (a peer is hung).

Both are threads: nothing can interrupt a C++ call that does not return, and a rank blocked
in a collective cannot speak for itself.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import statistics
import sys
import threading
import time
from typing import Any, Iterator

log = logging.getLogger("ddplab")

GRACE_S = 5.0  # past distributed.timeout_s, a wait torch itself does not end is ended here
NOTICE_S = 5.0  # a waiting rank says what it waits for after this long, and again as often
PUBLISH_S = 1.0  # a step this long (and unusually so) is published, so the others can name this rank


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

    def until_next(notices: int) -> float:
        # It wakes for each notice and, where it may end the process, at the deadline itself (waking only
        # for notices, an 8 s timeout ended at 15 s, not by 13).
        due = NOTICE_S * (notices + 1)
        if _may_exit:
            due = min(due, timeout_s + GRACE_S + 0.05)
        return max(0.05, due - (time.monotonic() - t0))

    def watch() -> None:
        notices = 0
        while not done.wait(until_next(notices)):
            waited = time.monotonic() - t0
            if waited > timeout_s + GRACE_S and _may_exit:
                sys.stderr.write(
                    f"{what}: gave up after {waited:.0f}s (distributed.timeout_s={timeout_s}). Fix: "
                    "start every rank with the same WORLD_SIZE and address (MASTER_ADDR/MASTER_PORT "
                    "or distributed.init_method), or raise distributed.timeout_s\n"
                )
                sys.stderr.flush()
                os._exit(1)
            if waited >= NOTICE_S * (notices + 1):
                notices += 1
                log.warning(
                    "%s: %.0fs so far (gives up after distributed.timeout_s=%s)", what, waited, timeout_s
                )

    threading.Thread(target=watch, name="ddplab-deadline", daemon=True).start()
    try:
        yield
    finally:
        done.set()


class StallWatch:
    """Says, every NOTICE_S seconds, that a training step has run far longer than this rank's own
    recent steps — and, if it can know, which ranks have not reached the collective it waits in.

    Judged against this rank's own history, never a guess: the first step (compile, warm-up, the
    first batch) and the first after a pause (evaluation, a checkpoint) set no yardstick, and a run
    whose every step is slow — on every rank alike — has slow steps as its yardstick and stays
    quiet. When it speaks, each suspecting rank publishes where it is (step and phase: data,
    forward, backward, optimizer, log collective) in the rendezvous store and reads the others':
    a rank at an earlier step, or outside the phases that hold a collective, or silent, is named.

    Per step the trainer only calls :meth:`mark` and sets :attr:`phase` (attribute writes and a
    bounded append: no sync, no collective); the judging runs in this watcher's thread.
    """

    PATIENCE = 100  # a step this many times longer than this rank's usual step is worth a word
    PUBLISH_PATIENCE = 10  # ... and this many times longer is published for the other ranks' words
    HISTORY = 8  # the usual step: the median of this many recent ones
    # where a rank blocks on its peers (DDP all-reduces in backward)
    WAITING_PHASES = ("backward", "log collective")

    def __init__(self, rank: int, world_size: int, timeout_s: float, store: Any = None):
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.step: int | None = None  # the step now running (None: between epochs, in eval)
        self.since = 0.0
        self.phase = "data"
        self.recent: collections.deque[float] = collections.deque(maxlen=self.HISTORY)
        self._store = store  # the rendezvous store (None: ranks cannot be named)
        self._done = threading.Event()
        if world_size > 1:  # a single process waits for nobody
            threading.Thread(target=self._watch, name="ddplab-stallwatch", daemon=True).start()

    def mark(self, next_step: int, now: float) -> None:
        """Step ``next_step`` starts at ``now`` (``time.perf_counter()``)."""
        if self.step is not None and self.step > 1:  # step 1 (compile, warm-up) is no yardstick
            self.recent.append(now - self.since)
        self.step, self.since = next_step, now

    def pause(self) -> None:
        """Evaluation and checkpoints are not steps; the next mark starts timing afresh."""
        self.step = None

    def close(self) -> None:
        self._done.set()

    def usual(self) -> float | None:
        """The median of this rank's recent steps (None: no yardstick yet)."""
        if not self.recent:
            return None
        return statistics.median(self.recent)

    def verdict(self, now: float) -> str | None:
        """What to say about the step running at ``now``, or None."""
        step, since, usual = self.step, self.since, self.usual()
        if step is None or usual is None:
            return None
        ran = now - since
        if ran > max(PUBLISH_S, self.PUBLISH_PATIENCE * usual):  # early: the others read it when they speak
            self._publish(step, ran)
        if ran <= max(NOTICE_S, self.PATIENCE * usual):
            return None
        msg = (
            f"rank {self.rank}/{self.world_size}: step {step} has run {ran:.0f}s (its recent steps took "
            f"{usual:.3g}s), now in its {self.phase}"
        )
        late = self._late_ranks(step)
        if late:
            msg += f"; not at that collective: {late}"
        elif self.phase in self.WAITING_PHASES:
            msg += ": waiting for another rank in a collective?"
        return msg + (
            f" (the job fails after distributed.timeout_s={self.timeout_s}, naming the rank(s) that "
            "never arrived)"
        )

    def _publish(self, step: int, ran: float) -> None:
        """Where this rank is, for the others' messages (the store may be gone: then nothing)."""
        if self._store is not None:
            with contextlib.suppress(Exception):
                self._store.set(
                    f"ddplab/stall/{self.rank}", json.dumps({"step": step, "phase": self.phase, "ran": ran})
                )

    def _late_ranks(self, step: int) -> str:
        """The ranks that are not where this one waits ('' when that cannot be known)."""
        if self._store is None:
            return ""
        try:
            late = []
            for r in range(self.world_size):
                if r == self.rank:
                    continue
                key = f"ddplab/stall/{r}"
                if not self._store.check([key]):
                    late.append(f"rank {r} (no word: dead, or stuck where its watcher cannot run)")
                    continue
                where = json.loads(self._store.get(key))
                if where["step"] < step or where["phase"] not in self.WAITING_PHASES:
                    late.append(
                        f"rank {r} (in its {where['phase']} of step {where['step']} for {where['ran']:.0f}s)"
                    )
            return ", ".join(late)
        except Exception:  # the store may be gone (its host died): the plain message still stands
            return ""

    def _watch(self) -> None:
        last = 0.0
        while not self._done.wait(PUBLISH_S / 2):
            now = time.perf_counter()
            msg = self.verdict(now)
            if msg and now - last >= NOTICE_S:
                last = now
                log.warning("%s", msg)


def default_store() -> Any:
    """The process group's rendezvous store, or None (no group, or a torch without the private accessor)."""
    try:
        from ddplab import compat  # torch is imported lazily here: the self-launch parent never needs it

        return compat.default_store()
    except Exception:
        return None
