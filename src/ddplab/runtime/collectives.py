"""Small named collectives over the job's process group; each is a no-op on one process.

Called with the :class:`~ddplab.runtime.group.Dist` the Session built,
so a caller never asks ``torch.distributed`` whether a group exists.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
from typing import Any

import torch
import torch.distributed as torch_dist

from ddplab.runtime.group import Dist


def broadcast_object(obj: Any, dist: Dist) -> Any:
    """Rank 0's ``obj`` on every rank (small picklable things: paths, decisions)."""
    if not dist.is_distributed:
        return obj
    box = [obj]
    torch_dist.broadcast_object_list(box, src=0)
    return box[0]


def side_group(dist: Dist) -> Any:
    """A second gloo group over every rank, for collectives a background thread runs (an asynchronous
    sharded checkpoint) while the loop runs its own on the job's group: two threads sharing one group
    would interleave their collectives. Collective to create; None on one process."""
    if not dist.is_distributed:
        return None
    return torch_dist.new_group(backend="gloo")


def gather_object(obj: Any, dist: Dist) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank (checkpoint-time only)."""
    if not dist.is_distributed:
        return [obj]
    out: list[Any] = [None] * dist.world_size
    torch_dist.all_gather_object(out, obj)
    return out


def all_ranks_rows(row: torch.Tensor, dist: Dist) -> torch.Tensor:
    """(world_size, K) matrix of every rank's ``row`` — ONE collective.

    Each rank writes its row into a zero matrix and the matrices are summed.
    From the result a caller takes sums, maxima and minima over ranks at once,
    where separate SUM/MAX/MIN all_reduces would cost three round trips; for
    the handful of numbers logged per interval the extra bytes are free.
    """
    if not dist.is_distributed:
        return row.unsqueeze(0)
    rows = torch.zeros(dist.world_size, row.numel(), dtype=row.dtype, device=row.device)
    rows[dist.rank] = row
    torch_dist.all_reduce(rows, op=torch_dist.ReduceOp.SUM)
    return rows


def all_ranks_values(values: list[float], dist: Dist) -> list[list[float]]:
    """Every rank's ``values`` (float64), a list per rank: :func:`all_ranks_rows` for numbers the host
    holds; a single process needs no tensor at all."""
    if not dist.is_distributed:
        return [list(values)]
    row = torch.tensor(values, dtype=torch.float64, device=dist.device)
    return all_ranks_rows(row, dist).tolist()


def any_rank(flag: bool | torch.Tensor, dist: Dist) -> bool:
    """True on every rank if ``flag`` is true on any rank (one tiny collective and a host read)."""
    t = torch.as_tensor(flag, dtype=torch.float32, device=dist.device).reshape(1)
    return bool(all_ranks_rows(t, dist).sum().item() > 0)


def barrier(dist: Dist) -> None:
    if dist.is_distributed:
        torch_dist.barrier()


def broadcast_buffers(module: torch.nn.Module, dist: Dist) -> None:
    """Give every rank rank 0's floating-point buffers (BN running stats) in one broadcast.

    A module (or submodule) with a ``synced_state()`` method adds the tensors it
    names: Keras keeps BN moving statistics as non-trainable parameters, not buffers.
    """
    extra = [t for m in module.modules() if hasattr(m, "synced_state") for t in m.synced_state()]
    bufs = [b for b in [*module.buffers(), *extra] if b.is_floating_point()]
    if not dist.is_distributed or not bufs:
        return
    flat = torch.cat([b.reshape(-1).to(torch.float64) for b in bufs])
    torch_dist.broadcast(flat, src=0)
    with torch.no_grad():
        for b, v in zip(bufs, flat.split([b.numel() for b in bufs])):
            b.copy_(v.view_as(b))


def rank_table(dist: Dist, digest: str = "") -> tuple[str, list[dict[str, Any]]]:
    """Every rank's host, device, local rank, pid and config digest — gathered once at start-up —
    as the "rank@host:device(local_rank) cfg=digest" line and as rows (for provenance)."""
    me = {
        "rank": dist.rank,
        "local_rank": dist.local_rank,
        "host": socket.gethostname(),
        "device": str(dist.device),
        "pid": os.getpid(),
        "config_digest": digest,
    }
    rows = gather_object(me, dist)
    text = ", ".join(
        f"{r['rank']}@{r['host']}:{r['device']}(local {r['local_rank']})"
        + (f" cfg={r['config_digest']}" if r["config_digest"] else "")
        for r in rows
    )
    return text, rows


def sync_config(cfg: Any, dist: Dist) -> Any:
    """Every rank trains rank 0's config.

    A sweeper running in every rank (Optuna under torchrun) may sample
    different values per rank; training on them would silently diverge or die
    on a shape mismatch. Differences are named in a warning.
    """
    from omegaconf import OmegaConf

    from ddplab.config import drift
    from ddplab.config.typed import resolved_copy, typed

    mine = OmegaConf.to_container(cfg, resolve=True)  # also fails early on a bad interpolation
    if not dist.is_distributed:
        return cfg
    ref = broadcast_object(mine, dist)
    if ref == mine:
        return resolved_copy(cfg)  # rank 0's values, this rank's types
    a, b = drift.flatten(ref), drift.flatten(mine)
    diff = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    logging.getLogger("ddplab").warning(
        "rank %d: this rank was given a different config than rank 0 (%s); using rank 0's",
        dist.rank,
        ", ".join(f"{k}={b.get(k)!r}->{a.get(k)!r}" for k in diff),
    )
    return typed(ref, "rank 0's config")


def rank_config_digest(cfg: Any) -> str:
    """Short hash of the WHOLE resolved config, harmless keys too, for the rank table: equal on all ranks
    iff each was handed the same config. (Resuming compares ``drift.trajectory_digest``: only the keys
    that change what a run computes.)"""
    from omegaconf import OmegaConf

    return hashlib.sha1(OmegaConf.to_yaml(cfg, resolve=True).encode()).hexdigest()[:10]
