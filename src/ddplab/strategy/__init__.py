"""Strategies: none | dp | ddp | fsdp, one class each, chosen once by :func:`make`.

The only place that maps ``distributed.strategy`` to behaviour; see
:mod:`ddplab.strategy.base` for what a strategy owns.
"""

from __future__ import annotations

from omegaconf import DictConfig

from ddplab.runtime.group import Dist
from ddplab.strategy.base import Strategy
from ddplab.strategy.ddp import DDPStrategy
from ddplab.strategy.fsdp import FSDPStrategy
from ddplab.strategy.local import DataParallel, Local

__all__ = ["Strategy", "make", "check_launch", "ranks_started", "rank_imports"]

_CLASSES: dict[str, type[Strategy]] = {c.name: c for c in (Local, DataParallel, DDPStrategy, FSDPStrategy)}


def _class(cfg: DictConfig) -> type[Strategy]:
    return _CLASSES[str(cfg.distributed.strategy)]


def check_launch(cfg: DictConfig, world_size: int) -> None:
    """The configured strategy's refusals, before any process group exists."""
    _class(cfg).refuse(cfg, world_size)


def saves_one_file(cfg: DictConfig) -> bool:
    """Whether the configured strategy's checkpoints are one ``.pt`` each (not a folder of shards)."""
    return _class(cfg).one_file_checkpoints


def ranks_started(cfg: DictConfig) -> int:
    """The ranks a job with this config starts by itself, without a launcher: a one-process strategy
    runs one (it refuses any other distributed.nproc_per_node), the others distributed.nproc_per_node."""
    return 1 if _class(cfg).one_process else int(cfg.distributed.nproc_per_node)


def make(cfg: DictConfig, dist: Dist) -> Strategy:
    """The strategy this job runs: the configured one, or ``none`` when a multi-process
    strategy finds itself on one process (nothing to reduce or shard)."""
    cls = _class(cfg)
    if not dist.is_distributed and not cls.one_process:
        cls = Local
    return cls(cfg, dist)


def rank_imports(cfg: DictConfig) -> tuple[str, ...]:
    """What each rank of this job imports whatever it trains: the strategy's needs, and torch's compiler
    stack where the model is compiled."""
    return _class(cfg).rank_imports + (("torch._dynamo",) if cfg.perf.compile else ())
