"""Session: the lifecycle of one job on one rank, entered once by ``ddplab.run``.

Owns, in order: the launcher environment (via :mod:`ddplab.runtime.env`) →
the process group → rank 0's config on every rank → the run dir agreed by
rank 0 (and the torchrun-restart memo) → on exit, ``result.json`` and the
teardown. It must not touch models, data or checkpoints' contents: what runs
inside the ``with`` block is the trainer's business.

    with Session(cfg) as s:          # s.cfg, s.dist, s.run_dir
        metrics = train(s)
        s.complete(metrics)
"""

from __future__ import annotations

import contextlib
import logging
import time
import traceback
from pathlib import Path
from types import TracebackType
from typing import Any, Callable

from omegaconf import DictConfig, open_dict

from ddplab import failure, provenance, redact, rundir
from ddplab.config.errors import ConfigError
from ddplab.data import tokenizer
from ddplab.errors import RecordWriteError, mark_said
from ddplab.runtime import allocator, collectives, env, group
from ddplab.runtime.group import Dist
from ddplab.runtime.signals import Preempted, StopSignal

log = logging.getLogger("ddplab")


class Session:
    def __init__(self, cfg: DictConfig, search_earlier_runs: bool | None = None):
        self.cfg = cfg
        redact.use(redact.keys_of(cfg))  # this process's console lines mask the job's secret keys too
        self.dist: Dist = Dist()
        self.run_dir: Path = Path()
        self._lock: rundir.RunDirLock | None = None  # set once rank 0 holds the run dir
        self.hosts: dict[int, str] = {}  # rank -> host, from the start-up rank table (failures name hosts)
        # torchrun's restart memo, named while the agent is this rank's parent: if the agent dies, the
        # parent pid changes, and the memo must still be found to be removed when the job completes.
        self._memo: Path | None = None
        # resume=auto may look at earlier runs only from a run dir Hydra made up (rank 0 decides).
        self.search_earlier_runs = search_earlier_runs
        # Where a failure happened, for the report: report_failures_at gives the trainer's position.
        self._where: Callable[[], str] = lambda: "while building the job"
        self._recorded = False  # rank 0 wrote the job's completion
        # SIGTERM/SIGINT/SIGUSR1 from here on ask for a checkpointed stop (runtime.signals).
        self.stop = StopSignal()
        self.provenance = ""  # rank 0: provenance.json's text, once the ranks are known

    def __enter__(self) -> Session:
        self.stop.install(env.launcher_pid())  # a dead launcher stops this rank like a signal
        self.dist = group.init(self.cfg.distributed)
        try:
            log.debug(
                "host allocator: %s",
                allocator.keep_freed_host_memory(self.dist.device.type, str(self.cfg.perf.host_allocator)),
            )
            self._agree()
        except BaseException as e:
            self.__exit__(type(e), e, e.__traceback__)
            raise
        return self

    def _agree(self) -> None:
        dist = self.dist
        if not dist.is_main:
            logging.getLogger().setLevel(logging.WARNING)  # other ranks speak only when something is wrong
        self.cfg = collectives.sync_config(self.cfg, dist)  # a sweeper may have sampled per rank
        # One dir per job: rank 0's (Hydra made it); other ranks never make their own.
        self.run_dir = Path(collectives.broadcast_object(str(rundir.own_run_dir(self.cfg)), dist))
        if not dist.is_main:  # submitit runs Hydra in every task: only rank 0 writes the job's train.log
            for h in [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]:
                if Path(h.baseFilename).parent == self.run_dir.absolute():
                    logging.getLogger().removeHandler(h)
                    h.close()
        if self.search_earlier_runs is None:  # not decided by a self-launching parent
            self.search_earlier_runs = rundir.is_hydras_default(self.cfg)
        # Rank 0's verdict goes to every rank, so all stop together instead of waiting on rank 0.
        problem = collectives.broadcast_object(self._hold_run_dir() if dist.is_main else None, dist)
        if problem:
            raise RuntimeError(problem)
        restarts = env.restarts()
        if restarts and not self.cfg.resume:
            log.info(
                "%s: continuing from the last checkpoint (resume=auto)",
                ", ".join(f"{why} {n}" for why, n in restarts.items()),
            )
            with open_dict(self.cfg):
                self.cfg.resume = "auto"
        table, rows = collectives.rank_table(dist, collectives.rank_config_digest(self.cfg))
        log.info("ranks: %s", table)
        self.hosts = {int(r["rank"]): str(r["host"]) for r in rows}
        # What exactly runs, recorded by rank 0 from the same gather (provenance.json, TensorBoard text).
        prov = provenance.collect(rows, dist.backend, redact.keys_of(self.cfg)) if dist.is_main else None
        self.provenance = provenance.write(self.run_dir, prov) if prov is not None else ""
        if dist.is_main:  # the run dir alone then samples and exports with it, wherever the data goes
            tokenizer.keep(self.cfg.dataset, self.run_dir)

    def _hold_run_dir(self) -> str | None:
        """Rank 0: make and lock the run dir, note it for a torchrun restart; None, or why it cannot."""
        try:
            # Held since before Hydra wrote here (cli.OwnRunDir), or by the self-launch parent for its ranks.
            lock = rundir.take_held(self.run_dir)
            if lock is None:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                lock = rundir.RunDirLock(self.run_dir)
                holder = lock.acquire(env.launcher_pid() if env.is_self_launched() else None)
                if holder:
                    return rundir.in_use(self.run_dir, holder)
            self._lock = lock
            self._memo = env.run_dir_memo()
            if self._memo is not None:
                env.write_memo(self._memo, str(self.run_dir))
        except (OSError, RuntimeError) as e:
            return f"run dir {self.run_dir}: {type(e).__name__}: {e}"
        return None

    def report_failures_at(self, position: Callable[[], str]) -> None:
        """A failure from here on is reported at ``position()`` (the trainer's epoch and step)."""
        self._where = position

    def complete(
        self, metrics: dict[str, Any], note: str | None = None, objective: dict[str, Any] | None = None
    ) -> None:
        """The job finished: rank 0 records it (with ``note``, e.g. why it stopped early, and the
        objective's name and direction, for sweep summaries); a torchrun restart memo is no longer needed."""
        self._where = lambda: "after training, as rank 0 recorded its completion"
        written = self._recorded = self.dist.is_main and rundir.write_result(
            self.run_dir,
            {
                "status": "completed",
                "metrics": metrics,
                **({"note": note} if note else {}),
                **({"objective": objective} if objective else {}),
            },
        )
        # A sweep, a study or a scheduler reads the job's end there: exit 0 without it would be a silent loss
        # (the soak found it: the disk filled as the last checkpoint was written). Every rank learns it, so
        # that none waits in the last barrier for a rank 0 that is gone.
        if not collectives.broadcast_object(written, self.dist):
            self._where = lambda: "after training (completed)"
            raise RecordWriteError(
                f"the job completed and its checkpoints are written, but its record "
                f"{self.run_dir / rundir.RESULT} is not (the error above). Fix: free space, then "
                "run the same command with resume=auto: it records the completion"
            )
        if self.dist.is_main and self._memo is not None:
            # Its peers are in the last barrier now: an error here would leave them to die of a lost
            # connection.
            with contextlib.suppress(OSError):
                self._memo.unlink(missing_ok=True)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        lost: group.PeerFailed | None = None
        try:
            if isinstance(exc, Exception):
                lost = self._say_and_record(exc)
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None
            if tb is not None:
                # The failed frames hold the trainer (and DDP's reducer), which must go
                # before its process group does.
                traceback.clear_frames(tb)
            self._where = lambda: "after the job"
            self.stop.uninstall()
            group.teardown(clean=exc is None or isinstance(exc, Preempted))
        if lost is not None:  # the peer's error is the job's; this rank's lost connection needs no traceback
            time.sleep(group.PEER_EXIT_GRACE_S)
            raise mark_said(lost) from None

    def _say_and_record(self, exc: Exception) -> group.PeerFailed | None:
        """Say ``exc`` on this rank and record it in result.json, as ``ddplab.failure`` words it, here where
        it happened (the entry that ends the process says nothing more). What this rank ends with instead when
        it only lost its connection to a rank that failed first (or to one killed without a word)."""
        if isinstance(exc, ConfigError) or (
            getattr(exc, "alike_on_every_rank", False) and not self.dist.is_main
        ):
            # a value that cannot work: the caller shows it once, from rank 0
            if isinstance(exc, ConfigError):
                self._record(failure.of(exc, self.dist.rank))
            else:  # the same file met by every rank (a checkpoint): rank 0 says it and records it
                mark_said(exc)
            return None
        report = says = None
        silent_peer = False
        if not isinstance(exc, Preempted):  # where, on which rank, and which rank failed first
            report, says, silent_peer = group.describe_failure(
                self.dist, exc, self._where(), str(self.run_dir), self.cfg.distributed.timeout_s, self.hosts
            )
        ended = failure.of(exc, self.dist.rank, report=report)
        (log.warning if isinstance(exc, Preempted) else log.error)("%s", says or ended.line)
        mark_said(exc)
        # A completion recorded stays: a peer lost after rank 0 recorded it takes nothing away.
        if not self._recorded:
            self._record(ended)
        if says is not None and (says != report or silent_peer):
            return (group.PeerLost if silent_peer else group.PeerFailed)(says, str(report))
        return None

    def _record(self, ended: failure.Failure) -> None:
        """Never into a run dir another job holds; a record that just failed is not tried again."""
        if self._lock is not None and ended.record is not None:
            rundir.write_result(self.run_dir, ended.record)
