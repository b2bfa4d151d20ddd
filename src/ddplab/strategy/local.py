"""distributed=none (one process, no wrapper) and distributed=dp (torch.nn.DataParallel).

Both run ONE process; DDP and FSDP at world size 1 run as ``none`` too
(nothing to reduce or shard), chosen once in :func:`ddplab.strategy.make`.
"""

from __future__ import annotations

import logging

import torch
from omegaconf import DictConfig
from torch import nn

from ddplab.config import ConfigError
from ddplab.strategy.base import Strategy

log = logging.getLogger("ddplab")


class Local(Strategy):
    name = "none"
    one_process = True

    @classmethod
    def refuse(cls, cfg: DictConfig, world_size: int) -> None:
        n = cfg.distributed.nproc_per_node
        if n != 1:
            raise ConfigError(
                f"distributed.nproc_per_node={n}: distributed={cls.name} runs one process. "
                "Fix: distributed=ddp (or fsdp) for several processes"
            )
        if world_size > 1:
            raise ConfigError(
                f"distributed.strategy={cls.name}: runs ONE process, but this one was launched as "
                f"one of {world_size} ranks. Fix: run `python train.py distributed={cls.name} ...` "
                "without torchrun, or use distributed=ddp (or fsdp) under torchrun"
            )


class DataParallel(Local):
    name = "dp"

    def wrap(self, module: nn.Module) -> nn.Module:
        gpus = torch.cuda.device_count() if self.dist.device.type == "cuda" else 0
        log.warning(
            "distributed=dp: torch.nn.DataParallel, one process over %d GPU(s) — it scatters every batch "
            "from and gathers outputs on GPU 0 in one Python thread. DistributedDataParallel is faster: "
            "torchrun --nproc_per_node=%d train.py (scripts/bench_dp_vs_ddp.py measures the gap)",
            gpus,
            max(gpus, 2),
        )
        return _DataParallel(self._compiled(module))  # on CPU (no GPUs) it simply calls the module


class _DataParallel(nn.DataParallel):
    """nn.DataParallel that keeps the caller's autocast dtype: torch runs each replica in a thread of its own
    under ``autocast(enabled=...)`` with no dtype, i.e. fp16 on CUDA, so bf16 training (what amp picks on
    Ampere and later) ran its replicas in fp16 with no GradScaler."""

    def parallel_apply(self, replicas, inputs, kwargs):  # type: ignore[override]
        dtype = torch.get_autocast_dtype("cuda")
        if torch.is_autocast_enabled("cuda"):
            replicas = [_InAutocast(r, dtype) for r in replicas]
        return super().parallel_apply(replicas, inputs, kwargs)


class _InAutocast(nn.Module):
    def __init__(self, replica: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.replica, self.dtype = replica, dtype

    def forward(self, *args, **kwargs):
        with torch.autocast("cuda", dtype=self.dtype):
            return self.replica(*args, **kwargs)
