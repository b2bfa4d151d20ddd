"""Every private torch (and Optuna, Hydra, Python) API ddplab relies on, in one place.

Each is a leading-underscore name torch may change or drop in any release. Keeping them here means a torch
upgrade breaks one module, and ``tests/integration/test_compat.py`` names which entry broke (each entry has a
test that calls it for real). Where a public equivalent appears, replace the body here and nothing else.

Each entry, the private API it uses, and why no public one serves:

* found_inf: ``GradScaler._found_inf_per_device`` — ``step()`` hides the flag
* set_last_lr: ``LRScheduler._last_lr`` — no setter for get_last_lr()
* default_store: ``distributed_c10d._get_default_store`` — the group hides its store
* cpu_capability: ``torch._C._cpu._get_cpu_capability`` — cpuinfo's ISA view
* agent_store_servers: ``DynamicRendezvousHandler._create_tcp_store_server`` — the agent binds the wildcard
* lerp_all_: ``torch._foreach_lerp_`` — one kernel per tensor else
* record/dump_cuda_memory: ``torch.cuda.memory._record_memory_history``, ``_dump_snapshot`` — documented,
  still private
* optuna_trial: ``Study._storage``, ``Study._study_id`` (trial id of a number) — ``Trial`` needs the id
* settle_ddp_buckets: ``DDP._module_parameters``, ``Reducer.prepare_for_backward``, ``._rebuild_buckets`` —
  layout fixed after a step
* rank_server: ``multiprocessing.forkserver._forkserver._stop`` (Python's) — one server a process, never
  stopped
* run_exit_handlers: ``atexit._run_exitfuncs`` (Python's) — a fork's exit skips atexit
* defer_dynamo: ``torch._compile._disable_dynamo``'s cache ``__dynamo_disable``,
  ``optimizer._use_grad_for_differentiable`` — both import dynamo
* ddp_reducer_without_dynamo: ``torch._dynamo.utils.get_optimize_ddp_mode`` (DDP's constructor calls it) — DDP
  imports dynamo
* loader_workers, stream_state: torchdata ``StatefulDataLoader.state_dict()``'s ``_snapshot`` layout — the
  format is undocumented
* BatchNormBase: ``torch.nn.modules.batchnorm._BatchNorm`` — BatchNorm1d/2d/3d's base
* answer_hydra_mode: ``hydra._internal.hydra.Hydra.get_mode`` (``@hydra.main`` composes once more to read it)
  — no hook
"""

from __future__ import annotations

import contextlib
import importlib.abc
from collections.abc import Callable, Iterator
from typing import Any

import torch

BatchNormBase = torch.nn.modules.batchnorm._BatchNorm  # what BatchNorm1d/2d/3d and SyncBatchNorm subclass


def found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The per-device inf/nan flags ``scaler.unscale_(optimizer)`` just set, as device tensors: reading them
    needs no host sync (``scaler.step`` would only skip the step silently)."""
    return list(scaler._found_inf_per_device(optimizer).values())


def set_last_lr(scheduler: Any, lrs: list[float]) -> None:
    """What ``scheduler.get_last_lr()`` reports, after ddplab set the groups' lr itself (a resume whose
    config changed the lr recomputes it without stepping the scheduler)."""
    scheduler._last_lr = list(lrs)


def default_store() -> Any:
    """The default process group's store (the rendezvous key-value store), or None without a group."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store() if dist.is_initialized() else None


def cpu_capability() -> set[str]:
    """ISA features torch's cpuinfo sees on this CPU (lower case, e.g. ``avx512_bf16``, ``amx_bf16``)."""
    return {k.lower() for k, v in torch._C._cpu._get_cpu_capability().items() if v is True}


@contextlib.contextmanager
def agent_store_servers(make: Callable[[str, int], Any]) -> Iterator[None]:
    """While inside, torchrun's elastic agent builds the ranks' store server with ``make(host, port)``
    instead of its own (which listens on every interface). A torch without the hook: unchanged."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    handler = dr.DynamicRendezvousHandler
    original = handler.__dict__.get("_create_tcp_store_server")
    if original is not None:
        handler._create_tcp_store_server = lambda self, addr, port: make(addr, port)  # type: ignore
    try:
        yield
    finally:
        if original is not None:
            handler._create_tcp_store_server = original  # type: ignore[method-assign]


@contextlib.contextmanager
def rank_server(preload: list[str], held: tuple[int, ...]) -> Iterator[str]:
    """The start method for a self-launch's ranks: ``"forkserver"``, a server of this launch's own that
    imported ``preload`` once (each rank is a fork of it: no interpreter start and no imports of its own),
    or ``"spawn"`` where Python has no server to manage. multiprocessing keeps one server a process and
    never stops it: it is stopped before (one an earlier job started holds that job's environment) and
    after (it would outlive the job). The server starts ignoring ``held``, so a stop signal sent to the
    whole process group or job step never ends it (its ranks' exit codes would be lost with it); its forks
    inherit that (and the mask, in part), and set their own."""
    import multiprocessing
    import signal
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    if "forkserver" not in multiprocessing.get_all_start_methods() or not hasattr(server, "_stop"):
        yield "spawn"
        return
    server._stop()
    forkserver.set_forkserver_preload(preload)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, held)  # one sent to this process meanwhile stays pending
    handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in held}  # what the server's start inherits
    try:
        forkserver.ensure_running()
        started = True
    except OSError:  # its socket lives in TMPDIR: a path over the 107 bytes of an AF_UNIX address cannot
        started = False  # (seen with a test's TMPDIR); the ranks start as spawned interpreters instead
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # and is delivered now, to this process's handler
    if not started:
        yield "spawn"
        return
    try:
        yield "forkserver"
    finally:
        server._stop()  # waits for it: it ends once the ranks (and their loader workers) have


def run_exit_handlers() -> None:
    """What a process's atexit handlers do at interpreter exit, now (each runs once: the list is emptied)."""
    import atexit

    atexit._run_exitfuncs()


def has_agent_store_hook() -> bool:
    """True while torch's agent still builds its store through the hook ``agent_store_servers`` replaces."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    return "_create_tcp_store_server" in dr.DynamicRendezvousHandler.__dict__


def lerp_all_(targets: list[torch.Tensor], ends: list[torch.Tensor], weight: float) -> None:
    """``t += weight * (end - t)`` for every pair, in a few fused kernels."""
    torch._foreach_lerp_(targets, ends, weight)


def record_cuda_memory_history(on: bool) -> None:
    """Start (or stop) recording CUDA allocations with their stacks, for ``dump_cuda_memory``."""
    torch.cuda.memory._record_memory_history(enabled="all" if on else None)


def dump_cuda_memory(path: str) -> None:
    """The recorded allocations as a pickle that torch's memory viewer (pytorch.org/memory_viz) opens."""
    torch.cuda.memory._dump_snapshot(path)


def settle_ddp_buckets(ddp: Any) -> bool:
    """Give a freshly built DDP its final gradient-bucket layout now, before any step; False if DDP keeps
    the layout it was built with anyway (find_unused_parameters) or rebuilds it its own way (static_graph).

    Why: DDP starts with every gradient in one bucket and re-buckets them by the order they became ready
    after its first synchronised backward. Where a gradient sits in a bucket decides in which order the
    all-reduce (gloo's ring, NCCL's rings and trees alike) adds the ranks' values; with 3 or more ranks
    that order changes the float result. So a process restarted at step k reduced step k in the one-bucket
    layout while the process it replaces reduced it in the rebuilt one: resume was not bitwise. Here a
    backward of zeros through every parameter, last-defined first (DDP's own guess of the ready order),
    triggers the one rebuild at construction, in every process alike, fresh or resumed. Costs one
    all-reduce of zeros, once.
    """
    if ddp.find_unused_parameters or ddp.static_graph:
        return False
    params = [p for p in ddp._module_parameters if p.requires_grad]
    if not params:
        return False
    # One term per parameter, created first to last: autograd runs the newest first, so the hooks fire
    # last-defined first and the buckets are those DDP would build from a sequential model's backward.
    zero = sum(p.sum() * 0 for p in params)  # sum: an empty parameter too
    ddp.reducer.prepare_for_backward([zero])
    zero.backward()
    rebuilt = ddp.reducer._rebuild_buckets()
    for p in params:
        p.grad = None  # the zeros were never a gradient: the first step starts from none, as before
    return bool(rebuilt)


def optuna_trial(study: Any, number: int) -> Any:
    """The live ``optuna.Trial`` numbered ``number`` in ``study``: what a trial's job reports to and asks
    ``should_prune`` of, in another process than the one that asked for it (Optuna's public API hands a
    Trial only to ``ask``; ``tell`` takes the number)."""
    import optuna

    storage = study._storage
    return optuna.trial.Trial(study, storage.get_trial_id_from_study_id_trial_number(study._study_id, number))


def frozen_trial(trial: Any) -> Any:
    """A live ``optuna.Trial``'s current record (a FrozenTrial) as the storage has it now: what another worker
    wrote since (its user attrs) included. Optuna's public API reads a trial's record only through the study's
    trial lists."""
    return trial.study._storage.get_trial(trial._trial_id)


# What torch._dynamo.utils.get_optimize_ddp_mode() answers while dynamo's config holds its defaults (it does
# until something imports torch._dynamo): DDP's C++ reducer. tests/integration/test_compat.py asks the real
# one.
DDP_MODE_BY_DEFAULT = "ddp_optimizer"


@contextlib.contextmanager
def ddp_reducer_without_dynamo() -> Iterator[None]:
    """While inside, a DDP built before anything imported ``torch._dynamo`` learns the reducer mode dynamo's
    default config gives, without importing the compiler stack to ask (2 s of CPU a rank). DDP's constructor
    reads ``torch._dynamo.utils.get_optimize_ddp_mode()`` as an attribute of torch: a stand-in answers it for
    the construction; a real ``import torch._dynamo`` meanwhile replaces it, as torch would."""
    import sys
    import types

    if "torch._dynamo" in sys.modules or "_dynamo" in torch.__dict__:  # (hasattr would import it)
        yield
        return
    stand_in = types.SimpleNamespace(
        utils=types.SimpleNamespace(get_optimize_ddp_mode=lambda: DDP_MODE_BY_DEFAULT)
    )
    torch._dynamo = stand_in  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if torch.__dict__.get("_dynamo") is stand_in:
            del torch._dynamo


# The functions defer_dynamo marked: in a list, so the marks come off in a process forked from the one that
# set them too (whose collector may no longer list them: a frozen fork).
_DEFERRED: list[Any] = []
_CACHE = "__dynamo_disable"  # where torch's wrapper keeps the disabled function it made at its first call


def defer_dynamo(imports: tuple[str, ...] = ()) -> None:
    """Until something imports ``torch._dynamo`` (``torch.compile`` does), the functions torch wraps with
    its ``_disable_dynamo`` (``Optimizer.zero_grad``, ``add_param_group``, ``state_dict``,
    ``torch.manual_seed``, ...) call themselves instead of importing the compiler stack at their first
    call: 2.2 s of CPU a process on the development VM, more than ``import torch``, in every rank.

    Why it changes nothing else: ``torch._dynamo.disable`` only acts while dynamo traces, which it cannot
    before it is imported; an import hook takes every mark off as ``torch._dynamo`` starts loading, and
    from then on torch's wrappers do what they always did. Covers the wrappers that exist now: call it
    after the imports a job needs, or name them in ``imports`` (a module imported later just pays the
    compiler's import, as before)."""
    import gc
    import importlib
    import sys
    import types

    for name in imports:
        importlib.import_module(name)

    if "torch._dynamo" in sys.modules:
        return
    code = torch._compile._disable_dynamo(_probe).__code__
    if "fn" not in code.co_freevars:  # torch changed its wrapper: leave it as it is (only slower)
        return
    cell = code.co_freevars.index("fn")
    # each wrapper refers to it: found in C, not a Python loop over all
    for wrapper in gc.get_referrers(code):
        if type(wrapper) is types.FunctionType and wrapper.__code__ is code:
            fn = wrapper.__closure__[cell].cell_contents
            if getattr(fn, _CACHE, None) is None:
                with contextlib.suppress(AttributeError, TypeError):  # a function that takes no attributes
                    setattr(fn, _CACHE, fn)
                    _DEFERRED.append(fn)
    if not any(isinstance(f, _DynamoWatch) for f in sys.meta_path):
        sys.meta_path.insert(0, _DynamoWatch())
    _steps_without_graph_breaks()


def _steps_without_graph_breaks() -> None:
    """Every torch optimizer's ``step`` is wrapped in ``_use_grad_for_differentiable``, which imports dynamo
    to place a graph break around the step. Until dynamo is imported by something else, the class's step
    sets the grad mode as that wrapper does and calls the step itself; after, it is torch's wrapper again.
    A class whose step torch already wrapped in its profiling hook (an optimizer was built) is left alone."""
    import functools
    import sys

    from torch.optim import optimizer as opt

    code = opt._use_grad_for_differentiable(_probe).__code__
    if "func" not in code.co_freevars:
        return
    cell = code.co_freevars.index("func")
    todo, seen = [torch.optim.Optimizer], set()
    while todo:
        cls = todo.pop()
        todo.extend(c for c in cls.__subclasses__() if c not in seen)
        seen.add(cls)
        use_grad = cls.__dict__.get("step")
        if getattr(use_grad, "__code__", None) is not code:
            continue
        step = use_grad.__closure__[cell].cell_contents

        def plain(*args: Any, _use_grad: Any = use_grad, _step: Any = step, **kwargs: Any) -> Any:
            if "torch._dynamo" in sys.modules:  # something may trace: torch's wrapper, graph breaks and all
                return _use_grad(*args, **kwargs)
            before = torch.is_grad_enabled()
            try:
                torch.set_grad_enabled(args[0].defaults["differentiable"])
                return _step(*args, **kwargs)
            finally:
                torch.set_grad_enabled(before)

        cls.step = functools.wraps(step)(plain)


def _probe() -> None:
    """A function to wrap, for the wrapper's code object."""


class _DynamoWatch(importlib.abc.MetaPathFinder):
    """Finds nothing; takes defer_dynamo's marks off when ``torch._dynamo`` is about to be imported."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "torch._dynamo":
            while _DEFERRED:
                fn = _DEFERRED.pop()
                if getattr(fn, _CACHE, None) is fn:
                    delattr(fn, _CACHE)
        return None


def loader_workers(state: dict[str, Any]) -> int:
    """The loader workers a ``StatefulDataLoader`` state was saved with (torchdata keeps a snapshot only with
    workers: 0 without one)."""
    snapshot = state.get("_snapshot")
    return int(snapshot["_main_snapshot"]["_num_workers"]) if snapshot else 0


def stream_state(state: dict[str, Any]) -> dict[str, Any]:
    """An iterable dataset's ``StatefulDataLoader`` state as a function of its position alone. With workers,
    torchdata counts the requests it sent them (``_sampler_iter_yielded``), consumed or still in flight, and
    a resume starts that count from the saved one with a fresh batch in flight: the count then depends on the
    resumes on the way (and on when a worker's stream ended), not on the position. For an iterable dataset
    the sampler yields only None and the count skips nothing on restore, so it is set to the samples the
    snapshot had consumed: a resumed run's checkpoints are then bitwise those of the run it replaces."""
    snapshot = state.get("_snapshot")
    if not snapshot or snapshot["_main_snapshot"].get("_sampler_iter_state") is not None:
        return state
    # the loader's own
    main = {**snapshot["_main_snapshot"], "_sampler_iter_yielded": snapshot["_snapshot_step"]}
    return {**state, "_snapshot": {**snapshot, "_main_snapshot": main}}  # dicts stay as they are


def answer_hydra_mode(may_be_set: Callable[[list[str]], bool]) -> None:
    """``@hydra.main`` composes the whole config once more, before the job's own compose, only to read
    ``hydra.mode``: answered "unset" without composing where ``may_be_set(overrides)`` says nothing can set it
    (Hydra's own look-up otherwise). Installed once a process."""
    from hydra._internal.hydra import Hydra

    lookup = Hydra.get_mode
    if getattr(lookup, "ddplab_answered", False):
        return

    def get_mode(self: Any, config_name: str | None, overrides: list[str]) -> Any:
        return lookup(self, config_name, overrides) if may_be_set(overrides) else None

    get_mode.ddplab_answered = True  # type: ignore[attr-defined]
    Hydra.get_mode = get_mode  # type: ignore[method-assign]
