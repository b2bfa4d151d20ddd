"""Asynchronous checkpoints (``checkpoint.async_save=true``): the loop pauses only to copy the state
into CPU buffers; one background thread writes the file, atomically as a synchronous save does.

Only :class:`~ddplab.checkpoint.manager.CheckpointManager` uses these. It keeps at most one write
in flight: the next save (and every stop, and the end of the run) first waits for it.
"""

from __future__ import annotations

import copy
import threading
import time
from typing import Any, Callable

import torch
from torch import Tensor


class Staging:
    """Copies a state (nested dicts/lists of tensors and plain values) into CPU buffers kept from one save
    to the next: copying into memory already touched costs a memcpy, a fresh allocation each save costs
    the page faults of the whole state again (about as long as the copy itself)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], Tensor] = {}
        self._pin = torch.cuda.is_available()  # pinned buffers make the device-to-host copy DMA

    @property
    def nbytes(self) -> int:
        """The memory the staging buffers hold: what asynchronous saves cost over synchronous ones."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def copy(self, obj: Any) -> Any:
        """A copy of ``obj`` that no later training step changes. Tensors that are one object in ``obj``
        (tied weights) stay one in the copy, so the file stores them once, as torch.save would."""
        # id -> (the tensor, kept alive so ids stay unique; its copy)
        seen: dict[int, tuple[Tensor, Tensor]] = {}
        out = self._copy(obj, (), seen)
        if any(t.is_cuda for t, _ in seen.values()):
            torch.cuda.synchronize()  # the copies are non-blocking; the writer must see them finished
        return out

    def _copy(self, obj: Any, path: tuple[Any, ...], seen: dict[int, tuple[Tensor, Tensor]]) -> Any:
        if isinstance(obj, Tensor):
            if id(obj) not in seen:
                seen[id(obj)] = (obj, self._buffer(obj, path))
            return seen[id(obj)][1]
        if isinstance(obj, dict):
            # A shallow copy keeps the mapping's type and attributes (a module state_dict's _metadata, which
            # load_state_dict reads for versions; a defaultdict's factory); then every value is copied.
            out = copy.copy(obj)
            for k, v in obj.items():
                out[k] = self._copy(v, path + (k,), seen)
            return out
        if type(obj) in (list, tuple):
            return type(obj)(self._copy(v, path + (i,), seen) for i, v in enumerate(obj))
        return copy.deepcopy(obj)  # numbers and strings (immutable), and anything else a state holds

    def _buffer(self, t: Tensor, path: tuple[Any, ...]) -> Tensor:
        t = t.detach()
        buf = self._buffers.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self._pin and t.is_cuda)
            self._buffers[path] = buf
        buf.copy_(t, non_blocking=t.is_cuda)
        return buf


class Writer:
    """One background write at a time. The thread is not a daemon: an interpreter that exits (a crash,
    sys.exit) still finishes the write in hand, so a checkpoint already staged is not lost."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error = ""
        self.seconds = 0.0  # how long the last background write took

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, write: Callable[[], None], on_error: Callable[[str], None] | None = None) -> None:
        """Run ``write`` in the background; if it fails, ``on_error(its message)`` runs in the writer thread
        (the manager asks the loop to stop at once, rather than train on until the next save says so)."""
        assert not self.busy, "a checkpoint write is already in flight"

        def run() -> None:
            t0 = time.perf_counter()
            try:
                write()
            except BaseException as e:  # said at the next save (or the end), on every rank
                self._error = str(e) if isinstance(e, OSError) and str(e) else f"{type(e).__name__}: {e}"
                if on_error is not None:
                    on_error(self._error)
            self.seconds = time.perf_counter() - t0

        self._thread = threading.Thread(target=run, name="ddplab-checkpoint-writer")
        self._thread.start()

    def wait(self) -> str:
        """Block until the write in flight (if any) is done; its error ("" when it succeeded), said once."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, ""
        return error
