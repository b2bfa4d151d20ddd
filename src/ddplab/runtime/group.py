"""The process group: join it from the launcher's environment, describe a failure, leave it.

The Session is the only caller of :func:`init` and :func:`teardown`; every
other module gets the resulting :class:`Dist` and the named helpers of
:mod:`ddplab.runtime.collectives`, never ``torch.distributed`` state directly.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as torch_dist

from ddplab import compat
from ddplab.runtime import env, signals
from ddplab.runtime import teardown as process_exit
from ddplab.runtime.signals import Preempted
from ddplab.runtime.watch import deadline

log = logging.getLogger("ddplab")

_generation = 0  # process groups this process has created (the same count on every rank)


@dataclass(frozen=True)
class Dist:
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


def refusal(cfg: Any) -> str | None:
    """What in conf/distributed cannot work on this machine, whatever the world size (one process
    included), said before any process group forms; None when nothing."""
    cuda = torch.cuda.is_available()
    if cfg.device == "cuda" and not cuda:
        return (
            "distributed.device=cuda but torch sees no CUDA GPU "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}). "
            "Fix: use distributed.device=auto or cpu, or install a CUDA build of torch"
        )
    if cfg.backend == "nccl" and (cfg.device == "cpu" or not cuda):
        return (
            "distributed.backend=nccl needs CUDA devices "
            f"({'distributed.device=cpu' if cuda else 'torch sees none'})"
            ". Fix: distributed.backend=auto or gloo"
        )
    return None


def _pick_device(kind: str, local_rank: int) -> torch.device:
    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        n = torch.cuda.device_count()
        if local_rank >= n and n == 1 and env.srun_task():
            # srun --gpus-per-task=1: each task sees only its own GPU, as cuda:0
            return torch.device("cuda", 0)
        if local_rank >= n:
            raise RuntimeError(
                f"LOCAL_RANK={local_rank} but only {n} CUDA device(s) are visible. "
                f"Fix: launch at most {n} processes per node (--nproc_per_node={n})."
            )
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init(cfg: Any) -> Dist:
    """Join the process group described by the environment and ``cfg`` (conf/distributed)."""
    rank, world_size, local_rank = env.rank(), env.world_size(), env.local_rank()
    problem = refusal(cfg)  # ddplab.run asked first, as a config error; this is for direct callers
    if problem:
        raise RuntimeError(problem)
    device = _pick_device(cfg.device, local_rank)
    if device.type == "cuda":
        # Before any CUDA work: otherwise every rank creates a context on GPU 0.
        torch.cuda.set_device(device)
    if world_size == 1:
        return Dist(device=device)
    backend = cfg.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=cfg.timeout_s)
    env.use_own_store(cfg.init_method)
    global _generation
    _generation += 1
    where = env.master_address() if cfg.init_method == "env://" else cfg.init_method
    what = f"rank {rank}/{world_size}: waiting for all {world_size} ranks to join at {where}"
    try:
        with deadline(what, cfg.timeout_s):
            store, rank, world_size = _interruptible(
                lambda: _rendezvous(cfg.init_method, rank, world_size, timeout), what
            )
        # A sweep under torchrun runs several jobs in one process, all on
        # torchrun's one store: a fresh key prefix per job keeps a new group
        # from reading the previous group's (dead) addresses and hanging.
        # torchrun's store also outlives a restart (--max-restarts): the restart count joins the prefix.
        store = torch_dist.PrefixStore(f"ddplab/{env.elastic_restart_count()}/{_generation}", store)
        with deadline(what, cfg.timeout_s):
            _interruptible(
                lambda: torch_dist.init_process_group(
                    backend,
                    store=store,
                    rank=rank,
                    world_size=world_size,
                    timeout=timeout,
                    **({"device_id": device} if backend == "nccl" else {}),
                ),
                what,
            )
    except Preempted:
        raise
    except Exception as e:  # name what was tried and what to change
        raise RuntimeError(
            f"rank {rank}/{world_size}: could not join the process group (backend={backend}, "
            f"init_method={cfg.init_method}, timeout={cfg.timeout_s}s): {e}."
            f"{_join_hint(str(e), world_size, cfg.timeout_s)}"
        ) from e
    process_exit.drop_held()  # the previous group (a sweep's or study's last job): idle since the join
    return Dist(rank=rank, local_rank=local_rank, world_size=world_size, device=device, backend=backend)


def _interruptible(join: Callable[[], Any], what: str) -> Any:
    """``join()`` — a wait for the other ranks inside torch's C++, which no signal interrupts — on a helper
    thread, while this one waits in Python, where signal handlers run: a stop signal that arrives meanwhile
    (the held ones: at start-up, between a study's trials) or a dead launcher ends the wait at once (nothing
    trained since the last checkpoint: nothing to save). It used to wait on until the launcher's SIGKILL,
    which skips every cleanup, or until distributed.timeout_s."""
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            box["value"] = join()
        except BaseException as e:  # handed to the waiting thread as it is
            box["error"] = e

    # a signal of start-up: the job joins, then stops at its first step with a checkpoint
    earlier = signals.held()
    helper = threading.Thread(target=body, name="ddplab-join", daemon=True)
    helper.start()
    while helper.is_alive():
        helper.join(JOIN_POLL_S)
        gone, now = env.launcher_gone(), signals.held()
        why = (now if now != earlier else None) or (
            f"launcher died (pid {gone})" if gone is not None else None
        )
        if why and helper.is_alive():
            log.warning("%s: %s: leaving (nothing to checkpoint)", what, why)
            raise Preempted(why, -1, None)
    if "error" in box:
        raise box["error"]
    return box.get("value")


JOIN_POLL_S = 0.2  # how soon a stop signal ends a wait for the other ranks
_KEPT: dict[tuple[Any, ...], Any] = {}  # the rendezvous store this process made, by where it rendezvoused


def _rendezvous(init_method: str, rank: int, world_size: int, timeout: timedelta) -> tuple[Any, int, int]:
    """The rendezvous store, made once per process and kept for every later group (a study worker's, a
    sweep's). Without torchrun's agent (srun, submitit, tcp://) rank 0 serves the store itself on a fixed
    port: made anew for each group, a peer that is quicker to the next group than rank 0 connects to the
    server rank 0 is still closing and fails ("Failed to recv, got 0 bytes"), leaving rank 0 waiting for it.
    Groups of one process are told apart by the key prefix init gives each (``_generation``)."""
    key = (init_method, env.master_address(), rank, world_size)
    if key not in _KEPT:
        store, rank, world_size = next(
            torch_dist.rendezvous(init_method, rank=rank, world_size=world_size, timeout=timeout)
        )
        _KEPT[key] = store
    return _KEPT[key], rank, world_size


def _join_hint(msg: str, world_size: int, timeout_s: float) -> str:
    if "address already in use" in msg.lower() or "EADDRINUSE" in msg:
        return (
            " The port is taken (another job, or a leftover process): use torchrun --standalone, "
            "or pick a free port (--master_port / the port in init_method)."
        )
    if "timed out" in msg.lower() or "timeout" in msg.lower():
        return (
            f" Not all {world_size} ranks arrived within distributed.timeout_s={timeout_s}: "
            "check that every process/node was started with the same WORLD_SIZE and address."
        )
    return ""


def teardown(clean: bool = True) -> None:
    """Leave the process group. ``clean``: every rank got here normally, so wait
    for all of them first — a rank that tears down while a peer is still in its
    last collective can abort the peer. After a failure, never wait (it would hang)."""
    if torch_dist.is_available() and torch_dist.is_initialized():
        if clean:
            torch_dist.barrier()
        # Whoever drops the group last runs its destructor, which joins gloo's worker threads. DDP's reducer
        # holds it from C++ and drops it with the GIL held (at the exit's collection, or wherever the trainer
        # goes); a worker still releasing its last collective's tensors needs the GIL: both wait forever
        # (seen in CI at exit, 1 run in hundreds). The group's Python object releases the GIL as it goes:
        # held here past the reducer, it is the last.
        process_exit.hold_past_collection(torch_dist.group.WORLD)
        torch_dist.destroy_process_group()


def _is_timeout(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}".lower()
    return "timed out" in text or "timeout" in text


class PeerFailed(RuntimeError):
    """This rank lost its connection to a rank that failed first: no error of its own. The Session has said so
    in one line and recorded the peer's error (``report``, the job's first real error); nothing more to show
    (no traceback)."""

    def __init__(self, said: str, report: str):
        super().__init__(said)
        self.report = report


class PeerLost(PeerFailed):
    """This rank lost its connection to a rank that said nothing: that rank was killed (SIGKILL, the OOM
    killer) or cut off. Said in one line like :class:`PeerFailed`; a study counts it as the trial's death."""


# A rank that only lost its peer leaves this much after it, so that its launcher (torchrun's agent, the
# self-launch parent) sees the rank at fault exit first and names it, not this one.
PEER_EXIT_GRACE_S = 3.0


# How a collective ends on the ranks still in it when a peer's process goes away (gloo, NCCL).
_LOST_PEER = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "remote process exited",
    "communicator was aborted",
)
_WORKER = re.compile(r"^Caught \w+ in DataLoader worker process (\d+)\.\nOriginal Traceback")


def plain_message(exc: BaseException) -> str:
    """``exc``'s message. torch re-raises a DataLoader worker's error as the same type with the worker's
    whole traceback as its message; of that, the original message (its last line) and which worker."""
    text = str(exc)
    worker = _WORKER.match(text)
    cls = type(exc)
    name = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    at = text.rfind(f"\n{name}: ") if worker else -1
    if at < 0:
        return text
    return f"{text[at + len(name) + 3 :].rstrip()} (in DataLoader worker {worker.group(1)})"


def describe_failure(
    dist: Dist,
    exc: BaseException,
    where: str,
    job_key: str,
    timeout_s: float,
    hosts: dict[int, str] | None = None,
) -> tuple[str, str, bool]:
    """Why the job stopped, as seen from this rank: (the job's first real error, for result.json; what this
    rank says; whether it only lost a peer that said nothing). Usually the same one paragraph, naming the
    rank(s) at fault where possible.

    Each failing rank leaves a note in the rendezvous store (no collective: the group may be broken). A rank
    whose collective timed out waits briefly for the others' notes; ranks that left none never reached the
    collective — hung, dead, cut off or far slower — and are named, with their hosts (``hosts``: rank -> host,
    from the start-up rank table): across machines, a silent host is the first thing to look at. A rank that
    only lost its connection to a peer records the note of the rank that failed first, and says one line."""
    msg = f"rank {dist.rank}/{dist.world_size} failed {where}: {type(exc).__name__}: {plain_message(exc)}"
    if not (dist.is_distributed and torch_dist.is_initialized()):
        return msg, msg, False
    lost = any(s in str(exc).lower() for s in _LOST_PEER)
    found: list[list[int]] = []  # the ranks that noted nothing, for a timeout
    first: list[tuple[int, str]] = []  # the rank that failed first and its report, for a lost connection
    answered = _noted(dist, job_key, msg, lost, _is_timeout(exc), timeout_s, found, first)
    if first:
        peer, report = first[0]
        return (
            report,
            (
                f"rank {dist.rank}/{dist.world_size} stopped {where}: lost its connection to rank {peer}, "
                "which failed first (its error is above, and in result.json)"
            ),
            False,
        )
    if lost and answered:  # the store answered, and no rank noted an error: one died without a word
        said = (
            f"rank {dist.rank}/{dist.world_size} stopped {where}: lost its connection to a rank that said "
            f"nothing: killed (SIGKILL, the OOM killer) or cut off ({plain_message(exc)[:200]})"
        )
        return said, said, True
    if found:
        silent = found[0]
        on = ", ".join(f"rank {r} on {hosts[r]}" for r in silent if hosts and r in hosts)
        msg += (
            f"\n  A collective timed out after distributed.timeout_s={timeout_s}s. "
            f"Rank(s) {silent} never reached it{f' ({on})' if on else ''}: hung, dead, cut off from the "
            "network or far slower than the rest (a stuck data loader, a deadlock, a rank-dependent "
            "branch that skips a collective, a host whose link is down)."
        )
    elif not answered:
        msg += "\n  The job's store (on rank 0's host) did not answer: is this host cut off from it?"
    return msg, msg, False


def _noted(
    dist: Dist,
    job_key: str,
    msg: str,
    lost: bool,
    timed_out: bool,
    timeout_s: float,
    found: list[list[int]],
    first: list[tuple[int, str]],
) -> bool:
    """:func:`_note` in a thread, waited for a bounded time: the store lives on rank 0's host, and a rank cut
    off from it (its host's link is down) would block in the store's socket until the link came back. Whether
    the store answered in that time."""
    worker = threading.Thread(
        target=_note,
        args=(dist, job_key, msg, lost, timed_out, timeout_s, found, first),
        name="ddplab-failure-notes",
        daemon=True,
    )
    worker.start()
    worker.join(min(3.0, timeout_s / 4) + 5.0)
    return not worker.is_alive()


def _note(
    dist: Dist,
    job_key: str,
    msg: str,
    lost: bool,
    timed_out: bool,
    timeout_s: float,
    found: list[list[int]],
    first: list[tuple[int, str]],
) -> None:
    """This rank's note in the store; then, for a lost connection, the first real failure another rank noted
    (into ``first``), or for a timeout, the ranks that noted nothing (into ``found``)."""
    try:
        store = compat.default_store()
        store.set(
            f"ddplab/{job_key}/failed/{dist.rank}", json.dumps({"msg": msg, "lost": lost, "t": time.time()})
        )
        if not lost:  # the first real failure to get here is the job's: one key, whatever the world size
            store.compare_set(f"ddplab/{job_key}/first", "", json.dumps({"rank": dist.rank, "msg": msg}))
        if lost:
            first.extend(_first_real_failure(store, job_key))
        elif timed_out:
            time.sleep(min(3.0, timeout_s / 4))  # let the other waiting ranks time out and report
            found.append(
                [r for r in range(dist.world_size) if not store.check([f"ddplab/{job_key}/failed/{r}"])]
            )
    except Exception:  # the store may be gone too; the plain message still stands
        pass


def _first_real_failure(store: Any, job_key: str, wait_s: float = 2.0) -> list[tuple[int, str]]:
    """[(rank, its report)] of the first failure another rank noted that is not a lost connection itself;
    waited for up to ``wait_s`` (the peer notes before it leaves, but a rank may see the loss first). One
    key and one blocking wait per rank, so a rank dying in a large job costs the store O(ranks) requests."""
    import datetime

    key = f"ddplab/{job_key}/first"
    try:
        store.wait([key], datetime.timedelta(seconds=wait_s))
    except Exception:  # nobody noted a real failure in time (or the store went): this rank's own line stands
        return []
    note = json.loads(store.get(key))
    return [(int(note["rank"]), note["msg"])]
