"""Self-launch: ``python train.py distributed.nproc_per_node=N`` starts its own N ranks.

Each job gets its own rendezvous on a free port (torch's elastic agent, as
``torchrun --standalone`` does), so Hydra launchers that run jobs side by side
(joblib, submitit) never collide on ports, and a sweep needs no torchrun.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import uuid
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ddplab import distributed

log = logging.getLogger("ddplab")


def launch(cfg: DictConfig, run_dir: Path) -> dict[str, float]:
    """Run the job on ``nproc_per_node`` local ranks; return rank 0's metrics."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    d = cfg.distributed
    n = d.nproc_per_node
    # Ranks share the cores: one thread each unless the user said otherwise.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    os.environ[distributed.SELF_LAUNCHED] = "1"  # inherited by the ranks: they must not launch again
    # Resolved here, where Hydra's resolvers (${now:}, ${hydra:}) still work.
    job = OmegaConf.to_container(cfg, resolve=True)
    job["run_dir"] = str(run_dir)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=n, run_id=uuid.uuid4().hex,
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",  # port 0: a free port per job
        max_restarts=d.max_restarts, monitor_interval=0.2,
    )
    if multiprocessing.get_start_method(allow_none=True) not in (None, "spawn", "fork", "forkserver"):
        # Inside joblib's loky workers the global start method is "loky", which
        # the ranks spawned below cannot resolve; they only need plain spawn.
        multiprocessing.set_start_method("spawn", force=True)
    log.info("self-launch: %d local ranks (max_restarts=%d)", n, d.max_restarts)
    try:
        results = elastic_launch(config, _rank_main)(job)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        raise RuntimeError(
            f"self-launched job failed: rank {rank} (local {failure.local_rank}) exited with code "
            f"{failure.exitcode}: {failure.message or 'see its log above'}") from e
    return results[0]


def _rank_main(job: dict[str, Any]) -> dict[str, float]:
    """Body of each spawned rank: log like train.py would, then ``ddplab.run``."""
    from ddplab.job import run

    rank = distributed.env_rank()
    fmt = logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    root = logging.getLogger()
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stdout if rank == 0 else sys.stderr)]
    if rank == 0:
        handlers.append(logging.FileHandler(Path(job["run_dir"]) / "train.log"))
    for h in handlers:
        h.setFormatter(fmt)
        root.addHandler(h)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    cfg = OmegaConf.create(job)
    OmegaConf.set_struct(cfg, True)
    return run(cfg)
