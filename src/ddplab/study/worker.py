"""One worker of a study, as one object whose methods are its life: :meth:`StudyWorker.run` loops — the last
trial told, the next one claimed (:meth:`~StudyWorker.claim`: a RUNNING one whose worker let go or died,
:meth:`~StudyWorker.resume_dead`, else a new one asked of the sampler), trained as a normal ddplab run in its
run dir (:meth:`~StudyWorker.train`; the trial's ReportToStudy callback reports each evaluation), told once
(:meth:`~StudyWorker.tell`) — until the study needs no more.

Under torchrun or ``srun -n N`` the N ranks are one worker whose trials run on all of them: rank 0 opens the
study, claims, asks and tells; the others train the trial it picked (``study.ranks.agree``). Who holds a
trial, and when another worker may take it over and resume it, lives in the storage (``ddplab.study.owner``).
A takeover of a trial whose worker died counts a death; past ``study.max_retries`` the trial is told FAIL."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, NamedTuple

from omegaconf import DictConfig

from ddplab import compat, failure, rundir
from ddplab.errors import ResourceError, was_said
from ddplab.runtime import env, group, signals
from ddplab.runtime.console import log_to
from ddplab.runtime.signals import Preempted
from ddplab.study import owner, storage, summary
from ddplab.study.opening import open_study
from ddplab.study.ranks import agree
from ddplab.study.report import PRUNED
from ddplab.study.trials import TRIAL_FILE, Ended, make_sampler, objective_value, trial_config

log = logging.getLogger("ddplab")


class Pending(NamedTuple):
    """The last trial trained, told at the ranks' next agreement: then its claim is let go."""

    trial: Any
    hold: owner.Hold
    ended: Ended | None  # None: told already (it failed)


class StudyWorker:
    """A worker, on every rank of it. Rank 0 opens the study (:meth:`open`: its handle ``study``, the
    ``space``, ``limit``, ...); the trials it holds until told are ``holds``; ``pending`` is the last trial
    trained, told at the ranks' next agreement (a storage lost there stops every rank alike)."""

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.study: Any = None  # optuna.Study, rank 0's once opened
        self.dir, self.url = Path(), ""  # study.dir (absolute) and the storage's URL
        self.space: dict[str, Any] = {}
        self.minimize = False
        self.limit = 0  # trials to ask for: study.n_trials, at most a GridSampler's grid
        self.holds: dict[int, owner.Hold] = {}  # trials this worker holds, until told
        self.unreachable: set[int] = set()  # trials whose run dir it cannot see (said once)
        self.pending: Pending | None = None
        self.taken: tuple[Any, owner.Hold] | None = None  # rank 0: the trial this round claimed

    def open(self) -> None:
        """Rank 0, before any trial is asked: the study checked and opened (``study.opening``)."""
        self.study, self.space, self.dir, self.url, self.minimize, self.limit = open_study(self.cfg)

    # ------------------------------------------------------------------------------------------ the loop
    def run(self) -> dict[str, float]:
        """Trials until the study needs no more; the best trial's objective (``{objective: value}``)."""
        agree(self.cfg, self.open)
        try:
            while (picked := self._next_agreed()) is not None:
                if self.taken is None:  # a rank other than 0: train the trial rank 0 picked, with it
                    from ddplab.job import train

                    train(trial_config(self.cfg, *picked), search_earlier_runs=False)
                    continue
                self.train(*self.taken)
        finally:
            self._tell_last()
        return summary.finish(self) if self.study is not None else {}

    def _next_agreed(self) -> tuple[int, dict[str, Any], str] | None:
        """The trial every rank trains next (number, params, run dir), as rank 0 decided it; None: no more."""
        gone = env.launcher_gone()
        if gone is not None:  # torchrun's agent died as the last trial ended: nobody would stop these ranks
            log.warning(
                "launcher died (pid %d): this worker takes no further trial (start it again to go on)", gone
            )
            raise Preempted(f"launcher died (pid {gone})", -1, None)  # the last trial is told on the way out
        self.taken = None
        picked = agree(self.cfg, self._decide)
        if picked is not None and picked[0] == "stop":
            log.warning(
                "%s arrived between trials: this worker takes no further trial (start it again to go on)",
                picked[1],
            )
            raise Preempted(picked[1], -1, None)
        return None if picked is None else picked[1:]

    def _decide(self) -> tuple[Any, ...] | None:
        """Rank 0, inside the ranks' agreement: the last trial told first (a storage lost there stops every
        rank alike), then the next one claimed, or a stop held since the last trial."""
        self._tell_pending()
        if signals.held():  # preempted between trials: take none (the last one was told)
            return ("stop", signals.held())
        self.taken = self.claim()
        if self.taken is None:
            return None
        trial = self.taken[0]
        return ("trial", trial.number, dict(trial.params), str(self.trial_dir(trial)))

    def _tell_last(self) -> None:
        """The last trial completed: told even when the next agreement failed."""
        try:
            self._tell_pending()
        except Exception as e:  # the worker's own failure is what it reports; this is said beside it
            log.error(
                "the last trial could not be told (%s: %s): it stays RUNNING, and the next worker resumes "
                "it from its checkpoint",
                type(e).__name__,
                group.plain_message(e),
            )

    # ------------------------------------------------------------------------------------------ claim
    def claim(self) -> tuple[Any, owner.Hold] | None:
        """The trial this worker takes next (held until told), or None when the study needs no more."""
        from optuna.trial import TrialState

        with owner.claim_lock(self.url, self.cfg.study.timeout_s, self.dir):
            trials = self.study.get_trials(deepcopy=False)
            for t in trials:
                if t.state == TrialState.RUNNING:
                    hold = self.resume_dead(t)
                    if hold is not None:
                        return t, hold
            if len(trials) >= self.limit:
                return None
            self.study.sampler = make_sampler(self.cfg, self.space, len(trials))
            trial = self.study.ask(self.space)
            tdir = self.dir / str(trial.number)
            tdir.mkdir(parents=True, exist_ok=True)
            # trial.json first: a dir recorded in the storage must be one a resumer can recognise
            # (owner.reachable), even if this worker dies right after recording it.
            (tdir / TRIAL_FILE).write_text(
                json.dumps(
                    {"study": self.study.study_name, "number": trial.number, "params": trial.params}, indent=2
                )
            )
            trial.set_user_attr(owner.DIR, str(tdir))
            hold = self._hold(trial.number)
            return self.study.get_trials(deepcopy=False)[trial.number], hold

    def resume_dead(self, trial: Any) -> owner.Hold | None:
        """Hold a RUNNING trial whose worker let go or is gone (counting a death, failing it past
        ``study.max_retries``); None while its worker is alive, or where its run dir cannot be reached."""
        v = owner.verdict(trial.user_attrs.get(owner.OWNER), time.time())
        if not v.free:
            return None
        tdir = self.trial_dir(trial)
        if not owner.reachable(tdir, self.study.study_name, trial.number):
            if trial.number not in self.unreachable:
                self.unreachable.add(trial.number)
                log.warning(
                    "trial %d: %s, but this worker cannot reach its run dir %s, so it leaves the trial to "
                    "a worker that can. Fix: give every worker a study.dir on a file system they all see",
                    trial.number,
                    v.why,
                    tdir,
                )
            return None
        why, retries = v.why, self.cfg.study.max_retries
        if v.death:
            why += f" {owner.progress(tdir)}"
            deaths = owner.count_death(self.study, trial.number)
            if deaths > retries:
                error = (
                    f"its worker died {deaths} times without recording a result (study.max_retries="
                    f"{retries}); the last time: {why}"
                )
                log.error("trial %d: failed: %s", trial.number, error)
                self.tell(trial, "FAIL", None, error)
                return None
            why += f"; death {deaths} of study.max_retries={retries}"
        hold = self._hold(trial.number)
        log.info("trial %d: resuming it in %s (%s)", trial.number, tdir, why)
        return hold

    def _hold(self, number: int) -> owner.Hold:
        self.holds[number] = owner.Hold(compat.optuna_trial(self.study, number)).start()
        return self.holds[number]

    def trial_dir(self, trial: Any) -> Path:
        """The trial's run dir, as recorded in the study when it was asked (whichever worker asked it)."""
        return Path(trial.user_attrs.get(owner.DIR) or self.dir / str(trial.number))

    # ------------------------------------------------------------------------------------------ train
    def train(self, trial: Any, hold: owner.Hold) -> None:
        """Rank 0: train the trial it claimed; it is told (and its claim let go) at the next agreement, before
        the next trial is asked. A trial that ends otherwise is told, or left for the next worker, here."""
        try:
            self.pending = Pending(trial, hold, self._trained(trial))
        except BaseException as e:
            try:
                if isinstance(e, Preempted):
                    # the next worker resumes it at once, and counts no death
                    hold.left(e.step, e.signal_name)
                elif isinstance(e, ResourceError) and not storage.failed(e):
                    # as preempted: no death counted for what the machine refused
                    hold.left(-1, "a full disk")
            finally:
                hold.release()
            raise

    def _tell_pending(self) -> None:
        if self.pending is None:
            return
        done, self.pending = self.pending, None
        try:
            if done.ended is not None:
                self._tell_trained(done.trial, *done.ended)
        finally:
            done.hold.release()  # only once told: a claim let go before would let another worker take it over

    def _trained(self, trial: Any) -> Ended | None:
        """Train ``trial``; how it ended, to be told once (None: told already, it failed). A preemption leaves
        it RUNNING for a resume (the worker exits)."""
        tdir = self.trial_dir(trial)
        log.info(
            "trial %d (%s): %s",
            trial.number,
            rundir.label({k: str(v) for k, v in trial.params.items()}),
            tdir,
        )
        handler = log_to(tdir / "train.log")  # the trial's own train.log, beside the worker's
        try:
            # a trial that cannot be composed: told
            cfg = trial_config(self.cfg, trial.number, trial.params, str(tdir))
            metrics = self._through_rank_deaths(trial.number, cfg)
        except Preempted:
            log.warning(
                "trial %d stays RUNNING: it resumes from its checkpoint when a worker starts again",
                trial.number,
            )
            raise
        except Exception as e:
            if self._failed(trial, e):
                raise
            return None
        finally:
            logging.getLogger().removeHandler(handler)
            handler.close()
        note = str((rundir.read_result(tdir) or {}).get("note") or "")
        value = objective_value(metrics, str(cfg.objective))
        outcome = "PRUNED" if note.startswith(PRUNED) else "COMPLETE" if value is not None else "FAIL"
        return cfg, tdir, outcome, value, metrics

    def _failed(self, trial: Any, e: Exception) -> bool:
        """A trial's job ended with ``e``: told FAIL, or left RUNNING for the next worker (its worker stops:
        True, ``e`` propagates), or told FAIL with the study going on (False). The trial's error is the job's
        record (``ddplab.failure``): a rank that only lost its peer carries the peer's error, not the lost
        connection."""
        ended = failure.of(e)
        cause = (ended.record or {}).get("error") or f"{type(e).__name__}: {e}"
        if ended.kind == "config":  # every trial would fail alike: fail this one and stop the worker
            self._tell_or_keep(trial, "FAIL", None, cause)
            return True
        # a rank of it died without a word: its death, the next worker counts
        if isinstance(e, group.PeerLost):
            log.warning(
                "trial %d stays RUNNING: a rank of it was killed; the next worker resumes it, counting a "
                "death",
                trial.number,
            )
            return True
        lost = storage.failed(e)  # the trial's own report to the storage failed: so will the next trial's
        if ended.kind == "resource" and not lost:  # a full disk: not the params' fault; every next trial too
            log.warning(
                "trial %d stays RUNNING: the next worker resumes it from its checkpoint once there is "
                "room (this worker stops)",
                trial.number,
            )
            return True
        self._tell_or_keep(trial, "FAIL", None, storage.innermost(e) if lost else cause)
        if lost:
            raise storage.StorageLost(self.url, e, f"trial {trial.number} told FAIL") from None
        # ranks may have failed at different points: torchrun ends them, the study stays
        if env.is_launched():
            return True
        if was_said(e):  # by the trial's job, where it happened
            log.warning(
                "trial %d failed (its error is above, and in %s), the study goes on",
                trial.number,
                self.trial_dir(trial) / rundir.RESULT,
            )
        else:
            log.error("trial %d failed, the study goes on: %s", trial.number, cause)
        return False

    def _through_rank_deaths(self, number: int, cfg: DictConfig) -> dict[str, float]:
        """The trial's job; a rank of it killed (the OOM killer, a SIGKILL) is a death of the trial as its
        worker's would be — counted in the storage, and the trial resumed from its checkpoint, here, up to
        ``study.max_retries`` times — not a failure of the trial's params."""
        from ddplab.job import train
        from ddplab.runtime.launch import RankFailed

        retries = self.cfg.study.max_retries
        while True:
            try:
                return train(cfg, search_earlier_runs=False)
            except RankFailed as e:
                # lapsed: another worker has it
                if e.killed_by is None or not self.holds[number].still_mine():
                    raise
                deaths = owner.count_death(self.study, number)
                if deaths > retries:
                    raise RankFailed(f"{e} (death {deaths}, past study.max_retries={retries})") from None
                log.warning(
                    "trial %d: a rank was killed by %s: death %d of study.max_retries=%d, resuming it from "
                    "its checkpoint",
                    number,
                    e.killed_by,
                    deaths,
                    retries,
                )

    # ------------------------------------------------------------------------------------------ tell
    def _tell_trained(
        self,
        trial: Any,
        cfg: DictConfig,
        tdir: Path,
        outcome: str,
        value: float | None,
        metrics: dict[str, float],
    ) -> None:
        why = "" if outcome != "FAIL" else f"{cfg.objective} is {metrics.get(cfg.objective)}"
        self._tell_or_keep(trial, outcome, value, why)
        try:
            summary.write_hparams(cfg, tdir, trial, outcome)
        except OSError as e:  # told already; rank 0 alone writes it, while its peers wait for the next trial
            log.error(
                "trial %d: its HParams row could not be written (%s); the study goes on", trial.number, e
            )
        log.info(
            "trial %d: %s %s=%s",
            trial.number,
            outcome,
            cfg.objective,
            "" if value is None else f"{value:.6g}",
        )

    def _tell_or_keep(self, trial: Any, outcome: str, value: float | None, error: str = "") -> None:
        """:meth:`tell`; where the storage cannot take it, the trial stays RUNNING and the line says so (the
        next worker, on a mended storage, resumes it as one whose worker died)."""
        try:
            self.tell(trial, outcome, value, error)
        except Exception as e:
            if not storage.failed(e):
                raise
            raise storage.StorageLost(
                self.url, e, f"trial {trial.number} stays RUNNING in the study: the storage cannot be written"
            ) from None

    def tell(self, trial: Any, outcome: str, value: float | None, error: str = "") -> None:
        """Tell the study once how the trial ended (``outcome``: COMPLETE, PRUNED or FAIL), and record it in
        its run dir (result.json's ``trial``)."""
        from optuna.trial import TrialState

        hold = self.holds.pop(trial.number, None)
        if hold is not None:
            hold.release()
            if not hold.still_mine():  # its lease ran out while this worker was away: the new holder tells it
                log.error(
                    "trial %d: another worker took it over while this one worked on it (this worker's hold "
                    "lapsed: no beat for %.0fs); it is not told %s here",
                    trial.number,
                    owner.LEASE_S,
                    outcome,
                )
                return
        if error:
            compat.optuna_trial(self.study, trial.number).set_user_attr("error", error[:1000])
        try:
            if outcome == "COMPLETE":
                self.study.tell(trial.number, value)
            else:
                self.study.tell(trial.number, state=TrialState[outcome])
        # told (stored first); a GridSampler whose grid is done calls Study.stop, which
        except RuntimeError as e:
            if "Study.stop" not in str(e):  # only works inside Study.optimize: the limit stops us instead
                raise
        tdir = self.trial_dir(trial)
        result = rundir.read_result(tdir) or {"status": "failed", "error": error}
        result["trial"] = {
            "study": self.study.study_name,
            "number": trial.number,
            "state": outcome,
            "value": value,
            "params": trial.params,
        }
        rundir.write_result(tdir, result)
