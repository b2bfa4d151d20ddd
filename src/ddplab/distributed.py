"""Everything rank-related: the ONLY module that reads the launcher's environment.

Launch forms it understands::

    python train.py                                      # one process, no group
    torchrun --standalone --nproc_per_node=2 train.py    # RANK/LOCAL_RANK/WORLD_SIZE set
    python -m torch.distributed.launch ... train.py      # legacy: --local-rank=N in argv

The trainer gets a :class:`DistState` and calls the small named collectives
below; it never looks at environment variables or ``dist`` directly.
"""

from __future__ import annotations

import os
import re
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistState:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str | None = None  # None: single process, no process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def env_rank() -> int:
    """Global rank from the launcher's environment (0 when not launched)."""
    return int(os.environ.get("RANK", "0"))


def consume_legacy_local_rank(argv: list[str]) -> list[str]:
    """Strip ``--local-rank=N`` / ``--local_rank N`` that torch.distributed.launch appends.

    Hydra would reject them as overrides; the value goes to LOCAL_RANK, where
    torchrun would have put it.
    """
    out, i = [], 0
    while i < len(argv):
        m = re.fullmatch(r"--local[-_]rank(?:=(\d+))?", argv[i])
        if m:
            value = m.group(1)
            if value is None and i + 1 < len(argv):
                value, i = argv[i + 1], i + 1
            if value is not None:
                os.environ.setdefault("LOCAL_RANK", value)
        else:
            out.append(argv[i])
        i += 1
    return out


def _pick_device(kind: str, local_rank: int) -> torch.device:
    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError(
                "distributed.device=cuda but torch sees no CUDA GPU "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}). "
                "Fix: use distributed.device=auto or cpu, or install a CUDA build of torch."
            )
        n = torch.cuda.device_count()
        if local_rank >= n:
            raise RuntimeError(
                f"LOCAL_RANK={local_rank} but only {n} CUDA device(s) are visible. "
                f"Fix: launch at most {n} processes per node (--nproc_per_node={n})."
            )
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def setup(cfg: Any) -> DistState:
    """Join the process group described by the environment and ``cfg`` (conf/distributed)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = env_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _pick_device(cfg.device, local_rank)
    if device.type == "cuda":
        # Before any CUDA work: otherwise every rank creates a context on GPU 0.
        torch.cuda.set_device(device)
    if world_size == 1:
        return DistState(device=device)

    backend = cfg.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise RuntimeError("distributed.backend=nccl needs CUDA devices. Fix: distributed.backend=auto or gloo.")
    kwargs: dict[str, Any] = dict(backend=backend, timeout=timedelta(seconds=cfg.timeout_s))
    if cfg.init_method != "env://":
        kwargs.update(init_method=cfg.init_method, rank=rank, world_size=world_size)
        # Under torchrun this flag makes rank 0 a *client* of a store it expects
        # torchrun to host on that port, so tcp:// would wait for nobody.
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    if backend == "nccl":
        kwargs["device_id"] = device  # binds this rank's GPU; no stray contexts elsewhere
    try:
        dist.init_process_group(**kwargs)
    except Exception as e:  # name what was tried and what to change
        msg = str(e)
        hint = ""
        if "address already in use" in msg.lower() or "EADDRINUSE" in msg:
            hint = (" The port is taken (another job, or a leftover process): use torchrun --standalone, "
                    "or pick a free port (--master_port / the port in init_method).")
        elif "timed out" in msg.lower() or "timeout" in msg.lower():
            hint = (f" Not all {world_size} ranks arrived within distributed.timeout_s={cfg.timeout_s}: "
                    "check that every process/node was started with the same WORLD_SIZE and address.")
        raise RuntimeError(
            f"rank {rank}/{world_size}: could not join the process group "
            f"(backend={backend}, init_method={cfg.init_method}, timeout={cfg.timeout_s}s): {msg}.{hint}"
        ) from e
    return DistState(rank=rank, local_rank=local_rank, world_size=world_size, device=device, backend=backend)


def teardown(clean: bool = True) -> None:
    """Leave the process group. ``clean``: every rank got here normally, so wait
    for all of them first — a rank that tears down while a peer is still in its
    last collective can abort the peer. After a failure, never wait (it would hang)."""
    if dist.is_available() and dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()


# ---------------------------------------------------------------- collectives
def broadcast_object(obj: Any, state: DistState) -> Any:
    """Rank 0's ``obj`` on every rank (small picklable things: paths, decisions)."""
    if not state.is_distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_ranks_rows(row: torch.Tensor, state: DistState) -> torch.Tensor:
    """(world_size, K) matrix of every rank's ``row`` — ONE collective.

    Each rank writes its row into a zero matrix and the matrices are summed.
    From the result a caller takes sums, maxima and minima over ranks at once,
    where separate SUM/MAX/MIN all_reduces would cost three round trips; for
    the handful of numbers logged per interval the extra bytes are free.
    """
    if not state.is_distributed:
        return row.unsqueeze(0)
    rows = torch.zeros(state.world_size, row.numel(), dtype=row.dtype, device=row.device)
    rows[state.rank] = row
    dist.all_reduce(rows, op=dist.ReduceOp.SUM)
    return rows


def barrier(state: DistState) -> None:
    if state.is_distributed:
        dist.barrier()


def broadcast_buffers(module: torch.nn.Module, state: DistState) -> None:
    """Give every rank rank 0's floating-point buffers (BN running stats) in one broadcast."""
    bufs = [b for b in module.buffers() if b.is_floating_point()]
    if not state.is_distributed or not bufs:
        return
    flat = torch.cat([b.reshape(-1).to(torch.float64) for b in bufs])
    dist.broadcast(flat, src=0)
    for b, v in zip(bufs, flat.split([b.numel() for b in bufs])):
        b.copy_(v.view_as(b))


def rank_table(state: DistState) -> str:
    """"rank@host:device(local_rank)" for every rank, gathered once at start-up (rank order check)."""
    me = f"{state.rank}@{socket.gethostname()}:{state.device}(local {state.local_rank})"
    if not state.is_distributed:
        return me
    everyone: list[str] = [""] * state.world_size
    dist.all_gather_object(everyone, me)
    return ", ".join(everyone)


def _is_timeout(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}".lower()
    return "timed out" in text or "timeout" in text


def describe_failure(state: DistState, exc: BaseException, where: str, job_key: str, timeout_s: float) -> str:
    """A one-paragraph account of why this rank stopped, naming the rank(s) at fault where possible.

    Each failing rank leaves a note in the rendezvous store (no collective: the
    group may be broken). A rank whose collective timed out waits briefly for
    the others' notes; ranks that left none never reached the collective —
    hung, dead or far slower — and are named.
    """
    msg = f"rank {state.rank}/{state.world_size} failed {where}: {type(exc).__name__}: {exc}"
    if not (state.is_distributed and dist.is_initialized()):
        return msg
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"ddplab/{job_key}/failed/{state.rank}", msg)
        if _is_timeout(exc):
            time.sleep(min(3.0, timeout_s / 4))  # let the other waiting ranks time out and report
            silent = [r for r in range(state.world_size)
                      if not store.check([f"ddplab/{job_key}/failed/{r}"])]
            msg += (f"\n  A collective timed out after distributed.timeout_s={timeout_s}s. "
                    f"Rank(s) {silent} never reached it: hung, dead or far slower than the rest "
                    "(a stuck data loader, a deadlock, a rank-dependent branch that skips a collective).")
    except Exception:  # the store may be gone too; the plain message still stands
        pass
    return msg
