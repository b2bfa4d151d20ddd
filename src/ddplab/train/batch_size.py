"""Batch arithmetic, said once: what ``batch_size``, ``batch_size_scope`` and ``grad_accum_steps`` mean
in samples. The sampler splits a global micro-batch over the ranks (``data.sampling``); everything else
asks here.

    micro-batch (global)  = batch_size x (world_size if batch_size_scope=per_rank else 1)
    optimizer step        = micro-batch x grad_accum_steps
"""

from __future__ import annotations

from typing import Any

from ddplab.config import ConfigError


def micro_batch(batch_size: int, scope: str, world_size: int) -> int:
    """Samples of one micro-step over all ranks."""
    return int(batch_size) * (world_size if scope == "per_rank" else 1)


def per_step(batch_size: int, scope: str, world_size: int, accum: int) -> int:
    """Samples of one optimizer step over all ranks."""
    return micro_batch(batch_size, scope, world_size) * int(accum)


def global_batch_size(cfg: Any, world_size: int, exact: bool = True) -> int:
    """``cfg``'s global micro-batch on ``world_size`` ranks. Training needs it to split evenly over the
    ranks (ConfigError with the fix otherwise); ``exact=False`` (evaluation only) rounds it to split."""
    gb = micro_batch(cfg.batch_size, cfg.batch_size_scope, world_size)
    if gb % world_size and not exact:
        return max(world_size, gb // world_size * world_size)
    if gb % world_size:
        raise ConfigError(
            f"batch_size={cfg.batch_size} (global) does not split evenly over {world_size} ranks. "
            f"Fix: pass batch_size={max(world_size, gb // world_size * world_size)} "
            "or batch_size_scope=per_rank."
        )
    return gb
