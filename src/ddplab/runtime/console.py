"""How ddplab's lines look on a console: short (a time, not a date and a logger name), warnings
marked, and tagged with the sweep job and the rank they come from, so that the lines of jobs
running side by side (joblib) or of several ranks can be told apart.

Hydra's job logging uses :class:`ConsoleFormatter` (``conf/train.yaml``); self-launched ranks
get one from the launcher. The log file keeps Hydra's full format.
"""

from __future__ import annotations

import logging


def job_tag() -> str:
    """`` [job 3]`` inside a Hydra sweep's job 3, else nothing."""
    from ddplab.rundir import is_multirun

    if not is_multirun():
        return ""
    from hydra.core.hydra_config import HydraConfig

    return f" [job {HydraConfig.get().job.num}]"


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
        return super().format(record)
