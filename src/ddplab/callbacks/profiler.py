"""torch.profiler traces of steps N..M on every rank (Perfetto / chrome://tracing / TensorBoard),
and on CUDA a memory snapshot of those steps and of an out-of-memory error."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from ddplab import compat
from ddplab.train.callback import Callback
from ddplab.train.state import State

log = logging.getLogger("ddplab")


class Profiler(Callback):
    """Profiles optimizer steps ``steps[0]..steps[1]`` (1-based, inclusive) and writes
    ``<run dir>/profile/trace-rank<r>.json`` per rank (Chrome trace format: open it at
    ui.perfetto.dev). With CUDA, ``memory_snapshot`` also records allocations over those steps
    into ``memory-rank<r>.pickle`` (drag it onto pytorch.org/memory_viz), and on an
    out-of-memory error. Steps outside the window cost one integer comparison.
    """

    training_only = True  # it profiles optimizer steps: mode=eval takes none

    def __init__(self, steps: tuple[int, int] | list[int] = (10, 15), memory_snapshot: bool = True):
        first, last = int(steps[0]), int(steps[1])
        if not 1 <= first <= last:
            raise ValueError(
                f"callbacks.profiler.steps={list(steps)}: need 1 <= first <= last. Fix: steps=[10,15]"
            )
        self.first, self.last, self.memory_snapshot = first, last, memory_snapshot
        self._prof: Any = None

    def setup(self, state: State) -> None:
        self.dir = Path(state.run_dir) / "profile"
        self.rank = state.dist.rank
        self.cuda = state.dist.device.type == "cuda"

    def on_fit_start(self, state: State) -> None:
        if state.loop.step + 1 == self.first:
            self._start()

    def on_step_end(self, state: State, step: int) -> None:
        if step + 1 == self.first:
            self._start()
        elif step == self.last and self._prof is not None:
            self._stop()

    def _start(self) -> None:
        acts = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if self.cuda else []
        )
        self._prof = torch.profiler.profile(activities=acts, record_shapes=True, profile_memory=True)
        self._prof.__enter__()
        if self.cuda and self.memory_snapshot:
            compat.record_cuda_memory_history(True)

    def _stop(self) -> None:
        self._prof.__exit__(None, None, None)
        self.dir.mkdir(parents=True, exist_ok=True)
        trace = self.dir / f"trace-rank{self.rank}.json"
        self._prof.export_chrome_trace(str(trace))
        self._prof = None
        log.info("profiler: steps %d-%d of rank %d in %s", self.first, self.last, self.rank, trace)
        if self.cuda and self.memory_snapshot:
            self._dump("memory")
            compat.record_cuda_memory_history(False)

    def _dump(self, what: str) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"{what}-rank{self.rank}.pickle"
        compat.dump_cuda_memory(str(path))
        log.info("profiler: CUDA memory snapshot of rank %d in %s", self.rank, path)

    def on_fit_end(self, state: State, metrics: dict[str, float]) -> None:
        if self._prof is not None:  # the run ended inside the window: keep what was recorded
            self._stop()

    def on_exception(self, state: State, exc: BaseException) -> None:
        if self.cuda and isinstance(exc, torch.cuda.OutOfMemoryError):
            self._dump("oom-memory")
