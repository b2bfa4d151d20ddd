"""Where scalars go: rank 0's TensorBoard writer (opened lazily), a do-nothing writer elsewhere.

Chosen once by :func:`make_writer`, so the loop calls the same methods on
every rank and never asks which rank it is.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Protocol

from ddplab.errors import ResourceError
from ddplab.runtime.group import Dist


class Writer(Protocol):
    """Where a job's scalars, texts and images go: what the loop, callbacks and tasks call
    (``state.writer``)."""

    def scalars(self, values: dict[str, float], step: int) -> None: ...
    def text(self, tag: str, value: str, step: int = 0) -> None: ...
    def hparams(self, hparams: dict[str, Any], trial: str) -> None: ...
    def charts(self, categories: dict[str, dict[str, list[str]]]) -> None: ...
    def image(self, tag: str, image: Any, step: int) -> None: ...
    def purge_after(self, step: int) -> None: ...
    def open_soon(self) -> None: ...
    def close(self) -> None: ...
    def hurry(self, seconds: float) -> None: ...
    def drain(self) -> None: ...


class NullWriter:
    """What non-zero ranks get: the loop calls the same methods, nothing happens."""

    def scalars(self, values: dict[str, float], step: int) -> None:
        pass

    def text(self, tag: str, value: str, step: int = 0) -> None:
        pass

    def hparams(self, hparams: dict[str, Any], trial: str) -> None:
        pass

    def charts(self, categories: dict[str, dict[str, list[str]]]) -> None:
        pass

    def image(self, tag: str, image: Any, step: int) -> None:
        """``image``: a (C, H, W) tensor with values in [0, 1] (C = 1 or 3)."""

    def purge_after(self, step: int) -> None:
        """A resumed run (or one restarted where an attempt left events): drop what was logged after
        ``step``."""

    def open_soon(self) -> None:
        """Training has begun: whatever is slow to open may start opening now, beside the steps."""

    def close(self) -> None:
        pass

    def hurry(self, seconds: float) -> None:
        """A stop signal came: what a tracking server's writer still sends at close or drain must be done
        within ``seconds`` (the launcher's grace is running); the rest is dropped, and said."""

    def drain(self) -> None:
        """The run failed: send what is still queued (a tracking server's writer). TensorBoard's file is left
        as a failed run has always left it."""


class TensorBoardWriter(NullWriter):
    """Rank 0's SummaryWriter, opened on a thread of its own once the first step is done (or at the first
    write, if that comes first).

    Importing TensorBoard and opening the event file takes a few hundred ms. Nothing needs them before the
    first log step, so they stay off the path from launch to the first training step; opened in the loop at
    the first log step, they stalled it (0.1-0.4 s at step 10). Beside the steps, they cost the loop
    nothing where the host waits on an accelerator. Text and HParams written earlier are queued and land
    first in the file.
    """

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self.purge_step: int | None = None
        self._w: Any = None
        self._queued: list[tuple[str, tuple]] = []
        self._opening: threading.Thread | None = None
        self._opened: Any = None  # the opening thread's SummaryWriter, or what it raised

    @contextlib.contextmanager
    def _said_in_one_line(self) -> Iterator[None]:
        """A write that fails (a full disk) is the machine's fault: said with the dir, the space left and the
        fix, like a checkpoint's, and without the traceback TensorBoard's writer thread prints of its own."""
        try:
            yield
        except OSError as e:
            try:
                free = f"{shutil.disk_usage(self.log_dir).free / 2**20:.1f} MiB free on its file system"
            except OSError:
                free = "its file system unreadable"
            raise ResourceError(
                f"could not write TensorBoard events to {self.log_dir}: {type(e).__name__}: {e} "
                f"({free}). Fix: free space (or point run_dir elsewhere), then run the same command "
                "with resume=auto"
            ) from None

    def purge_after(self, step: int) -> None:
        self._join_opening()  # (a resume decides before training starts: normally nothing to join)
        self.purge_step = step + 1
        # A callback wrote a scalar in its setup: the next write opens a purging file.
        stale, self._w, self._opened = self._w or self._opened, None, None
        if stale is not None and not isinstance(stale, BaseException):
            with self._said_in_one_line():
                stale.close()

    def open_soon(self) -> None:
        if self._w is None and self._opening is None and self._opened is None:
            self._opening = threading.Thread(target=self._open, name="ddplab-tensorboard", daemon=True)
            self._opening.start()

    def _open(self) -> None:
        try:
            from tensorboard.compat.proto.summary_pb2 import Summary  # noqa: F401  (imported for scalars)
            from tensorboard.plugins.hparams.summary_v2 import hparams_pb  # noqa: F401  (for hparams)
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events a crashed run logged past its last checkpoint,
            # so a resumed run's curves have each step once.
            _after_earlier_event_files(self.log_dir)
            _quiet_event_thread()
            self._opened = SummaryWriter(log_dir=self.log_dir, purge_step=self.purge_step)
        except BaseException as e:  # raised where the writer is first needed, on the loop's thread
            self._opened = e

    def _join_opening(self) -> None:
        if self._opening is not None:
            self._opening.join()
            self._opening = None

    def _writer(self) -> Any:
        if self._w is None:
            self._join_opening()
            if self._opened is None:
                self._open()
            opened, self._opened = self._opened, None
            if isinstance(opened, BaseException):
                with self._said_in_one_line():
                    raise opened
            self._w = opened
            for method, args in self._queued:  # each write said in one line if it fails (its own guard)
                getattr(self, method)(*args)
            self._queued.clear()
        return self._w

    def scalars(self, values: dict[str, float], step: int) -> None:
        """One event holding every value: TensorBoard reads each the same as an ``add_scalar`` of its own, and
        a log step's ~12 scalars cost 0.05 ms instead of 0.35 ms (an event, a protobuf and a queue put
        each)."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        w = self._writer()
        summary = Summary(value=[Summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()])
        with self._said_in_one_line():
            w.file_writer.add_summary(summary, step)

    def text(self, tag: str, value: str, step: int = 0) -> None:
        if self._w is None:
            self._queued.append(("text", (tag, value, step)))
            return
        # Markdown: indent four spaces so yaml keeps its layout in TensorBoard's Text tab.
        with self._said_in_one_line():
            self._w.add_text(tag, "    " + value.replace("\n", "\n    "), step)

    def hparams(self, hparams: dict[str, Any], trial: str) -> None:
        """This run's HParams session, in its own event file (add_hparams would make a second run
        dir). TensorBoard's own builder keeps the types: torch's writes a bool as a number (amp
        0.0000). No experiment record per run: TensorBoard then derives one from all runs' values,
        which marks the keys whose values differ (a sweep's) and lists them first. The metrics are
        the scalar tags; a sweep's end writes an experiment record that orders them
        (:mod:`ddplab.sweep`)."""
        if self._w is None:
            self._queued.append(("hparams", (hparams, trial)))
            return
        from tensorboard.plugins.hparams.summary_v2 import hparams_pb

        # Typed choices are str-valued enums: plain str for the protobuf.
        clean = {
            k: v if isinstance(v, (bool, int, float)) or type(v) is str else str(v)
            for k, v in hparams.items()
        }
        with self._said_in_one_line():
            self._w.file_writer.add_summary(hparams_pb(clean, trial_id=trial))

    def charts(self, categories: dict[str, dict[str, list[str]]]) -> None:
        """The Custom Scalars tab (TensorBoard calls it a layout): ``{category: {chart title: [tags drawn
        together]}}``; the first
        category open, the others folded. Tags are matched exactly (TensorBoard takes regexes)."""
        if self._w is None:
            self._queued.append(("charts", (categories,)))
            return
        import re

        from tensorboard.plugins.custom_scalar import layout_pb2
        from torch.utils.tensorboard.summary import custom_scalars

        summary = custom_scalars(
            {
                cat: {
                    title: ["Multiline", [re.escape(t) + "$" for t in tags]] for title, tags in charts.items()
                }
                for cat, charts in categories.items()
            }
        )
        # torch's builder has no "closed": set it on the layout it serialised.
        proto = layout_pb2.Layout.FromString(summary.value[0].tensor.string_val[0])
        for category in proto.category[1:]:
            category.closed = True
        summary.value[0].tensor.string_val[0] = proto.SerializeToString()
        with self._said_in_one_line():
            self._w.file_writer.add_summary(summary)

    def image(self, tag: str, image: Any, step: int) -> None:
        w = self._writer()
        with self._said_in_one_line():
            w.add_image(tag, image, step)

    def close(self) -> None:
        w = self._writer()
        with self._said_in_one_line():
            w.close()


class TeeWriter(NullWriter):
    """Every call to each writer in turn, TensorBoard's first: what ddplab writes in the loop goes to all."""

    def __init__(self, *writers: Any):
        self.writers = writers

    def scalars(self, values: dict[str, float], step: int) -> None:
        for w in self.writers:
            w.scalars(values, step)

    def text(self, tag: str, value: str, step: int = 0) -> None:
        for w in self.writers:
            w.text(tag, value, step)

    def hparams(self, hparams: dict[str, Any], trial: str) -> None:
        for w in self.writers:
            w.hparams(hparams, trial)

    def charts(self, categories: dict[str, dict[str, list[str]]]) -> None:
        for w in self.writers:
            w.charts(categories)

    def image(self, tag: str, image: Any, step: int) -> None:
        for w in self.writers:
            w.image(tag, image, step)

    def purge_after(self, step: int) -> None:
        for w in self.writers:
            w.purge_after(step)

    def open_soon(self) -> None:
        for w in self.writers:
            w.open_soon()

    def close(self) -> None:
        for w in self.writers:
            w.close()

    def drain(self) -> None:
        for w in self.writers:
            w.drain()

    def hurry(self, seconds: float) -> None:
        for w in self.writers:
            w.hurry(seconds)


def _quiet_event_thread() -> None:
    """TensorBoard's writer thread, failing a write, prints its traceback through ``threading.excepthook``
    and keeps the error for the next write on the main thread, where ddplab says it in one line
    (``_said_in_one_line``): the thread's own report is left out, every other thread's kept."""
    previous = threading.excepthook
    if getattr(previous, "ddplab_quiet", False):
        return

    def hook(args: Any) -> None:
        if not (isinstance(args.exc_value, OSError) and type(args.thread).__name__ == "_AsyncWriterThread"):
            previous(args)

    hook.ddplab_quiet = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def _after_earlier_event_files(log_dir: str) -> None:
    """Wait (at most a second) until a new event file's name sorts after every earlier one.

    TensorBoard reads a folder's event files in name order, and a name is
    ``events.out.tfevents.<second>.<host>.<pid>.<counter>``: two files of one second order by pid and
    counter as text ("10" before "9"). A resumed run's file read before the crashed run's would let
    the old steps overwrite the new ones. Only a rerun within the same second (in one process: tests,
    notebooks) ever waits.
    """
    while any(Path(log_dir).glob(f"events.out.tfevents.{int(time.time()):010d}.*")):
        time.sleep(0.05)


def make_writer(dist: Dist, log_dir: str) -> Writer:
    return TensorBoardWriter(log_dir) if dist.is_main else NullWriter()
