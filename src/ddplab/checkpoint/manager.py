"""CheckpointManager: what goes into a checkpoint, when, under which name, and how a run resumes.

Every component with state registers once (``manager.register("scheduler", scheduler)``) and implements
torch's ``Stateful`` protocol (``torch.distributed.checkpoint.stateful``) — torch's optimizers, schedulers and
modules already do. The manager owns the save policy (epoch ends, every N steps, keep the last K, best),
atomic writes by rank 0, finding a resume point, and loading: every component's ``check`` runs before any
component is loaded, so a checkpoint that does not fit changes nothing. It must not decide what a component's
state *is*."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # the type only: importing torch.distributed.checkpoint costs ~0.6 s of start-up
    from torch.distributed.checkpoint.stateful import Stateful

from ddplab.checkpoint import background, files
from ddplab.config import drift
from ddplab.runtime.collectives import broadcast_object, side_group
from ddplab.runtime.group import Dist

log = logging.getLogger("ddplab")


# A component may also have ``check(checkpoint: dict, path: Path) -> None``, which raises if the checkpoint
# cannot be loaded into it; every component's check runs before any component loads.


class CheckpointManager:
    def __init__(
        self,
        ckpt_dir: Path,
        policy: Any,
        dist: Dist,
        meta: dict[str, Any],
        check_meta: Callable[[dict[str, Any], Path], None] | None = None,
        stop: Callable[[str], None] | None = None,
        saved: Callable[[str], None] | None = None,
    ):
        """``policy``: conf ``checkpoint`` (every_n_steps, keep_last, save_best, async_save); ``meta``:
        stored as is; ``check_meta(saved_meta, path)`` raises if a checkpoint's meta refuses it (runs before
        any load); ``stop(reason)``: asks the loop for a stop (a background write failed: the stop's save
        then raises its error on every rank); ``saved(path)``: called on every rank, on the loop's thread,
        for each checkpoint once it is on disk (the callbacks' on_save)."""
        self.dir, self.policy, self.dist, self.meta = ckpt_dir, policy, dist, meta
        self.check_meta, self._stop, self._saved = check_meta, stop, saved
        self._every = int(policy.every_n_steps)  # read once: save(mid_epoch=...) runs every step
        self._enabled = bool(policy.enabled)  # checkpoint.enabled=false: debug runs write nothing
        self.components: dict[str, Stateful] = {}
        self._optional: set[str] = set()
        self._step = 0
        self._source: Path | None = None  # the checkpoint being loaded
        # Seconds the last save took, and the one resumed from (if known): a save slower than the
        # launcher's grace after a stop signal is lost on preemption, so the trainer says so.
        self.last_save_s = 0.0
        self.resumed_save_s = 0.0
        # checkpoint.async_save: the loop pauses for last_stall_s only; a writer thread does the rest.
        self._writer = background.Writer() if policy.async_save and self._enabled else None
        self._staging = background.Staging()
        self._group: Any = None  # a side group for sharded background writes (made at the first one)
        self.last_stall_s = 0.0
        self.last_wait_s = 0.0  # of last_stall_s, the part spent waiting for the previous background write
        # The background write's path, told to ``saved`` only once rank 0's word says it is on disk: every
        # rank hears that word at the same step (the next save, a stop's, the run's end).
        self._in_flight = ""

    def register(self, key: str, component: Stateful, optional: bool = False) -> None:
        """``optional``: a checkpoint without this entry still loads; the component keeps its fresh state
        (a callback added since the checkpoint was written, e.g. ``callbacks=[ema]`` on resume)."""
        if key in self.components or key == "meta":
            raise ValueError(f"checkpoint entry {key!r} is registered twice (or reserved)")
        self.components[key] = component
        if optional:
            self._optional.add(key)

    @property
    def staging_bytes(self) -> int:
        """CPU memory async_save holds for its copies of the state (0 for synchronous saves)."""
        return self._staging.nbytes

    # ------------------------------------------------------ sidecar directories
    def sidecar_path(self, suffix: str) -> Path:
        """Directory next to the step file being written, for state saved by every rank (sharded)."""
        return self.dir / f"{files.step_name(self._step)}.{suffix}"

    def resolve_sidecar(self, name: str) -> Path:
        """A sidecar named by the checkpoint being loaded (it may live in another run dir)."""
        assert self._source is not None, "resolve_sidecar is for loading"
        return self._source.parent / name

    # ----------------------------------------------------------------- saving
    def _due(self, step: int, position: tuple[int, int]) -> bool:
        """A mid-epoch save is due after this optimizer step; ``position``: (batches consumed in the
        epoch, batches per epoch). At the epoch's end the epoch save comes instead."""
        every = self._every
        return bool(every) and step % every == 0 and position[0] < position[1]

    def save(
        self,
        step: int,
        is_best: bool = False,
        mid_epoch: tuple[int, int] | None = None,
        before: Callable[[], None] | None = None,
        now: bool = False,
    ) -> str:
        """Collective: every rank gathers its components' state; rank 0 writes. The path, or "" when
        nothing was saved.

        ``mid_epoch`` (batches consumed, batches per epoch): called after every step, this saves only
        when ``checkpoint.every_n_steps`` says a save is due; otherwise (epoch end, stop) it always
        saves. ``before`` runs on every rank right before a save (the trainer closes its log interval).
        ``now``: written before this returns even with ``checkpoint.async_save`` (a stop's checkpoint).
        With ``async_save`` the returned path is written later: ``saved`` hears of it when it is on disk.

        Rank 0's outcome goes to every rank (in place of a plain barrier, at the same cost): a
        failed write (a full disk) stops all ranks together with rank 0's message, instead of
        leaving the others waiting in a barrier until the timeout. With ``async_save`` the outcome
        is the previous background write's, said at the next save or at :meth:`finish`.
        """
        if not self._enabled or (mid_epoch is not None and not self._due(step, mid_epoch)):
            return ""
        if before is not None:
            before()
        t0 = time.perf_counter()
        self._step = step
        if self._writer is not None:
            # Every rank: the write in flight is done, and how it went (rank 0's word) before anything new.
            self._settled(broadcast_object(self._settle(t0), self.dist))
            if not now:
                return self._save_in_background(step, is_best, t0)
        entries = {key: c.state_dict() for key, c in self.components.items()}  # same order on every rank
        outcome: tuple[str, str] = ("", "")
        if self.dist.is_main:
            try:
                outcome = (str(self._write(entries, step, is_best)), "")
            except OSError as e:
                outcome = ("", str(e))
        # nobody races ahead of (or reads) a half-written file
        path, error = broadcast_object(outcome, self.dist)
        if error:
            raise files.CheckpointWriteError(error)
        self.last_save_s = self.last_stall_s = time.perf_counter() - t0
        if path and self.dist.is_main:
            _note_save_time(self.dir, Path(path).name, self.last_save_s)
        if path and self._saved is not None:
            self._saved(path)
        return path

    def _write(self, entries: dict[str, Any], step: int, is_best: bool) -> Path:
        return files.save(
            {**entries, "meta": self.meta},
            self.dir,
            step,
            self.policy.keep_last,
            is_best and self.policy.save_best,
        )

    def _settle(self, t0: float) -> str:
        """Wait for the background write in flight (async_save); its error ("" if none or it succeeded)."""
        if self._writer is None:
            return ""
        busy = self._writer.busy
        error = self._writer.wait()
        waited = time.perf_counter() - t0
        self.last_wait_s = waited if busy else 0.0
        self.last_save_s = self._writer.seconds or self.last_save_s  # what a stop's save will cost, about
        if busy and waited > 0.05:
            log.warning(
                "checkpoint at step %d waited %.2fs for the previous background write (%.2fs in all): "
                "saves come faster than they are written. Fix: raise checkpoint.every_n_steps",
                self._step,
                waited,
                self._writer.seconds,
            )
        return error

    def _save_in_background(self, step: int, is_best: bool, t0: float) -> str:
        """checkpoint.async_save: copy every component's state (the loop waits for this only), then write
        in the background. A sharded component (FSDP) stages its own shards through DCP's async_save."""
        if self._group is None and any(hasattr(c, "stage") for c in self.components.values()):
            self._group = side_group(self.dist) or False
        entries: dict[str, Any] = {}
        # sharded writes in flight: done before the step file names them
        pending: list[Callable[[], None]] = []
        for key, c in self.components.items():
            if hasattr(c, "stage"):
                entries[key], finish = c.stage(self._group or None)
                pending.append(finish)
            else:
                entries[key] = self._staging.copy(c.state_dict())
        meta = self._staging.copy(self.meta)

        def write() -> None:
            for finish in pending:
                finish()
            if self.dist.is_main:
                path = files.save(
                    {**entries, "meta": meta},
                    self.dir,
                    step,
                    self.policy.keep_last,
                    is_best and self.policy.save_best,
                )
                _note_save_time(self.dir, path.name, time.perf_counter() - t0)

        self._writer.start(write, self._on_write_error)
        self.last_stall_s = time.perf_counter() - t0
        self._in_flight = str(self.dir / f"{files.step_name(step)}.pt")
        return self._in_flight

    def _settled(self, error: str) -> None:
        """Every rank, with rank 0's word on the write in flight: its error raised, or ``saved`` told of
        it."""
        path, self._in_flight = self._in_flight, ""
        if error:
            raise files.CheckpointWriteError(error)
        if path and self._saved is not None:
            self._saved(path)

    def _on_write_error(self, error: str) -> None:
        if self._stop is not None:
            self._stop(f"a background checkpoint write failed ({error.split(':')[0]})")

    def finish(self) -> None:
        """Collective, at the end of a run: the last background write is done; its failure fails every
        rank."""
        if self._writer is None:
            return
        self._settled(broadcast_object(self._settle(time.perf_counter()), self.dist))

    def drain(self) -> None:
        """Local, on the way out of a failed run: let the write in hand finish (it is a complete
        checkpoint); its outcome is no longer anyone's to act on, nor ``saved``'s: no rank can agree on it."""
        if self._writer is not None:
            self._writer.wait()
            self._in_flight = ""

    # ---------------------------------------------------------------- loading
    def resume(self, resume: str | None, run_dir: Path, search_earlier_runs: bool = False) -> Path | None:
        """Load the checkpoint ``resume`` names (null | auto | path) into every component; its path.

        ``auto`` looks in ``run_dir``, and in earlier runs of the same command only with
        ``search_earlier_runs``."""
        digest = drift.trajectory_digest(self.meta["config"]) if "config" in self.meta else None
        found = (
            [str(p) for p in files.find_resume(resume, run_dir, search_earlier_runs, digest)]
            if self.dist.is_main
            else []
        )
        paths = [Path(p) for p in broadcast_object(found, self.dist)]
        if not paths:
            return None
        if resume != "auto":  # the user named it: a bad file is an error, not a fallback
            path, ck = paths[0], files.load(paths[0])
        else:
            got = files.load_first_good(paths)
            if got is None:
                raise files.CheckpointReadError(
                    f"resume=auto: none of {[str(p) for p in paths]} could be read. "
                    "Fix: resume=null to start fresh, or resume=<path> to a good checkpoint."
                )
            path, ck = got
        self._source = path
        self.resumed_save_s = _save_times(path.parent).get(path.name, 0.0)
        for c in self.components.values():
            if hasattr(c, "check"):
                c.check(ck, path)
        if self.check_meta is not None:  # after the components': a model that does not fit says exactly how
            self.check_meta(ck.get("meta", {}), path)
        fresh = [k for k in self.components if k not in ck and k in self._optional]
        for k in fresh:
            log.info("resume: %s has no %s entry; it starts fresh", path, k)
        missing = [k for k in self.components if k not in ck and k not in fresh]
        if missing:
            raise RuntimeError(
                f"resume: {path} has no {missing} entries (saved by another ddplab version or "
                "setup). Fix: resume=null to start fresh."
            )
        for key, c in self.components.items():
            if key in ck:
                c.load_state_dict(ck[key])
        return path


_TIMES = "save_seconds.json"  # beside the checkpoints: how long each took to write ("last.pt" too)


def _save_times(ckpt_dir: Path) -> dict[str, float]:
    try:
        return {k: float(v) for k, v in json.loads((ckpt_dir / _TIMES).read_text()).items()}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


def _note_save_time(ckpt_dir: Path, name: str, seconds: float) -> None:
    """Rank 0, after a save: record its duration (for files that still exist). Best effort: never fails a
    save."""
    times = {k: v for k, v in _save_times(ckpt_dir).items() if (ckpt_dir / k).exists()}
    times[name] = times[files.LAST] = round(seconds, 3)
    tmp = ckpt_dir / f".{_TIMES}.tmp"
    try:
        tmp.write_text(json.dumps(times))
        os.replace(tmp, ckpt_dir / _TIMES)
    except OSError:
        tmp.unlink(missing_ok=True)
