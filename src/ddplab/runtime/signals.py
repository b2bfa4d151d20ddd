"""Preemption: SIGTERM, SIGINT and SIGUSR1 ask the job to stop at the next step boundary
that every rank agrees on, checkpoint there and exit with status ``preempted``.

A cluster sends SIGTERM (Kubernetes, SLURM at the end of a job or on preemption,
torchrun forwarding its own SIGTERM), SIGUSR1 (SLURM's ``--signal=USR1@N`` warning
before the time limit; ddplab then requeues the job, see :mod:`.requeue`), SIGUSR2
(submitit's warning) or SIGINT (Ctrl-C). The handler only sets a flag: the trainer
reads it where it already synchronises, so a normal step pays nothing (see
:class:`ddplab.train.metrics.TrainMetrics`, which carries the flag in the log interval's
one collective). A second signal, a second or more after the first, exits at once
without a checkpoint: the way out when the graceful stop itself is stuck. (Ctrl-C
in a terminal reaches torchrun's workers twice, from the terminal and forwarded
by torchrun, within milliseconds: that pair counts as one.)
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType

from ddplab.runtime import env

log = logging.getLogger("ddplab")

# SIGUSR2: submitit's preemption / time-limit signal (ddplab checkpoints, then hands it on to submitit).
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
_SAME_EVENT_S = 1.0  # repeats closer than this are one event delivered twice
LAUNCHER_POLL_S = 1.0  # how often a rank looks whether its launcher is still alive


_EARLY: list[tuple[str, float]] = []  # (name, monotonic time) of a signal that came during start-up
_EARLY_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def hold_during_startup() -> None:
    """train.py's first call, before torch and Hydra load (seconds): a SIGTERM, SIGUSR1 or SIGUSR2 that
    arrives during start-up is remembered, and the job stops at its first step boundary with a checkpoint.
    SLURM's time-limit warning can come seconds after a (re)start; the signals' default action would kill
    the process before the job's handler exists, and the job would fail instead of being requeued. Only
    where that default is still in place (submitit's own handler stays); Ctrl-C keeps stopping at once."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in _EARLY_SIGNALS:
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, _remember)


_FOR_LIFE: list[bool] = []  # set by hold_for_life: the hold outlives each job (a study worker's jobs)


def hold_for_life() -> None:
    """A study worker's call: between its jobs, and after each job's handler is gone, a stop signal is
    remembered too (not fatal), and :func:`held` tells the worker to take no further trial. A signal that
    reached a job after its last stop check (the job completed) is handed on the same way."""
    _FOR_LIFE[:] = [True]
    hold_during_startup()


def end_hold_for_life(acted: bool = False) -> None:
    """The study worker's last call: its hold ends with it. A program that ran the worker in-process (a
    notebook, a test, a sweep's next job) gets the signals' default back. A held signal the worker ``acted``
    on (it stopped) is spent; one it did not (it came as the study ended) stays held, for the next job to stop
    at its first step."""
    _FOR_LIFE.clear()
    if acted:
        _EARLY.clear()
    if threading.current_thread() is threading.main_thread():
        for sig in _EARLY_SIGNALS:
            if signal.getsignal(sig) is _remember:
                signal.signal(sig, signal.SIG_DFL)


def held() -> str | None:
    """The name of a stop signal remembered while no job's handler was installed (or handed on by one)."""
    return _EARLY[0][0] if _EARLY else None


def hand_on(name: str, at: float | None = None) -> None:
    """A stop signal that reached a job after its last stop check (the job completed), from whatever took it:
    the job's own handler, or torch's launch agent in a self-launching parent. A study worker takes no further
    trial. ``at``: when it arrived (monotonic), where known: a repeat within a second of it is the same
    event."""
    if _FOR_LIFE and not _EARLY:
        _EARLY.append((name, time.monotonic() if at is None else at))


def _remember(signum: int, frame: FrameType | None) -> None:
    now = time.monotonic()
    if not _EARLY:
        _EARLY.append((signal.Signals(signum).name, now))
    elif now - _EARLY[0][1] >= _SAME_EVENT_S:  # asked again: the way out of a stuck start-up, as later
        os._exit(128 + signum)


def shield_worker(worker_id: int, rank_pid: int | None = None) -> None:
    """A DataLoader worker's ``worker_init_fn`` (:class:`WorkerShield` binds ``rank_pid``, the rank that built
    the loader): stop signals are its rank's to act on. Launchers signal a rank's whole process group
    (torchrun's agent, Ctrl-C in a terminal) or every process of a job (SLURM's cgroup-wide signals, ``scancel
    --full``), workers included, and a worker ended by one fails its rank ("DataLoader worker ... exited
    unexpectedly") before the rank can checkpoint. So a worker ignores the stop requests (SIGINT, SIGUSR1,
    SIGUSR2) and leaves the rank's process group. SIGTERM it takes only from its rank (torch's
    ``terminate()``, Python's exit of a process with daemonic children): anyone else's waits unanswered, since
    the rank, told the same, stops at a step boundary and ends its workers itself. It still ends with its
    rank: torch's workers watch their parent."""
    try:
        os.setpgid(0, 0)
    except OSError:  # not permitted here: a group-wide SIGTERM then reaches the worker, and is refused below
        pass
    for sig in (signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    # Blocked before any thread starts, so every later thread inherits the block and the one waiter below is
    # the only taker (a blocked signal never reaches torch's handler, which dies of a stranger's SIGTERM).
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    # A process the worker forks (a pool of its own) starts with SIGTERM as usual. One it starts through
    # subprocess keeps the block across exec: a dataset stops such a helper with kill(), not terminate().
    os.register_at_fork(after_in_child=lambda: signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM}))
    parent = os.getppid()
    threading.Thread(
        target=_terminate_only_from,
        args=({parent, rank_pid or parent},),
        name="ddplab-worker-sigterm",
        daemon=True,
    ).start()
    threading.Thread(target=_end_with_parent, args=(parent,), name="ddplab-worker-watch", daemon=True).start()


class WorkerShield:
    """A loader's ``worker_init_fn`` (:func:`shield_worker`, knowing the pid of the rank that built the
    loader: a worker a fork server starts has that server for parent) and the context its workers are forked
    in."""

    def __init__(self) -> None:
        self.rank_pid = os.getpid()

    def __call__(self, worker_id: int) -> None:
        shield_worker(worker_id, self.rank_pid)

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """SIGTERM blocked in this thread while it forks workers: a child inherits the mask, so a SIGTERM sent
        to every process before a worker reaches its ``worker_init_fn`` waits there for
        :func:`shield_worker`'s taker instead of meeting torch's handler. The rank loses nothing: another of
        its threads takes the signal (Python's handler still runs in the main thread), or it is delivered as
        the block ends."""
        if not _WORKERS_ENDED_AT_EXIT:
            _WORKERS_ENDED_AT_EXIT.append(True)
            atexit.register(_end_workers_at_exit)  # after multiprocessing's own exit hook, so it runs first
            os.register_at_fork(after_in_child=_freeze_inherited)
        before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        _FORKING_WORKERS[0] = True
        try:
            yield
        finally:
            _FORKING_WORKERS[0] = False
            signal.pthread_sigmask(signal.SIG_SETMASK, before)


_WORKERS_ENDED_AT_EXIT: list[bool] = []
_FORKING_WORKERS = [False]  # inside WorkerShield.starting: a fork now is a loader worker's


def _freeze_inherited() -> None:
    """In a loader worker, as it is forked, before any of its code runs: everything it inherited, the rank's
    garbage not yet collected included, moves out of the collector's reach. A worker would otherwise collect a
    cycle of the rank's (its last epoch's loader iterator) and run its finalizer in the wrong process, which
    shut the old workers down from there and hung (the soak's trial 2027837527). The rank collects its own."""
    if _FORKING_WORKERS[0]:
        gc.freeze()


WORKER_EXIT_S = 5.0  # how long a rank's exit waits for a loader worker told to end before it kills it


def _end_workers_at_exit() -> None:
    """A rank's exit ends the loader workers a live iterator still holds as multiprocessing's own exit would
    (SIGTERM, then a join), but bounded: a worker whose SIGTERM taker cannot run (its interpreter held by C
    code, or the rank's SIGTERM merged into a stranger's still pending) would hold that join, and the exit,
    for ever. Such a worker is killed; torch's SIGCHLD watch, which would call that a worker failure, goes
    first."""
    import multiprocessing

    workers = [p for p in multiprocessing.active_children() if p.daemon]
    for p in workers:
        p.terminate()
    for p in workers:
        p.join(WORKER_EXIT_S)
    left = [p for p in workers if p.is_alive()]
    if left and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for p in left:
        p.kill()
        p.join()


def _terminate_only_from(senders: set[int]) -> None:
    """A loader worker's SIGTERM taker. One its rank sent ends the worker with status 0, as torch's own worker
    handler (which this replaces) does: the rank's exit terminates workers a live iterator still holds, and
    its SIGCHLD watch fails the rank on any worker killed by a signal. One from anybody else is dropped."""
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid in senders:
            os._exit(0)


def _end_with_parent(parent: int) -> None:
    """A worker out of its rank's group is missed by a group-wide kill: it must end itself when its rank dies.
    torch's own watch exits through multiprocessing's finalizers, which wait for the worker's queue to drain
    into a pipe nobody reads any more — forever once it is full (a killed rank's workers were left running,
    holding the launcher's output open). Nothing of a loader worker outlives its rank, so it just exits."""
    while os.getppid() == parent:
        time.sleep(LAUNCHER_POLL_S)
    os._exit(1)


class Preempted(Exception):
    """The job stopped on a signal after checkpointing at ``step`` (the Session records it)."""

    def __init__(self, signal_name: str, step: int, checkpoint: str | None):
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint
        where = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint"
        super().__init__(
            f"stopped by {signal_name} at step {step} ({where}); run the same command with "
            "resume=auto to continue"
        )

    @property
    def exit_code(self) -> int:
        """128 + the signal number, as a shell reports a process ended by that signal (SIGTERM's for a
        stop that no signal asked for: the launcher died)."""
        return 128 + int(getattr(signal, self.signal_name, signal.SIGTERM))


class StopSignal:
    """Installed for the job's life on the main thread (a no-op elsewhere); restores the old handlers."""

    def __init__(self) -> None:
        self.name: str | None = None  # the first signal's name, once one arrived
        self.at = 0.0  # monotonic time of the first signal
        self._old: dict[int, object] = {}
        self._watching = threading.Event()  # set: stop watching the launcher
        self._launcher: int | None = None

    @property
    def requested(self) -> bool:
        return self.name is not None

    def install(self, launcher_pid: int | None = None) -> StopSignal:
        """``launcher_pid``: the process that started this rank (torchrun's agent, the self-launch
        parent, SLURM's step daemon); when it dies, this rank stops as if signalled."""
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                old = signal.signal(sig, self._handle)
                # The start-up hold ends here: after the job, a signal acts as it would without ddplab
                # (a study worker's hold lasts: hold_for_life).
                self._old[sig] = signal.SIG_DFL if old is _remember and not _FOR_LIFE else old
        if _EARLY and self.name is None:  # it came while the process started (hold_during_startup)
            (self.name, self.at), _EARLY[:] = _EARLY[0], []
            log.warning(
                "%s received during start-up, %.1f s ago: stopping at the first step boundary all ranks "
                "agree on, after a checkpoint",
                self.name,
                time.monotonic() - self.at,
            )
        self._launcher = launcher_pid
        if launcher_pid is not None:
            self._watching.clear()
            threading.Thread(
                target=self._watch_launcher, args=(launcher_pid,), name="ddplab-launcher-watch", daemon=True
            ).start()
        return self

    def uninstall(self) -> None:
        if self.name is not None:  # the worker must not take another trial
            hand_on(self.name, self.at)
        self._watching.set()
        for sig, old in self._old.items():
            signal.signal(sig, old)  # type: ignore[arg-type]
        self._old.clear()

    def reason(self) -> str | None:
        """Why this rank stops: the first signal's name, or that its launcher died. torch's ranks
        (self-launch) get SIGINT as the death signal of the process that started them, maybe before a parent
        pid changes: asked later (when the stop is carried out), the parent pids tell which it was. With no
        request of its own (a peer's flag stopped it before this rank's watch polled), a dead launcher is
        still the reason."""
        orphan = self._launcher is not None and env.orphaned(self._launcher)
        if self.name is None and orphan:
            return f"launcher died (pid {self._launcher})"
        if self.name and orphan and not self.name.startswith("launcher died"):
            return f"launcher died (pid {self._launcher}; {self.name})"
        return self.name

    def request(self, reason: str) -> None:
        """Ask for the same checkpointed stop a signal asks for (the first reason is kept)."""
        if self.name is None:
            self.name, self.at = reason, time.monotonic()
            log.warning(
                "%s: stopping at the next step boundary all ranks agree on, after a checkpoint", reason
            )

    def _watch_launcher(self, pid: int) -> None:
        """A rank whose launcher died is an orphan: nobody will stop it, restart it or collect its exit code.
        The kernel re-parents it (or the fork server between them), so a parent pid changes: poll that."""
        while not self._watching.wait(LAUNCHER_POLL_S):
            if env.orphaned(pid):
                self.request(f"launcher died (pid {pid})")
                return

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.name is None:
            self.name, self.at = name, now
            log.warning(
                "%s received: stopping at the next step boundary all ranks agree on, after a checkpoint "
                "(send it again to exit at once, without one)",
                name,
            )
        elif now - self.at >= _SAME_EVENT_S:
            log.error("second signal (%s): exiting now, without a checkpoint", name)
            logging.shutdown()
            os._exit(128 + signum)
