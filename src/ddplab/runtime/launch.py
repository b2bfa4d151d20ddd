"""Self-launch: ``python train.py distributed.nproc_per_node=N`` starts its own N ranks.

Each job gets its own rendezvous on a free port (torch's elastic agent, as
``torchrun --standalone`` does), so Hydra launchers that run jobs side by side
(joblib, submitit) never collide on ports, and a sweep needs no torchrun.

The rank body is an entry callable handed in by the caller (``ddplab.job``),
so this module never imports the job (no import cycle).
"""

from __future__ import annotations

import logging
import multiprocessing
import sys
import uuid
from pathlib import Path
from typing import Any, Callable

from ddplab.runtime import env

log = logging.getLogger("ddplab")

Entry = Callable[[dict[str, Any]], dict[str, float]]


def launch(entry: Entry, job: dict[str, Any], nproc: int, max_restarts: int, run_dir: Path) -> dict[str, float]:
    """Run ``entry(job)`` on ``nproc`` local ranks; return rank 0's result.

    ``entry`` must be importable by name (a module-level function): the ranks are spawned.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    env.prepare_self_launch(nproc)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex,
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",  # port 0: a free port per job
        max_restarts=max_restarts, monitor_interval=0.2,
    )
    if multiprocessing.get_start_method(allow_none=True) not in (None, "spawn", "fork", "forkserver"):
        # Inside joblib's loky workers the global start method is "loky", which
        # the ranks spawned below cannot resolve; they only need plain spawn.
        multiprocessing.set_start_method("spawn", force=True)
    log.info("self-launch: %d local ranks (max_restarts=%d)", nproc, max_restarts)
    try:
        results = elastic_launch(config, _rank_main)(entry, job, str(run_dir))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        raise RuntimeError(
            f"self-launched job failed: rank {rank} (local {failure.local_rank}) exited with code "
            f"{failure.exitcode}: {failure.message or 'see its log above'}") from e
    return results[0]


def _rank_main(entry: Entry, job: dict[str, Any], run_dir: str) -> dict[str, float]:
    """Body of each spawned rank: log like train.py would (rank 0 also to run_dir/train.log), then ``entry``."""
    rank = env.rank()
    fmt = logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    root = logging.getLogger()
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stdout if rank == 0 else sys.stderr)]
    if rank == 0:
        handlers.append(logging.FileHandler(Path(run_dir) / "train.log"))
    for h in handlers:
        h.setFormatter(fmt)
        root.addHandler(h)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    return entry(job)
