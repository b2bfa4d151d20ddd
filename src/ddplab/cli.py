"""Command-line plumbing around ``@hydra.main``: argv fix-ups before Hydra parses
``sys.argv``, and the sweep failure policy after a job returns or raises."""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from ddplab import compat, failure, modes, redact, rundir
from ddplab.runtime import env, requeue, watch
from ddplab.runtime.console import quiet_log_files
from ddplab.runtime.group import plain_message
from ddplab.runtime.signals import Preempted

log = logging.getLogger("ddplab")

_RANK_LOCAL_KEYS = ("hydra.run.dir=", "hydra.sweep.dir=", "hydra.output_subdir=")


def prepare_argv(argv: list[str]) -> list[str]:
    """Fix up argv for the launcher this process runs under.

    * ``torch.distributed.launch`` appends ``--local-rank=N``; Hydra would
      reject it, so it moves to LOCAL_RANK.
    * After a torchrun restart (--max-restarts), rank 0 reuses the run dir of
      the first attempt, where the checkpoints are.
    * Under torchrun every rank runs ``@hydra.main``, and each would create its
      own timestamped output dir (two, if the ranks straddle a second). Ranks
      other than 0 get a throwaway dir instead, removed at exit, and no
      ``.hydra/`` copy; ``ddplab.run`` hands them rank 0's dir.
    """
    argv = env.consume_legacy_local_rank(list(argv))
    rank = env.rank()
    _remove_orphans()
    if rank == 0:
        _check_writable(argv)
        memo = env.run_dir_memo()
        noted = env.read_memo(memo) if memo and env.elastic_restart_count() > 0 else None
        single = not rundir.is_multirun(argv)
        if noted and single:
            # torchrun restarted us after a failure: continue in the same run dir.
            argv = [a for a in argv if not a.startswith("hydra.run.dir=")] + [f"hydra.run.dir={noted}"]
        elif (
            env.slurm_job() and single and not any(a.startswith(("hydra.run.dir=", "run_dir=")) for a in argv)
        ):
            # A SLURM batch job's dir is named after the job, so a requeued job (same id, the batch
            # script run again) finds its checkpoints: outputs/slurm-1234 (array task: slurm-1234_7).
            argv = argv + [f"hydra.run.dir=outputs/slurm-{env.slurm_job()}"]
        return argv
    scratch = tempfile.mkdtemp(prefix=f"ddplab-rank{rank}-{os.getpid()}-")
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    argv = [a for a in argv if not a.startswith(_RANK_LOCAL_KEYS)]
    extra = [f"hydra.run.dir={scratch}", f"hydra.sweep.dir={scratch}", "hydra.output_subdir=null"]
    if not any(a.startswith("hydra/hydra_logging=") for a in argv):
        extra.append("hydra/hydra_logging=disabled")  # rank 0 alone announces the sweep's jobs
    return argv + extra


def _check_writable(argv: list[str]) -> None:
    """Refuse, in one line and before Hydra writes anything, a run dir nobody can write (Hydra
    would fail with "Unable to configure handler 'file'"): a read-only mount, a missing permission.
    A dir another job holds is refused by :class:`OwnRunDir`, which takes the lock itself."""
    key = "hydra.sweep.dir=" if rundir.is_multirun(argv) else "hydra.run.dir="
    named = [a[len(key) :] for a in argv if a.startswith(key)]
    target = Path(named[-1].split("${")[0] or ".") if named else Path.cwd()
    probe = target.absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        if not probe.is_dir():
            raise NotADirectoryError(f"{probe} is not a directory")
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        failure.refuse(
            f"error: cannot write the run dir {target} ({e.strerror or e} at {probe}). Fix: "
            f"{key}<a writable directory>{' or run from a writable working directory' if not named else ''}"
        )


class OwnRunDir(Callback):
    """Hydra callback (conf/train.yaml): rank 0 locks the run dir — a sweep's process, the sweep dir —
    before Hydra writes a byte there (``.hydra/``, ``train.log``, ``multirun.yaml``), so a second job
    given the same dir is refused in one line, naming the holder, and never leaves its config in
    the first one's dir. The Session takes the lock over (``rundir.take_held``); a self-launch parent
    keeps it for its ranks. Hydra's own dated dirs are each made fresh (``rundir.fresh_dir``)."""

    def on_run_start(self, config: DictConfig, **kwargs: object) -> None:
        if env.rank() == 0:
            target = Path(str(config.get("run_dir") or config.hydra.run.dir)).absolute()
            # A named dir inside a running sweep's dir is that sweep's job dir.
            _hold(target.parent, rundir.lock_holder(target.parent))
            _hold(target, rundir.hold(target))

    def on_multirun_start(self, config: DictConfig, **kwargs: object) -> None:
        redact.use(redact.keys_of(config))  # Hydra's lines of the jobs it launches are masked too
        _no_secret_for_submitit(config)
        if env.rank() == 0:
            target = Path(str(config.hydra.sweep.dir)).absolute()
            _hold(target, rundir.hold(target), "hydra.sweep.dir")

    def on_job_start(self, config: DictConfig, **kwargs: object) -> None:
        """Hydra has just written the job's config and overrides (``.hydra/``, a sweep's ``multirun.yaml``):
        the copies on disk get the job's secrets masked (ddplab.redact); the job keeps the real values."""
        keys = redact.keys_of(config)
        redact.use(keys)
        hc = config.hydra
        files = (
            [
                Path(hc.runtime.output_dir) / str(hc.output_subdir) / n
                for n in ("config.yaml", "hydra.yaml", "overrides.yaml")
            ]
            if hc.output_subdir
            else []
        )
        if rundir.is_multirun():
            files.append(Path(str(hc.sweep.dir)) / "multirun.yaml")
        for f in files:
            if f.is_file():
                plain = OmegaConf.to_container(OmegaConf.create(f.read_text()), resolve=False)
                masked = redact.node(plain, keys)
                if masked != plain:  # most configs hold no secret: their copies are left as Hydra wrote them
                    f.write_text(OmegaConf.to_yaml(OmegaConf.create(masked)))

    def on_run_end(self, config: DictConfig, **kwargs: object) -> None:
        rundir.release_held()  # what no Session took over (a self-launch parent's lock)

    def on_multirun_end(self, config: DictConfig, **kwargs: object) -> None:
        # listed first in conf/: Hydra ends callbacks in reverse, the summary is written
        rundir.release_held()


def _no_secret_for_submitit(config: DictConfig) -> None:
    """submitit's launchers pickle the whole config and the jobs' overrides into ``<sweep dir>/.submitit/``
    for the jobs to load: a secret written out in them would sit there unmasked. Refused before anything is
    written; the secret can reach the jobs through their environment instead, which submitit hands on and
    writes nowhere."""
    if "submitit" not in str(config.hydra.launcher.get("_target_", "")):
        return
    found = sorted(
        redact.written_out(OmegaConf.to_container(config, resolve=False), redact.keys_of(config)),
        key=lambda k: k.startswith("hydra."),
    )  # the user's key before Hydra's copy of the override
    if found:
        name = str(config.hydra.launcher._target_).rsplit(".", 1)[-1]
        # The sweep dir as written, unresolved: resolving ${fresh_dir:...} would make the dir of a refused
        # sweep.
        sweep_dir = str(OmegaConf.to_container(config.hydra.sweep, resolve=False)["dir"])
        into = "the sweep dir's .submitit/" if "${" in sweep_dir else f"{sweep_dir}/.submitit/"
        failure.refuse(
            f"config error: {found[0]} holds a secret, and submitit ({name}) would write it unmasked "
            f"into {into}. Fix: keep it in the environment: a tracking URI's "
            "user and password as MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD, a PostgreSQL "
            "storage's as PGPASSWORD, any other value as ${oc.env:YOUR_VARIABLE}"
        )


def _hold(target: Path, holder: str | None, key: str = "hydra.run.dir (or run_dir)") -> None:
    if holder:
        failure.refuse(f"error: {rundir.in_use(target, holder, key)}")


def _remove_orphans() -> None:
    """Leftovers of processes that are gone (killed: atexit never ran):

    * ``ddplab-rank<r>-<pid>-*``: scratch Hydra dirs of non-zero ranks;
    * ``ddplab-<uid>/run-<run id>-<agent pid>``: restart memos of torchrun jobs that failed for good.
    """
    tmp = Path(tempfile.gettempdir())
    found = [(d, d.name.split("-")[2]) for d in tmp.glob("ddplab-rank*-*-*")]
    found += [(f, f.name.rsplit("-", 1)[-1]) for f in env.private_dir().glob("run-*-*")]
    for path, pid in found:
        try:
            if not _gone(int(pid)):
                continue
        except (ValueError, PermissionError, OverflowError):
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _gone(pid: int) -> bool:
    """No such process, or only its zombie: a rank killed with its launcher is dead, but its pid stays taken
    until init reaps it, which under load comes after the next start looks."""
    try:
        os.kill(pid, 0)  # raises if no such process
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def main(cfg: DictConfig) -> float | None:
    """Body of train.py's ``@hydra.main``: run the job, hand the objective to the sweeper.

    A failure ends as ``ddplab.failure.of`` says: one line, result.json, the exit code. In a sweep (``-m``) a
    failing job is recorded and reported to the sweeper as NaN, so the other jobs still run. Exceptions: a
    stop signal ends the sweep (the machine is going away), and so does any failure in a sweep *inside*
    torchrun — its ranks may have failed at different points (one mid-collective), and continuing would pair
    them up on different jobs; self-launched jobs (distributed.nproc_per_node) survive.
    """
    watch.own_the_process()  # a join that outlives its deadline may end this process (runtime.watch)
    quiet_log_files()  # Hydra's train.log on a full disk: one line, not a traceback per record
    try:
        metrics = modes.entry(cfg)(cfg)  # the mode's table: ddplab.modes
    except Exception as e:
        ended = failure.of(e, env.rank())
        # checkpointed; SLURM time limit: back in the queue; submitit: its protocol
        if isinstance(e, Preempted):
            requeue.after_preemption(e)
        if not rundir.is_multirun() or not ended.sweep_goes_on:
            _record_failure(cfg, ended)
            failure.leave(ended, e)
        if env.is_launched() and not env.is_self_launched() and ended.kind != "config":
            log.error(
                "a failed job stops a sweep inside torchrun (ranks cannot be re-paired safely); "
                "use distributed.nproc_per_node=N without torchrun for sweeps that outlive failures"
            )
            # Hydra would catch an exception and start the next job; leave instead, so torchrun ends the
            # other ranks (a peer may be blocked mid-collective): exit 1, the line above the only one.
            failure.leave(replace(ended, code=failure.CRASH_EXIT, line=None, waits=False, traceback=False), e)
        log.error("job failed, the sweep goes on: %s: %s", type(e).__name__, plain_message(e))
        _record_failure(cfg, ended)
        return float("nan")
    return metrics.get(cfg.objective)


def _record_failure(cfg: DictConfig, ended: failure.Failure) -> None:
    """A job that failed before its Session (a bad value, a refused launch) has no result.json yet:
    rank 0 writes one, so ``resume=auto`` and a sweep's summary see it failed, and why."""
    run_dir = rundir.own_run_dir(cfg)
    if ended.record and env.rank() == 0 and run_dir.is_dir() and rundir.read_result(run_dir) is None:
        rundir.write_result(run_dir, ended.record)


# ------------------------------------------------------ Hydra's mode look-up, where it cannot matter
_CONFIG_FLAGS = (
    "--config-dir",
    "-cd",
    "--config-path",
    "-cp",
    "--config-name",
    "-cn",
    "--experimental-rerun",
)


def skip_needless_mode_lookup(conf: Path) -> None:
    """Before the job's own compose, ``@hydra.main`` composes the whole config once more only to read
    ``hydra.mode`` (run or multirun): about 0.15 s of every start, on every rank. Where nothing the command
    line selects can set it — no ``hydra...`` override, no option file of ``conf`` that sets it (or pulls in
    one that does), no other config dir — Hydra's look-up can only find it unset; it is answered so without
    composing (``compat.answer_hydra_mode``; ``tests/unit/test_mode_lookup.py`` checks the answer against
    Hydra's for every option in ``conf``)."""
    compat.answer_hydra_mode(lambda overrides: mode_may_be_set(conf, overrides, sys.argv))


def mode_may_be_set(conf: Path, overrides: list[str], argv: list[str]) -> bool:
    """Whether ``hydra.mode`` may come out set: conservatively yes for another config source, any hydra
    override, or an option of ``conf`` (selected, or the primary config's default) that sets it."""
    if any(a.split("=", 1)[0] in _CONFIG_FLAGS for a in argv):
        return True
    setting = _mode_setting_options(conf)
    if "train" in setting:
        return True
    for o in overrides:
        key, _, value = o.lstrip("~+").partition("=")
        # hydra.run.dir, hydra.job.*, ...: cannot set the mode; hydra.mode, another search path or a Hydra
        # plugin's option (hydra/sweeper=...) might.
        if key in ("hydra", "hydra.mode") or key.startswith(("hydra.searchpath", "hydra/")):
            return True
        group = key.removeprefix("/")
        if any(f"{group}/{v.strip()}" in setting for v in value.strip("[]").split(",")):
            return True
    return False


def _mode_setting_options(conf: Path) -> set[str]:
    """``group/option`` of each file under ``conf`` that sets hydra.mode or whose defaults list pulls in one
    that does (``train``: the primary config)."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's, where PyYAML has it: ~10x faster
    docs = {
        str(p.relative_to(conf).with_suffix("")): yaml.load(p.read_text(), Loader=loader) or {}
        for p in conf.rglob("*.yaml")
    }
    setting = {
        n
        for n, d in docs.items()
        if isinstance(d, dict) and isinstance(d.get("hydra"), dict) and "mode" in d["hydra"]
    }
    pulls = {n: _defaults_of(n, d) for n, d in docs.items() if isinstance(d, dict)}
    while True:  # to a fixpoint: a file that pulls in a setting file sets it too
        more = {n for n, picked in pulls.items() if n not in setting and picked & setting}
        if not more:
            return setting
        setting |= more


def _defaults_of(name: str, doc: dict[str, Any]) -> set[str]:
    """The ``group/option`` files a config's defaults list selects (``override``/``optional`` entries too;
    a group relative to the file's own, or absolute with a leading ``/``)."""
    here = name.rsplit("/", 1)[0] if "/" in name else ""
    out = set()
    for entry in doc.get("defaults") or []:
        if not isinstance(entry, dict):
            continue
        for key, value in entry.items():
            group = key.split()[-1].split("@")[0]
            group = group[1:] if group.startswith("/") else f"{here}/{group}".strip("/")
            for option in value if isinstance(value, list) else [value]:
                if option is not None:
                    out.add(f"{group}/{option}")
    return out
