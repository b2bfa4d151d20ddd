"""Everything rank-related: the ONLY module that reads the launcher's environment.

Launch forms it understands::

    python train.py                                      # one process, no group
    torchrun --standalone --nproc_per_node=2 train.py    # RANK/LOCAL_RANK/WORLD_SIZE set
    python -m torch.distributed.launch ... train.py      # legacy: --local-rank=N in argv

The trainer gets a :class:`DistState` and calls the small named collectives
below; it never looks at environment variables or ``dist`` directly.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import socket
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


_generation = 0  # process groups this process has created (the same count on every rank)


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


def _first_host(nodelist: str) -> str:
    """First host of a SLURM nodelist: "gpu[03-05,09],cpu1" -> "gpu03"."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not m:
        return "127.0.0.1"
    return m.group(1) + (re.split(r"[,-]", m.group(2))[0] if m.group(2) else "")


def adopt_scheduler_env() -> None:
    """Map SLURM's (srun / submitit_slurm) or submitit_local's task variables onto
    torch's RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT, so each task of a
    multi-task job becomes one rank. No-op when a torch launcher already set RANK."""
    env = os.environ
    if "RANK" in env:
        return
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:
        rank, world, local = env["SLURM_PROCID"], env["SLURM_NTASKS"], env.get("SLURM_LOCALID", "0")
        addr = _first_host(env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "127.0.0.1")))
        port = 10000 + int(env.get("SLURM_JOB_ID", "0")) % 20000  # same on every task of the job
    elif int(env.get("SUBMITIT_LOCAL_NTASKS", "1")) > 1 and "SUBMITIT_LOCAL_GLOBALID" in env:
        rank, world = env["SUBMITIT_LOCAL_GLOBALID"], env["SUBMITIT_LOCAL_NTASKS"]
        local, addr = env.get("SUBMITIT_LOCAL_LOCALID", "0"), "127.0.0.1"
        port = 10000 + int(env.get("SUBMITIT_LOCAL_JOB_ID", "0")) % 20000
    else:
        return
    env.update(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=local)
    env.setdefault("MASTER_ADDR", addr)
    env.setdefault("MASTER_PORT", str(port))


def env_rank() -> int:
    """Global rank from the launcher's environment (0 when not launched)."""
    adopt_scheduler_env()
    return int(os.environ.get("RANK", "0"))


def env_world_size() -> int:
    """World size from the launcher's environment (1 when not launched)."""
    adopt_scheduler_env()
    return int(os.environ.get("WORLD_SIZE", "1"))


SELF_LAUNCHED = "DDPLAB_SELF_LAUNCHED"  # set by ddplab.launch for the ranks it spawns


def is_self_launched() -> bool:
    return os.environ.get(SELF_LAUNCHED) == "1"


def elastic_restart_count() -> int:
    """How often torchrun (--max-restarts) has restarted this worker group (0: first start)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def run_dir_memo() -> Path | None:
    """Where rank 0 notes its run dir, so a torchrun restart continues in the same dir.

    Keyed by torchrun's run id and the agent's pid: both survive a restart,
    and no two torchrun invocations share them.
    """
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None:
        return None
    return Path(tempfile.gettempdir()) / f"ddplab-run-{run_id}-{os.getppid()}"


def is_launched() -> bool:
    """True when a launcher (torchrun, SLURM, submitit) made this process one of several ranks."""
    adopt_scheduler_env()
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


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
    rank = env_rank()
    world_size = env_world_size()
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
    timeout = timedelta(seconds=cfg.timeout_s)
    if cfg.init_method != "env://":
        # Under torchrun this flag makes rank 0 a *client* of a store it expects
        # torchrun to host on that port, so tcp:// would wait for nobody.
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    global _generation
    _generation += 1
    try:
        store, rank, world_size = next(dist.rendezvous(cfg.init_method, rank=rank, world_size=world_size,
                                                       timeout=timeout))
        # A sweep under torchrun runs several jobs in one process, all on
        # torchrun's one store: a fresh key prefix per job keeps a new group
        # from reading the previous group's (dead) addresses and hanging.
        # torchrun's store also outlives a restart (--max-restarts): the restart count joins the prefix.
        store = dist.PrefixStore(f"ddplab/{elastic_restart_count()}/{_generation}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                                **({"device_id": device} if backend == "nccl" else {}))
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


def gather_object(obj: Any, state: DistState) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank (checkpoint-time only)."""
    if not state.is_distributed:
        return [obj]
    out: list[Any] = [None] * state.world_size
    dist.all_gather_object(out, obj)
    return out


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
    """Give every rank rank 0's floating-point buffers (BN running stats) in one broadcast.

    A module (or submodule) with a ``synced_state()`` method adds the tensors it
    names: Keras keeps BN moving statistics as non-trainable parameters, not buffers.
    """
    extra = [t for m in module.modules() if hasattr(m, "synced_state") for t in m.synced_state()]
    bufs = [b for b in [*module.buffers(), *extra] if b.is_floating_point()]
    if not state.is_distributed or not bufs:
        return
    flat = torch.cat([b.reshape(-1).to(torch.float64) for b in bufs])
    dist.broadcast(flat, src=0)
    with torch.no_grad():
        for b, v in zip(bufs, flat.split([b.numel() for b in bufs])):
            b.copy_(v.view_as(b))


def rank_table(state: DistState, digest: str = "") -> str:
    """"rank@host:device(local_rank) cfg=digest" for every rank, gathered once at start-up."""
    me = f"{state.rank}@{socket.gethostname()}:{state.device}(local {state.local_rank})"
    me += f" cfg={digest}" if digest else ""
    return ", ".join(gather_object(me, state))


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


def sync_config(cfg: Any, state: DistState) -> Any:
    """Every rank trains rank 0's config.

    A sweeper running in every rank (Optuna under torchrun) may sample
    different values per rank; training on them would silently diverge or die
    on a shape mismatch. Differences are named in a warning.
    """
    from omegaconf import OmegaConf

    mine = OmegaConf.to_container(cfg, resolve=True)
    if not state.is_distributed:
        return cfg
    ref = broadcast_object(mine, state)
    if ref != mine:
        diff = sorted(k for k in _flatten(ref).keys() | _flatten(mine).keys()
                      if _flatten(ref).get(k) != _flatten(mine).get(k))
        logging.getLogger("ddplab").warning(
            "rank %d: this rank was given a different config than rank 0 (%s); using rank 0's",
            state.rank, ", ".join(f"{k}={_flatten(mine).get(k)!r}->{_flatten(ref).get(k)!r}" for k in diff))
    out = OmegaConf.create(ref)
    OmegaConf.set_struct(out, True)
    return out


def config_digest(cfg: Any) -> str:
    """Short hash of the resolved config: equal on all ranks iff they train the same thing."""
    from omegaconf import OmegaConf

    return hashlib.sha1(OmegaConf.to_yaml(cfg, resolve=True).encode()).hexdigest()[:10]


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}." if isinstance(v, dict) else f"{prefix}{k}"))
    return out
