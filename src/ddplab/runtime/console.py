"""How ddplab's lines look on a console: short (a time, not a date and a logger name), warnings
marked, and tagged with the sweep job and the rank they come from, so that the lines of jobs
running side by side (joblib) or of several ranks can be told apart.

Hydra's job logging uses :class:`ConsoleFormatter` (``conf/train.yaml``); self-launched ranks
get one from the launcher. The log file keeps Hydra's full format.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from pathlib import Path
from typing import Callable

from ddplab import redact


def job_tag() -> str:
    """`` [job 3]`` inside a Hydra sweep's job 3, else nothing."""
    from ddplab.rundir import is_multirun

    if not is_multirun():
        return ""
    from hydra.core.hydra_config import HydraConfig

    return f" [job {HydraConfig.get().job.num}]"


class MaskedFormatter(logging.Formatter):
    """A log line with its secrets masked (ddplab.redact), whichever library's: Hydra's own lines (a sweep's
    ``#0 : <overrides>``) and the log file's (``conf/train.yaml``), as :class:`ConsoleFormatter`'s are."""

    def __init__(self, format: str | None = None, datefmt: str | None = None):  # noqa: A002 (logging's key)
        super().__init__(format, datefmt)

    def format(self, record: logging.LogRecord) -> str:
        return redact.text(super().format(record), redact.active())


# Hydra's, as conf/train.yaml spells it
LOG_FILE_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


def log_file_formatter() -> MaskedFormatter:
    """A log file's lines (a self-launched rank 0's, a study trial's), as Hydra's train.log: secrets
    masked."""
    return MaskedFormatter(LOG_FILE_FORMAT)


class ConsoleFormatter(logging.Formatter):
    """``12:00:01 [job 3] [rank 1] WARNING: message``: the tags only where they apply.

    ``tag``: given by a launcher that knows it (a self-launched rank); None: worked out here, from
    Hydra's job and the launcher's rank.
    """

    def __init__(self, tag: str | None = None):
        super().__init__("%(asctime)s%(tag)s %(mark)s%(message)s", datefmt="%H:%M:%S")
        if tag is None:
            from ddplab.runtime import env

            tag = job_tag() + (f" [rank {env.rank()}]" if env.rank() else "")
        self.tag = tag

    def format(self, record: logging.LogRecord) -> str:
        record.tag = self.tag
        record.mark = f"{record.levelname}: " if record.levelno >= logging.WARNING else ""
        return redact.text(super().format(record), redact.active())  # any line, any library's: no secret


def log_to(path: Path) -> logging.Handler:
    """Also log to ``path`` (a study trial's own train.log, beside its worker's), quietly on a full disk."""
    handler = logging.FileHandler(path)
    handler.setFormatter(log_file_formatter())
    logging.getLogger().addHandler(handler)
    quiet_log_files()
    return handler


def quiet_log_files() -> None:
    """Every log file the root logger writes (Hydra's train.log, a rank's, a trial's): one that cannot be
    written (a full disk) is said once on stderr and then left alone. logging's own report is a traceback
    per record, chained to the error the record was reporting: a full disk's one line became 80."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and not getattr(handler, "ddplab_quiet", False):
            handler.ddplab_quiet = True  # type: ignore[attr-defined]
            handler.handleError = _said_once(handler)  # type: ignore[method-assign]


def _said_once(handler: logging.FileHandler) -> Callable[[logging.LogRecord], None]:
    def handle_error(record: logging.LogRecord) -> None:
        handler.setLevel(logging.CRITICAL + 1)  # no further record tries the file
        stream, handler.stream = handler.stream, None  # nor does closing it (its buffer cannot be written)
        with contextlib.suppress(OSError):
            stream.close()
        sys.stderr.write(
            f"ddplab: stopped writing {handler.baseFilename}: {sys.exc_info()[1]} (the console keeps "
            "the log)\n"
        )

    return handle_error
