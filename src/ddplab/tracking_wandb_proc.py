"""The W&B client's own process (``python -m ddplab.tracking_wandb_proc``, started by rank 0's W&B writer,
ddplab.tracking_wandb): wandb is imported, started and called here, at the lowest CPU priority, so that its
Python work (about two CPU-seconds to import and start) never holds the training process's interpreter lock,
and its CPU (and its wandb-core service's, which inherits the priority) goes to training first.

Protocol: pickled ``(call, args)`` frames on stdin, one pickled reply each on stdout: ``("ok", value)`` or
``("error", type name, message)``. End of stdin (the writer closed it, or the training process died) finishes
an open run (exit code 1 unless ``finish`` came first) and ends the process.
"""

from __future__ import annotations

import contextlib
import html
import logging
import os
import pickle
import signal
import sys
from typing import Any, BinaryIO


class Client:
    """The W&B run, as the writer's calls reach it."""

    def __init__(self) -> None:
        self.run: Any = None

    def start(self, init: dict[str, Any], settings: dict[str, Any], online: bool) -> tuple[str, str]:
        """wandb.init; online but not started within its timeout: offline instead. (mode, the offline folder's
        path or "", the error that made it offline or "")."""
        import wandb

        mode = "online" if online else "offline"
        try:
            self.run = wandb.init(mode=mode, settings=wandb.Settings(**settings), **init)
        except Exception as e:
            if not online:
                raise
            wandb.teardown()  # its service still holds the run id the online start claimed
            self.run = wandb.init(mode="offline", settings=wandb.Settings(**settings), **init)
            return (
                "offline",
                f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}",
            )
        return mode, ""

    def log(self, values: dict[str, Any], step: int) -> None:
        self.run.log(values, step=step)

    def html(self, tag: str, text: str, step: int) -> None:
        import wandb

        self.run.log({tag: wandb.Html(f"<pre>{html.escape(text)}</pre>")}, step=step)

    def config(self, values: dict[str, Any]) -> None:
        self.run.config.update(values, allow_val_change=True)

    def artifact(self, name: str, folder: str, description: str) -> None:
        import wandb

        art = wandb.Artifact(name, type="model", description=description)
        art.add_dir(folder)  # copied into W&B's staging area: the folder may go once this returns
        self.run.log_artifact(art)

    def finish(self, exit_code: int) -> str:
        """The run ends; the folder ``wandb sync`` sends (its files' parent)."""
        folder = os.path.dirname(self.run.dir) if self.run.dir else ""
        self.run.finish(exit_code=exit_code)
        self.run = None
        return folder


def serve(requests: BinaryIO, replies: BinaryIO) -> None:
    client = Client()
    while True:
        try:
            call, args = pickle.load(requests)
        except (EOFError, pickle.UnpicklingError, OSError):
            break  # the writer is gone: the run ends as failed (a resume sets it running again)
        try:
            reply: tuple = ("ok", getattr(client, call)(*args))
        except Exception as e:  # noqa: BLE001 - every failure goes back to the writer, which says it
            reply = ("error", type(e).__name__, str(e))
        pickle.dump(reply, replies)
        replies.flush()
    if client.run is not None:
        with contextlib.suppress(Exception):
            client.finish(1)


def main() -> None:
    # Training first: this process (and wandb-core, its child, which inherits it) runs only on CPU that
    # nothing else wants. Nice 19 alone still took 2-4 s from a 12 s loop that kept both cores busy (each
    # wake-up of W&B's threads preempted one of training's, which the others then waited for).
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux: the lowest priority there is
        os.nice(19)
    # A signal to the job's process group is the training process's to handle: this one ends when its stdin
    # does (the run finished, or the training process gone), never with a half-written run.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # wandb logs each call, the whole config included, to a file in the run dir: on a full disk Python's
    # logging printed "--- Logging error ---", a traceback and that record into the job's output. A write
    # that fails is the call's error reply (said by the writer in one line), never the handler's report.
    logging.raiseExceptions = False
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # what wandb prints must not mix with the replies
    serve(sys.stdin.buffer, out)


if __name__ == "__main__":
    main()
