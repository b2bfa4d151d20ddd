"""What every tracking server's writer shares (MLflow's, ``ddplab.tracking``; W&B's,
``ddplab.tracking_wandb``): training never waits for the tracker. Every call goes through a queue to one
background thread. A tracker that cannot be reached (down, hanging, failing) is said once, a warning naming
where and why; what it misses waits in order and goes when it is back (tried every ``<name>.retry_s``).
What it still lacks at the end (``<name>.close_timeout_s`` to drain) is said once, with the way to send it
later. A record the tracker refuses (a bad value) is said once and skipped; the rest goes on.

A subclass says how to open its run (``_open``, queued first), how to end it (``_finish``), where it sends
(``_where``), which failures are refusals (``_refused``), and the end line's fix (``_end_fix``); its loop-side
methods only queue (``self._q.put((fn, args))``).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any

from ddplab import redact
from ddplab.writers import NullWriter

log = logging.getLogger("ddplab.tracking")
# records held while the tracker cannot be reached; past it the oldest scalars go (TensorBoard has them)
MAX_BACKLOG = 100_000
_STOP = object()


class BackgroundTracker(NullWriter):
    """Rank 0's run on a tracking server, fed by a background thread (see the module's docstring)."""

    name = "tracker"  # the config group's and the words' prefix; the thread is ddplab-<name>

    def __init__(self, run_dir: Path, close_timeout_s: float, retry_s: float, events: Path | None):
        self.run_dir, self.timeout, self.retry_s = run_dir, close_timeout_s, retry_s
        self.events = events or run_dir / "tb"  # TensorBoard's record: what the tracker missed is read there
        self.log_model = False  # at a FINISHED close: the run's exported model as an artifact
        self._sent: dict[str, int] = {}  # metric -> the last step the tracker's run already holds
        self._q: queue.Queue = queue.Queue()
        self._backlog: collections.deque = collections.deque()  # the thread's: records not delivered yet
        self._down = False  # the tracker cannot be reached: the backlog waits, tried again at _next_try
        self._next_try = 0.0
        self._gap = False  # the backlog overflowed: its oldest scalars are TensorBoard's to send (backfill)
        self._hurried = False  # close's wait shortened by hurry (a stop signal)
        self._said: set[str] = set()  # what was said already: each kind of trouble once a run
        self._thread = threading.Thread(target=self._drain, name=f"ddplab-{self.name}", daemon=True)

    def start(self) -> None:
        """The thread runs; the tracker's run opens first on it."""
        self._thread.start()
        self._q.put((self._open, ()))

    # ---------------------------------------------------------------- the loop's side: never blocks
    @property
    def down(self) -> bool:
        """Whether the tracker could not be reached at the last try (what it misses waits)."""
        return self._down

    def purge_after(self, step: int) -> None:
        """A resume: the steps up to ``step`` that the tracker lacks (a crashed attempt's outage) come from
        TensorBoard's record; the loop sends the rest."""
        self._q.put((self._backfill, (step,)))

    def backfill(self) -> None:
        """Every step of TensorBoard's record that the tracker's run lacks (``python -m ddplab sync``)."""
        self._q.put((self._backfill, (None,)))

    def close(self, status: str = "FINISHED") -> None:
        self._q.put((self._finish, (status,)))
        self._q.put((_STOP, ()))
        self._thread.join(self.timeout)
        self._said.update(("outage", "refused"))  # said after the end, a line would land in the next job's
        stuck = self._thread.is_alive()
        left = self._q.qsize() + len(self._backlog) if stuck else len(self._backlog)
        if stuck:
            self._abandon()
        if left:
            within = (
                f"the {self.timeout:g} s a stop signal left of the launcher's grace"
                if self._hurried
                else f"{self.name}.close_timeout_s={self.timeout:g} s"
            )
            self._say(
                "end",
                "%s: %s did not take the run's last %d record(s) within %s; %s",
                self.name,
                self._where(),
                left,
                within,
                self._end_fix(),
            )

    def drain(self) -> None:
        self.close("FAILED")  # a resume sets it running again

    def hurry(self, seconds: float) -> None:
        if seconds < self.timeout:
            self.timeout, self._hurried = seconds, True
            self.log_model = False  # an upload cut short would leave the tracker's run running for good

    def _say(self, kind: str, msg: str, *args: Any) -> None:
        """A warning about the tracker, once a run for each ``kind`` (an outage, a refused record, the
        end)."""
        if kind not in self._said:
            self._said.add(kind)
            log.warning(msg, *args)

    # ---------------------------------------------------------------- what a tracker says of itself
    def _open(self) -> None:
        raise NotImplementedError

    def _finish(self, status: str) -> None:
        raise NotImplementedError

    def _metrics(self, values: dict[str, float], step: int, ms: int) -> None:
        raise NotImplementedError

    def _where(self) -> str:
        raise NotImplementedError

    def _refused(self, e: Exception) -> bool:
        """The tracker answered and refused this record: retrying cannot help (else: an outage)."""
        return False

    def _end_fix(self) -> str:
        """How the records the tracker did not take at the end reach it later."""
        raise NotImplementedError

    def _abandon(self) -> None:
        """The thread is still in a call at the end (a tracker that hangs): what it holds that would outlive
        the job goes (the thread itself is a daemon)."""

    # ---------------------------------------------------------------- the thread's side
    def _drain(self) -> None:
        while True:
            wait = max(0.0, self._next_try - time.monotonic()) if self._backlog else None
            try:
                fn, args = self._q.get(timeout=wait)
            except queue.Empty:  # time to try the tracker again
                fn, args = None, ()
            if fn is _STOP:  # once more if a try is due: a tracker that failed moments ago is not waited on
                self._deliver()
                return
            if fn is not None:
                self._keep(fn, args)
            self._deliver()

    def _keep(self, fn: Any, args: tuple) -> None:
        self._backlog.append((fn, args))
        if len(self._backlog) > MAX_BACKLOG:  # the oldest scalars go: TensorBoard's record holds them
            oldest = next(i for i, (f, _) in enumerate(self._backlog) if f == self._metrics)
            del self._backlog[oldest]
            self._gap = True

    def _deliver(self) -> None:
        """The backlog, in order, while the tracker takes it; at the first record it cannot reach, an outage
        (tried again in retry_s)."""
        if self._down and time.monotonic() < self._next_try:
            return
        while self._backlog:
            fn, args = self._backlog[0]
            try:
                if self._down and self._gap:  # back after an overflow: the oldest missed steps first
                    self._backfill(None)
                    self._gap = False
                fn(*args)
            except Exception as e:  # noqa: BLE001 - any failure of the tracking side stays on this side
                if not self._refused(e):
                    self._outage(e)
                    return
                if fn == self._open:  # no run to log to: nothing after it can go
                    self._stop_for_good(e)
                    return
                self._say(
                    "refused", "%s: %s refused a record (%s); it is skipped", self.name, self._where(), why(e)
                )
            self._backlog.popleft()
            if self._down:
                self._down = False
                log.info("%s: %s is back; what it missed is being sent", self.name, self._where())

    def _outage(self, e: Exception) -> None:
        self._down, self._next_try = True, time.monotonic() + self.retry_s
        self._say(
            "outage",
            "%s: cannot reach %s (%s); training goes on, and what it misses is sent when it is back "
            "(tried every %s.retry_s=%g s; TensorBoard's record in the run dir is whole)",
            self.name,
            self._where(),
            why(e),
            self.name,
            self.retry_s,
        )

    def _stop_for_good(self, e: Exception) -> None:
        self._say(
            "refused",
            "%s: %s refused the run (%s); its logging stops for this run, TensorBoard's record in the run "
            "dir is whole",
            self.name,
            self._where(),
            why(e),
        )
        self._backlog.clear()
        self._keep = lambda fn, args: None  # type: ignore[method-assign]  # what comes after is dropped

    def _backfill(self, upto: int | None) -> None:
        """The steps of TensorBoard's record (up to ``upto``) the tracker's run lacks, in order."""
        from ddplab.events import missing_steps

        ms = int(time.time() * 1000)
        for step, values in missing_steps(self.events, self._sent, upto):
            self._metrics(values, step, ms)


def why(e: Exception) -> str:
    """An exception in a few words, any URI's password masked (a client's error may quote it)."""
    said = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
    return f"{type(e).__name__}: {redact.text(said)}"
