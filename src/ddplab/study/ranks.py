"""The ranks of one study worker (under torchrun or ``srun -n N``): rank 0 decides, every rank acts alike."""

from __future__ import annotations

from typing import Any, Callable

from omegaconf import DictConfig

from ddplab.config.errors import ConfigError
from ddplab.errors import mark_said
from ddplab.runtime import env
from ddplab.study import storage
from ddplab.study.trials import where


def agree(cfg: DictConfig, decide: Callable[[], Any]) -> Any:
    """``decide()`` on rank 0 of a launched worker, its answer on every rank (a process group just for it);
    without a launcher, just ``decide()``. Rank 0's config error is every rank's, said once by rank 0."""
    if not env.is_launched():
        return decide()
    from ddplab.runtime import collectives, group

    dist = group.init(cfg.distributed)
    answer: Any = None
    failure: BaseException | None = None
    try:
        if dist.is_main:
            try:
                answer = ("ok", decide())
            except ConfigError as e:
                answer, failure = ("config", str(e)), e
            except Exception as e:
                answer, failure = ("storage" if storage.failed(e) else "error", f"{type(e).__name__}: {e}"), e
        answer = collectives.broadcast_object(answer, dist)
    finally:
        group.teardown(clean=True)
    if failure is not None:
        raise failure
    if answer[0] == "config":
        raise ConfigError(answer[1])
    if answer[0] == "storage":  # rank 0 says it (run_study), every rank ends alike (ddplab.failure)
        raise mark_said(storage.StorageLost(where(cfg)[1], RuntimeError(answer[1]), alike=True))
    if answer[0] == "error":
        raise RuntimeError(f"rank 0 of this study worker failed: {answer[1]}")
    return answer[1]


def trial_world_size(cfg: DictConfig) -> int:
    """The ranks a trial of this worker trains on: the launcher's (torchrun, srun), else its own ranks."""
    if env.is_launched():
        return env.world_size()
    return (
        int(cfg.distributed.nproc_per_node) if getattr(cfg.distributed.strategy, "name", "") != "none" else 1
    )
