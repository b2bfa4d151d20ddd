"""Self-launch: ``python train.py distributed.nproc_per_node=N`` starts its own N ranks.

Each job gets its own rendezvous on a free port (torch's elastic agent, as
``torchrun --standalone`` does), so Hydra launchers that run jobs side by side
(joblib, submitit) never collide on ports, and a sweep needs no torchrun.

The rank body is an entry callable handed in by the caller (``ddplab.job``),
so this module never imports the job (no import cycle).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import multiprocessing
import multiprocessing.util
import os
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

from ddplab.runtime import env, teardown, watch
from ddplab.runtime.signals import SIGNALS, Preempted

log = logging.getLogger("ddplab")

Entry = Callable[[dict[str, Any]], dict[str, float]]

# a rank's exit code for a config error (the entry's to use; rank 0 recorded it in result.json)
CONFIG_EXIT = 2
# a rank's exit code for an error it said whole in one line (errors.ResourceError: a full disk); its process
# exits without a traceback, and the agent's own about the exit is noise too
SAID_EXIT = 4
CONFIG_REPORT_GRACE_S = 3.0
# A rank that returned its result leaves this long after, if the agent has not let it go (see _rank_main).
RETURNED_EXIT_S = 3.0
# What the ranks' fork server never acts on (it ignores SIGINT itself): a launcher or a cluster sends these to
# a whole process group or job step, and the server's death would lose its ranks' exit codes.
SERVER_HOLDS = tuple(SIGNALS) + (signal.SIGHUP, signal.SIGQUIT)


def let_rank_zero_report() -> None:
    """A config error is found alike on every rank, and the first rank to exit makes the launcher
    (torchrun's agent or ours) end the others: a rank other than 0 waits a moment, so rank 0 prints
    the one line and writes result.json first (the launcher then ends this rank, or the grace does)."""
    if env.rank() != 0:
        time.sleep(CONFIG_REPORT_GRACE_S)


class RankSaid(RuntimeError):
    """A rank ended with :data:`SAID_EXIT`: it said its error (a full disk) and recorded it in result.json."""


class RankRefusedConfig(RuntimeError):
    """A rank ended with :data:`CONFIG_EXIT`: the job's config cannot work (see rank 0's result.json)."""


class RankFailed(RuntimeError):
    """A rank failed and has said why itself (its error line, its traceback in torch's log, result.json): the
    parent's one line names it, with no traceback of the parent's own. ``killed_by``: the signal's name where
    the rank did not fail but was killed (SIGKILL: the OOM killer, a user), and so said nothing."""

    def __init__(self, message: str, killed_by: str | None = None):
        super().__init__(message)
        self.killed_by = killed_by


def launch(
    entry: Entry,
    job: dict[str, Any],
    nproc: int,
    max_restarts: int,
    run_dir: Path,
    preload: tuple[str, ...] = (),
) -> dict[str, float]:
    """Run ``entry(job)`` on ``nproc`` local ranks; return rank 0's result.

    ``entry`` must be importable by name (a module-level function). The ranks are forks of a server that
    imported ``entry``'s module and ``preload`` once (compat.rank_server): a rank costs no interpreter
    start-up (seconds of CPU each), and a restart neither.
    """
    from torch.distributed.launcher.api import LaunchConfig

    env.prepare_self_launch(nproc)
    # The agent also hands SIGUSR1 (SLURM's warning before the time limit) on to the ranks.
    extra = (
        {"signals_to_handle": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"}
        if "signals_to_handle" in {f.name for f in dataclasses.fields(LaunchConfig)}
        else {}
    )
    if multiprocessing.get_start_method(allow_none=True) not in (None, "spawn", "fork", "forkserver"):
        # Inside joblib's loky workers the global start method is "loky", which
        # the ranks spawned below cannot resolve; they only need plain spawn.
        multiprocessing.set_start_method("spawn", force=True)
    log.info("self-launch: %d local ranks (max_restarts=%d)", nproc, max_restarts)
    from ddplab import compat

    run_id = uuid.uuid4().hex
    try:
        with compat.rank_server(["__main__", entry.__module__, *preload], SERVER_HOLDS) as start_method:
            return _launch(
                entry, job, nproc, max_restarts, run_dir, run_id, {**extra, "start_method": start_method}
            )
    finally:
        with contextlib.suppress(OSError, RuntimeError):  # never in place of the job's own outcome
            env.forget_memo(run_id)


@contextlib.contextmanager
def _handlers_given_back() -> Iterator[None]:
    """torch's agent installs its own handlers (they raise SignalException) and leaves them: after the job a
    signal would raise wherever this process is (a study worker's storage call between trials). The handlers
    come back as they were, so a study worker's hold (signals.hold_for_life) remembers it instead."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {sig: signal.getsignal(sig) for sig in (*SERVER_HOLDS, signal.SIGUSR2)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            if handler is not None:  # None: installed from outside Python, which cannot be put back
                signal.signal(sig, handler)


def _launch(
    entry: Entry,
    job: dict[str, Any],
    nproc: int,
    max_restarts: int,
    run_dir: Path,
    run_id: str,
    extra: dict[str, Any],
) -> dict[str, float]:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    try:
        with _loopback_stores() as port, _quiet_about_known_exits(), _handlers_given_back():
            config = LaunchConfig(
                min_nodes=1,
                max_nodes=1,
                nproc_per_node=nproc,
                run_id=run_id,
                rdzv_backend="c10d",
                rdzv_endpoint=f"127.0.0.1:{port}",
                local_addr="127.0.0.1",
                max_restarts=max_restarts,
                monitor_interval=0.2,
                **extra,
            )
            # (the start method the ranks' own processes, their loader workers, get: this process's, as under
            # spawn)
            results = elastic_launch(config, _rank_main)(
                entry, job, str(run_dir), config.start_method, multiprocessing.get_start_method()
            )
    except SignalException as e:  # the agent stopped the ranks with our signal; they checkpointed
        raise Preempted(e.sigval.name, -1, None) from None
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode in {128 + int(s) for s in SIGNALS}:  # a rank was preempted (runtime.signals)
            raise Preempted(f"exit code {failure.exitcode} of rank {rank}", -1, None) from None
        if failure.exitcode == CONFIG_EXIT:  # said and recorded by the rank; the caller says it once
            raise RankRefusedConfig(rank) from None
        if failure.exitcode == SAID_EXIT:
            raise RankSaid(rank) from None
        others = ", ".join(f"rank {r} with {f.exitcode}" for r, f in sorted(e.failures.items()) if r != rank)
        # torch's record of a rank's exception: {"message": "Type: text", "extraInfo": {its call stack}} (a
        # str where the rank left no error file: torch's boilerplate about enabling tracebacks, not the cause)
        said = failure.message.get("message") if isinstance(failure.message, dict) else None
        raise RankFailed(
            f"self-launched job failed: rank {rank} (local {failure.local_rank}) exited with code "
            f"{failure.exitcode}: "
            + (f"{said} (its error and traceback are above)" if said else "see its log above")
            + (f" (then: {others})" if others else ""),
            # SIGKILL only: the OOM killer's or a user's; SIGSEGV, SIGABRT are the process's own crash
            killed_by="SIGKILL" if any(f.exitcode == -signal.SIGKILL for f in e.failures.values()) else None,
        ) from None
    return results[0]


def _rank_main(
    entry: Entry, job: dict[str, Any], run_dir: str, start_method: str, children_start: str
) -> dict[str, float]:
    """Body of each rank: log like train.py would (rank 0 also to run_dir/train.log), then ``entry``."""
    from ddplab import compat
    from ddplab.runtime.console import ConsoleFormatter, log_file_formatter, quiet_log_files

    if start_method == "forkserver":
        # ignored (some also blocked) by the server it was forked from; a spawned rank
        for sig in SERVER_HOLDS:
            signal.signal(sig, signal.SIG_DFL)  # starts with the defaults
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SERVER_HOLDS)
        # A fork ends in os._exit once multiprocessing's finalizers ran: the atexit handlers a spawned
        # interpreter would run at its exit (the user's, MLflow's, teardown's below) run as its last
        # finalizer.
        multiprocessing.util.Finalize(None, compat.run_exit_handlers, exitpriority=-1)
        # A fork of the server would start its own processes through a server too: loader workers that are not
        # the rank's children outlive a killed rank (its watch, signals.shield_worker, looks at the parent).
        multiprocessing.set_start_method(children_start, force=True)
        # What it inherited stays out of the collector's passes: a collection writes to every object it
        # visits, copying the server's pages into this rank one by one (665 page faults a step, measured).
        gc.freeze()
    rank = env.rank()
    root = logging.getLogger()
    console = logging.StreamHandler(sys.stdout if rank == 0 else sys.stderr)
    console.setFormatter(ConsoleFormatter(job.get("log_tag", "") + (f" [rank {rank}]" if rank else "")))
    root.addHandler(console)
    if rank == 0:
        file = logging.FileHandler(Path(run_dir) / "train.log")
        file.setFormatter(log_file_formatter())
        root.addHandler(file)
        quiet_log_files()
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    watch.own_the_process()  # this spawned rank is ddplab's own
    teardown.cheap_interpreter_exit()  # a spawned rank's exit is a whole interpreter's teardown too
    try:
        out = entry(job)
    except Preempted as e:  # the exit code tells the agent (and our parent) that this was a preemption
        sys.exit(e.exit_code)
    _leave_soon_after_returning()
    return out


def _leave_soon_after_returning(after_s: float = RETURNED_EXIT_S) -> None:
    """After this function's caller returns, torch's spawn wrapper hands the result to the agent and waits
    for the agent to have read every rank's. An agent shutting down on a signal never does (found by the
    soak, seed 155076137: SIGINT to the whole job during its last checkpoint, the job completed, then both
    ranks waited out the agent's 30 s and were SIGKILLed). The result is in the pipe by then: leave after
    ``after_s`` whatever the agent does (a healthy one reads it within its 0.2 s poll)."""

    def leave() -> None:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        logging.shutdown()
        os._exit(0)

    timer = threading.Timer(after_s, leave)
    timer.daemon = True
    timer.start()


@contextlib.contextmanager
def _quiet_about_known_exits() -> Iterator[None]:
    """torch's agent logs a rank's exit with a traceback of its own polling, and spawn logs ending the
    other ranks; for a config error or a preemption (exit 128 + the signal, after the checkpoint) that is
    noise around the one line the caller prints (a rank that crashed keeps its report, and the error this
    module raises names it)."""
    loggers = [
        logging.getLogger(n)
        for n in ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn")
    ]
    said = [f"(exitcode: {code})" for code in (CONFIG_EXIT, SAID_EXIT, *(128 + int(s) for s in SIGNALS))]

    def keep(record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(s in text for s in said) and not text.startswith("Terminating process")

    for lg in loggers:
        lg.addFilter(keep)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(keep)


@contextlib.contextmanager
def _loopback_stores() -> Iterator[int]:
    """Both stores of a self-launched job listen on 127.0.0.1 only, never on every interface.

    torch's TCPStore binds the wildcard address whatever host it is given, so another host
    could read and write a job's keys. It can instead serve a socket bound beforehand
    (``master_listen_fd``), and a ``multi_tenant`` store reuses the server already serving its
    port in this process. So: the rendezvous store's server is made here on a loopback socket
    (the agent's own store then reuses it), and the agent's second store for the ranks
    (``compat.agent_store_servers``) is made the same way while the job runs.
    """
    import torch.distributed as dist

    from ddplab import compat

    def loopback_server(host: str, port: int) -> Any:
        sock = socket.create_server((host, port), backlog=512)
        store = dist.TCPStore(
            host,
            sock.getsockname()[1],
            is_master=True,
            multi_tenant=True,
            master_listen_fd=os.dup(sock.fileno()),
        )
        sock.close()  # the store listens on its own duplicate
        return store

    rdzv = loopback_server("127.0.0.1", 0)
    try:
        with compat.agent_store_servers(loopback_server):
            yield rdzv.port
    finally:
        del rdzv
