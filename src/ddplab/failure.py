"""How a job that failed ends: one function, :func:`of`, turns any failure into the exit code, the one line
and the content of ``result.json``, and every entry acts on its answer — ``python train.py`` and each rank
under torchrun or SLURM (``cli.main``), a self-launched rank (``job.run_rank``) and its parent
(``job.self_launch``), a study trial (``study.worker``), a verify_resume leg (``verify``) — as does the
Session, which records a failure where it happened. The table (``tests/unit/test_failure.py`` checks each row
at every entry):

    failure                        exit code            the one line                 result.json
    Preempted (a signal)           128 + the signal     "preempted: ..." (warning)   preempted, its step
    ConfigError                    2                    rank 0: "config error: ..."  failed, "config error..."
    InputError (a file it read)    2                    "error: ..."                 failed
    ResourceError (a full disk)    1 (a self-launched   "error: ..."                 failed (RecordWriteError:
                                   rank's: 4; study: 3)                              none: the disk refused)
    PeerFailed / PeerLost          1                    the Session's, once          failed, the peer's error
    RankFailed (a self-launched    1                    the rank at fault, named     failed, that line
    rank; it said its error)
    VerifyFailed                   1                    "verify_resume: ..."         (the legs record theirs)
    anything else                  1                    its traceback                failed, "Type: message"

A command refused before Hydra makes its run dir (:func:`refuse`) says its line and exits 2, with no record.
A line the rank that met the failure has said already (``errors.mark_said``) is not said again; a failure
alike on every rank is said and recorded by rank 0, the others waiting a moment (``waits``).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any, NoReturn

from ddplab.errors import ConfigError, InputError, RecordWriteError, ResourceError, VerifyFailed, was_said
from ddplab.runtime import launch
from ddplab.runtime.group import PeerFailed, plain_message
from ddplab.runtime.signals import Preempted

log = logging.getLogger("ddplab")

CRASH_EXIT = 1  # Python's own for an uncaught exception: a crash and the errors that are no one's input


@dataclass(frozen=True)
class Failure:
    """What a process does about a failure (:func:`of`)."""

    kind: str  # "preempted", "config", "input", "resource", "peer", "rank", "verify" or "crash"
    code: int  # the process's exit code
    line: str | None  # the one line still to say (None: said already, or rank 0 says it)
    record: dict[str, Any] | None  # result.json's content (None: nothing may be written in its place)
    waits: bool = False  # alike on every rank: a rank other than 0 lets rank 0 say and record it first
    traceback: bool = False  # no one foresaw it: the traceback is what helps, and Python says it

    @property
    def sweep_goes_on(self) -> bool:
        """Whether a sweep's next job may run after it: not after a stop signal (the machine is going away),
        nor after a verdict."""
        return self.kind not in ("preempted", "verify")


def of(e: BaseException, rank: int = 0, in_rank: bool = False, report: str | None = None) -> Failure:
    """The one answer to ``e``, on ``rank``. ``in_rank``: this process is a self-launched rank, whose exit
    code its parent reads (``runtime.launch``). ``report``: the Session's account of where and on which rank
    it happened (``group.describe_failure``), recorded in place of the bare message."""
    said = was_said(e)
    alike = bool(getattr(e, "alike_on_every_rank", False))
    plain = report or f"{type(e).__name__}: {plain_message(e)}"
    failed = {"status": "failed", "error": plain}
    if isinstance(e, Preempted):
        return Failure(
            "preempted",
            e.exit_code,
            None if said else f"preempted: {e}",
            {
                "status": "preempted",
                "signal": e.signal_name,
                "step": e.step,
                "checkpoint": e.checkpoint,
                "resume": "run the same command with resume=auto",
            },
        )
    if isinstance(e, ConfigError):  # found alike on every rank: rank 0 says it, once, no traceback
        # (a self-launched rank leaves it to its parent, which reads rank 0's record: job.self_launch)
        return Failure(
            "config",
            launch.CONFIG_EXIT,
            None if said or rank or in_rank else f"config error: {e}",
            {"status": "failed", "error": f"config error: {e}"},
            waits=rank != 0,
        )
    if isinstance(e, VerifyFailed):  # the comparison's verdict, not a crash
        return Failure("verify", CRASH_EXIT, None if said else f"verify_resume: {e}", None)
    if isinstance(e, (InputError, ResourceError)):  # one line naming the file or the resource, and the fix
        code = (
            launch.CONFIG_EXIT
            if isinstance(e, InputError)
            else launch.SAID_EXIT
            if in_rank
            else int(getattr(e, "exit_code", CRASH_EXIT))
        )
        return Failure(
            "input" if isinstance(e, InputError) else "resource",
            code,
            None if said else f"error: {e}",
            None if isinstance(e, RecordWriteError) else failed,
            # a self-launched rank's input error: rank 0's record and line first, for the parent to
            # read
            waits=rank != 0 and (alike or (in_rank and isinstance(e, InputError))),
        )
    if isinstance(e, PeerFailed):  # this rank only lost its connection: the peer's error is the job's
        return Failure(
            "peer",
            CRASH_EXIT,
            None if said else str(e),
            {"status": "failed", "error": e.report},
            waits=alike and rank != 0,
        )
    if isinstance(e, launch.RankFailed):  # the rank at fault said its error and traceback; named here once
        return Failure("rank", CRASH_EXIT, None if said else str(e), {"status": "failed", "error": str(e)})
    return Failure("crash", CRASH_EXIT, None, failed, traceback=True)


def leave(f: Failure, e: BaseException) -> NoReturn:
    """End this process as ``f`` says: its line, rank 0 first where every rank met it, then its exit code
    (or, for a crash, ``e`` itself, for Python to print its traceback and exit 1)."""
    if f.line:
        (log.warning if f.kind == "preempted" else log.error)("%s", f.line)
    if f.waits:
        launch.let_rank_zero_report()
    if f.traceback:
        raise e
    raise SystemExit(f.code) from None


def refuse(line: str) -> NoReturn:
    """A refusal before the job exists (Hydra has made no run dir, logging is not set up: ``cli``'s checks of
    the command): the line on stderr and exit 2, as a config error; nothing to record."""
    sys.stderr.write(f"{line}\n")
    raise SystemExit(launch.CONFIG_EXIT)
