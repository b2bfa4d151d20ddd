"""What one soak trial runs, by mode (scripts/soak.py): the job faulted, then what a user does next — resume
it (a training run), start the worker again (a study), run it again (verify_resume) — and the mode's final
checks."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any, Callable

from _soak_checks import (
    GRACE_S,
    Attempt,
    check_fault,
    check_final,
    check_preempted,
    check_tracking,
    load,
    read_result,
    run_attempt,
    spoil_newest,
    tracebacks,
)
from soak_plan import Trial

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "train.py"
PASS = "verify_resume: PASS"
VERDICT = "Likely cause:"  # verify_resume's FAIL verdict: the job itself does not resume exactly


def command(t: Trial, run: Path, resume: bool = False) -> list[str]:
    """The job's command line. A study worker's trials go to ``run`` (its own dir inside), and it resumes its
    trials itself; verify_resume starts from scratch (a rerun gets a fresh ``run``)."""
    where = (
        [f"study.dir={run}", f"hydra.run.dir={run}/worker"] if t.mode == "study" else [f"hydra.run.dir={run}"]
    )
    args = t.overrides() + where + (["resume=auto"] if resume and t.mode == "train" else [])
    if t.launcher == "torchrun":
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={t.world}",
            str(TRAIN),
            *args,
        ]
    if t.launcher == "slurm":  # a job step of N tasks, the ranks (ddplab reads SLURM_PROCID/NTASKS)
        return ["srun", f"--ntasks={t.world}", "--cpus-per-task=1", sys.executable, str(TRAIN), *args]
    return [sys.executable, str(TRAIN), *args] + (
        [f"distributed.nproc_per_node={t.world}"] if t.launcher == "selflaunch" else []
    )


def short_tmp(tdir: Path) -> str:
    """The trial's TMPDIR (``tdir/tmp``) by a short name: a symlink in /tmp. A soak under pytest's long tmp
    paths would otherwise give loader workers a socket path over the 107 bytes allowed (ddplab refuses that
    config)."""
    link = Path(tempfile.gettempdir()) / f"sk-{zlib.crc32(str(tdir).encode()):08x}"
    if not link.is_symlink():
        with contextlib.suppress(FileExistsError):
            link.symlink_to(tdir / "tmp")
    return str(link)


def job_env(t: Trial, tdir: Path, trial_id: str, fault: bool) -> dict[str, str]:
    """helpers.jobs.job_env()'s environment, plus the trial's: its own TMPDIR, its id, the delays and the
    fault."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "TORCHELASTIC", "SOAK_"))
    }
    # srun names its job so (the driver cancels an allocation srun's death left behind)
    if t.launcher == "slurm":
        env["SLURM_JOB_NAME"] = trial_id
    env.update(
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        TMPDIR=short_tmp(tdir),
        SOAK_TRIAL_ID=trial_id,
        SOAK_DIR=str(tdir),
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "tests"), env.get("PYTHONPATH")])),
    )
    if t.tracking == "wandb":  # offline, its own folders in the trial's dir (not the working dir), no key
        for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
            env.pop(name, None)
        env["NETRC"] = str(tdir / "no.netrc")
        home = str(tdir / "wandb-home")
        env.update({name: home for name in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR")})
    if fault:
        run = tdir / "cwd" / "run"
        env.update(
            SOAK_DELAY_S=repr(t.step_s / t.accum),
            SOAK_EVAL_DELAY_S=repr(t.eval_s),
            SOAK_FAULT=json.dumps(
                {
                    "phase": "fetch" if t.phase in ("data", "between") else t.phase,
                    "k": t.k,
                    "rank": t.rank,
                    "target": t.target,
                    "signal": t.signal,
                    "dir": str(tdir),
                    "fault": t.fault,
                    "disk": str(run),
                    "storage": str(run / "study.db"),
                    "server": t.server_pid,
                }
            ),
        )
    return env


def train_flow(t: Trial, tdir: Path, cwd: Path, run: Path, ref) -> tuple[list[str], list[str]]:
    problems, notes, final_eval_resume = fault_and_resume(t, tdir, cwd, run)
    return problems + check_final(run, ref(), final_eval_resume) + check_tracking(t, [run], notes), notes


def after_fault(t: Trial, tdir: Path, run: Path, notes: list[str]) -> None:
    """Between the faulted attempt and the next: the disk freed (disk_full), the newest checkpoint of the run
    the fault hit spoilt (bad_file)."""
    (run / "soak-filler").unlink(missing_ok=True)
    if t.fault == "bad_file" and (tdir / "fired").exists():
        hit = json.loads((tdir / "fired").read_text()).get("run_dir") or str(run)
        if t.mode == "study" and read_result(Path(hit)).get("status") == "completed":
            notes.append("its worker resumed the trial itself (a killed rank is a death) and completed it")
            return
        # a study's worker resumes its trials by itself (no resume=null to follow): one good checkpoint stays
        spoil_newest(Path(hit) / "checkpoints", notes, keep_one=t.mode == "study")


def fault_and_resume(t: Trial, tdir: Path, cwd: Path, run: Path) -> tuple[list[str], list[str], bool]:
    """The faulted run, then resumes until it completes (at most 3): problems, notes, resumed at the last
    epoch's end."""
    log, env, notes = tdir / "run.log", job_env(t, tdir, f"soak-{os.getpid()}-{t.seed}", True), []
    timeout = attempt_timeout(t, runs=1, laps=3)
    attempts = [run_attempt(command(t, run), env, cwd, log, timeout)]
    problems = check_fault(t, attempts[0], run, tdir, notes) + check_preempted(run, "the faulted run")
    after_fault(t, tdir, run, notes)
    final_eval_resume, fresh = False, False
    while read_result(run).get("status") != "completed" and len(attempts) < 4:
        final_eval_resume = at_last_epoch_end(t, run)
        attempts.append(run_attempt(command(t, run, resume=not fresh), env, cwd, log, timeout))
        if unreadable(t, attempts[-1]) and not fresh:  # as its one line says: start fresh
            notes.append("no checkpoint left readable: said in one line, exit 2; started fresh as it says")
            fresh = True
        elif attempts[-1].rc != 0:
            problems.append(f"resume {len(attempts) - 1} exited {attempts[-1].rc}")
        problems += check_preempted(run, f"resume {len(attempts) - 1}")
    problems += left_over(attempts, timeout)
    last_eval = ["rng not compared: resumed at the last epoch's end"] if final_eval_resume else []
    notes += [f"{len(attempts)} run(s)"] + last_eval
    return problems, notes, final_eval_resume


def attempt_timeout(t: Trial, runs: int, laps: int) -> float:
    """Seconds an attempt may take before it counts as hung: 180 s for each run it starts (their processes'
    start, ~60 s each beside CI's suite; a verify_resume attempt starts three: CI at 888992b killed one 181 s
    into its third), and ``laps`` times the training's own time."""
    return 180 * runs + laps * t.epochs * (t.steps_per_epoch * t.step_s + 2 * t.eval_s)


def unreadable(t: Trial, a: Attempt) -> bool:
    """bad_file spoilt the only checkpoint: resume=auto must say so in one line, exit 2, and name the fix."""
    # torchrun's own is 1
    exit_2 = a.rc == 2 or t.launcher == "torchrun" and a.rc == 1 and "exitcode  : 2" in a.out
    said = [line for line in a.out.splitlines() if "Fix: resume=null to start fresh" in line]
    return t.fault == "bad_file" and exit_2 and len(said) == 1 and not tracebacks(a.out)


def at_last_epoch_end(t: Trial, run: Path) -> bool:
    """The run's newest checkpoint is its last epoch's end: resumed there, the random streams are a fresh
    process's (each epoch reseeds them), so the final ``rng`` entry is not compared."""
    try:
        loop = load(run / "checkpoints" / "last.pt")["loop"]
    except Exception:  # none yet, or the one bad_file spoilt
        return False
    return loop.get("epoch") == t.epochs and not loop.get("batches_in_epoch")


def left_over(attempts: list[Attempt], timeout: float) -> list[str]:
    problems = []
    for i, a in enumerate(attempts):
        problems += [f"attempt {i} timed out after {timeout:.0f}s"] if a.timed_out else []
        problems += (
            [f"attempt {i}: processes alive {GRACE_S:.0f}s after it ended: {a.left}"] if a.left else []
        )
    return problems


def study_flow(
    t: Trial, tdir: Path, cwd: Path, run: Path, ref: Callable[[], Path]
) -> tuple[list[str], list[str]]:
    """A study worker faulted in one of its two trials, then workers started again until both are done (at
    most 3); each trial then bitwise its uninterrupted study's, told once, with the same value. storage_loss:
    the worker ends in one line, and there is no study left to finish."""
    log, env, notes = tdir / "run.log", job_env(t, tdir, f"soak-{os.getpid()}-{t.seed}", True), []
    timeout = attempt_timeout(t, runs=2, laps=6)
    attempts = [run_attempt(command(t, run), env, cwd, log, timeout)]
    fired = json.loads((tdir / "fired").read_text()) if (tdir / "fired").exists() else {}
    hit = Path(fired.get("run_dir") or run / "0")
    problems = check_fault(t, attempts[0], hit, tdir, notes) + check_preempted(hit, "the faulted trial")
    if t.fault == "storage_loss":
        return problems + left_over(attempts, timeout), notes
    after_fault(t, tdir, run, notes)
    skip_rng = {hit.name: at_last_epoch_end(t, hit)}
    while len(attempts) < 4 and [s for s, _ in told(run)] != ["COMPLETE", "COMPLETE"]:
        attempts.append(run_attempt(command(t, run), env, cwd, log, timeout))
        problems += [f"worker {len(attempts) - 1} exited {attempts[-1].rc}"] if attempts[-1].rc else []
    notes.append(f"{len(attempts)} worker run(s)")
    problems += left_over(attempts, timeout)
    mine, theirs = told(run), told(ref())
    if mine != theirs:
        problems.append(f"the study was told {mine}, its uninterrupted study {theirs}")
    for n in ("0", "1"):
        problems += [f"trial {n}: {p}" for p in check_final(run / n, ref() / n, skip_rng.get(n, False))]
    return problems + check_tracking(t, [run / "0", run / "1"], notes), notes


def told(study_dir: Path) -> list[tuple[str, Any]]:
    """(state, value) of each trial in the study's storage, in trial order."""
    import optuna

    if not (study_dir / "study.db").exists():
        return []
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    store = optuna.storages.RDBStorage(f"sqlite:///{study_dir / 'study.db'}")
    try:
        return [
            (tr.state.name, tr.value)
            for tr in optuna.load_study(study_name="digits_lr_wd", storage=store).get_trials()
        ]
    finally:
        store.engine.dispose()


def verify_flow(
    t: Trial, tdir: Path, cwd: Path, run: Path, ref: Callable[[], Path]
) -> tuple[list[str], list[str]]:
    """mode=verify_resume faulted: it says PASS (the fault missed what it compares) or fails without a verdict
    on the job (a FAIL would blame the user's code for an outside fault), in one line; run again, it says
    PASS. The uninterrupted leg of the run that passed is bitwise the plain training run."""
    log, env, notes = tdir / "run.log", job_env(t, tdir, f"soak-{os.getpid()}-{t.seed}", True), []
    timeout = attempt_timeout(t, runs=3, laps=8)
    attempts = [run_attempt(command(t, run), env, cwd, log, timeout)]
    a, problems, passed = attempts[0], [], run
    if not (tdir / "fired").exists():
        problems.append("the fault never fired (k beyond the calls the job made?)")
    errors = [
        line
        for line in a.out.splitlines()
        if "verify_resume: " in line and ("ERROR" in line or "WARNING" in line)
    ]
    notes.append(f"exit {a.rc}: {(errors or ['PASS' if PASS in a.out else 'no line'])[-1][-200:]}")
    # verify_resume's own process too
    killed_itself = t.signal == "SIGKILL" and t.target == "all" and a.rc == -9
    if a.rc != 0 and not errors and not killed_itself:
        problems.append(f"verify_resume exited {a.rc} without a line saying why: {a.out[-600:]!r}")
    if a.rc == 0 and PASS not in a.out:
        problems.append("verify_resume exited 0 without saying PASS")
    if VERDICT in a.out or "Traceback" in a.out:
        problems.append(f"after {t.fault}, verify_resume said: {(errors or [a.out[-600:]])[-1]!r}")
    if a.rc != 0:
        after_fault(t, tdir, run, notes)
        passed = cwd / "run-again"
        attempts.append(run_attempt(command(t, passed), env, cwd, log, timeout))
        if attempts[-1].rc != 0 or PASS not in attempts[-1].out:
            problems.append(f"verify_resume run again: exit {attempts[-1].rc}: {attempts[-1].out[-600:]!r}")
    return problems + left_over(attempts, timeout) + check_final(
        passed / "verify_resume" / "uninterrupted", ref()
    ), notes
