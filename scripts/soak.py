"""Fault-injection soak of the preemption promises: nothing lost, bitwise resume, exact metrics, no run mixed
up with another (issue 22, item 9; issue 32). Each trial beside its uninterrupted reference.

    python scripts/soak.py --pairwise [--plan]      # the fixed plan: every pair of dimension values once
    python scripts/soak.py --pairwise --part 2/4    # a quarter of it (CI: one a commit), every value in it
    python scripts/soak.py --trials 20 --seed 1     # 20 trials drawn at random from seed 1
    python scripts/soak.py --only 1234567 [--long]  # one trial again, exactly (a failure prints the command)
    python scripts/soak.py --trials 300 --seed 5 --jobs 2 --minutes 45   # no trial started after 45 min

A trial (tests/soak_plan.py: its dimensions and their values) is a launcher and world size (1-3 ranks; with
``--slurm``, srun too), a strategy, data, a checkpoint mode, a run mode, a step time (a sleep before the fault
fires, none in the resumes), grad accumulation, one feature in play, a tracker (MLflow up, down, killed; W&B),
and one fault made by rank r on its k-th call of a phase (tests/soak_toy.py, from inside the job, once): a
signal to itself, a peer, its launcher or every process of the job; or a full disk, a spoilt checkpoint, a
lost study storage. ``--pairwise`` fixes the dimensions by the plan, the rest from each trial's seed. What a
user does next depends on the mode (scripts/_soak_flows.py): a run reruns with ``resume=auto`` until it
completes, a study's worker is started again until its trials are done, verify_resume runs again. The trial
checks (scripts/_soak_checks.py):

1. final model/optimizer/scheduler/loop/rng/results bitwise equal to an uninterrupted run (cached per config
   and launcher; run without delays, which only sleep, beside the faulted one);
2. TensorBoard: no step twice per tag; val/* bitwise; train/loss, train/acc bitwise where the log interval is
   the reference's. A stop between log steps logs the interval so far before its checkpoint, splitting the
   reference's interval (p, t]: its mean must equal the parts' steps-weighted mean (relative 1e-5);
3. result.json: after SIGTERM/SIGINT/SIGUSR1, ``preempted`` (or ``completed``: the signal came after the last
   stop check), non-zero exit, step == its checkpoint's loop.step >= the step the fault fired at (any
   ``preempted`` run: the same consistency); ``completed`` at the end;
4. no process of the trial (its SOAK_TRIAL_ID environment entry) alive 30 s after the launched one ended;
5. nothing changed in the trial's working dir outside the run dir; none of ddplab's scratch (``ddplab-rank*``,
   ``ddplab-<uid>/*``) left in the trial's TMPDIR (others, torch's, are noted);
6. SIGTERM/SIGINT/SIGUSR1: signal -> every process of the job gone within 30 s (torchrun's grace);
7. a full disk or a lost storage: the job fails in one line naming the cause, no traceback of ddplab's; a
   study: told exactly what its uninterrupted twin was told, each trial's checkpoint bitwise its twin's;
   verify_resume: PASS, or a failure without a verdict on the job, then PASS when run again;
8. MLflow with its server up: each run's MLflow run FINISHED, holding TensorBoard's scalars at the same steps,
   each step once (vitals/* aside); down or killed, the invariants above all the same. W&B (offline): the
   run's files, one per attempt that reached it, hold TensorBoard's scalars, each (step, key) in one file,
   the last file ending the run with exit code 0.
Exit 1 if any trial failed; each failure prints its seed, config and the command that reruns it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
# tests/: the in-job half (faults, delays), the trials and the plan, the one bitwise comparison
from _soak_checks import check_files, read_result, run_attempt  # noqa: E402
from _soak_data import hf_dir, shard_dir, token_file  # noqa: E402
from _soak_flows import command, job_env, short_tmp, study_flow, train_flow, verify_flow  # noqa: E402
from _soak_stop import STOPPING, end_everything_when_stopped  # noqa: E402
from helpers.tracking import serve  # noqa: E402
from soak_draw import draw, trial_seeds  # noqa: E402
from soak_driver import snapshot  # noqa: E402
from soak_pairs import coverage, plan_trials  # noqa: E402
from soak_plan import DIMENSIONS, SLURM, Trial, dimensions  # noqa: E402

DISK = "size=64m"  # disk_full: the run dir's tmpfs, room for a trial's run until the fault fills it


def reference(t: Trial, root: Path, cache: dict) -> Path:
    """The uninterrupted run of t's config and launcher (no delays, no fault), made once per soak run: a
    study's whole study; for verify_resume, the plain training run its uninterrupted leg must equal."""
    if t.mode == "verify_resume":
        t = dataclasses.replace(t, mode="train")
    # a tracker changes no number the trial compares (and a killed server is the trial's)
    if t.tracking != "none":
        t = dataclasses.replace(t, tracking="none", server="up", tracking_uri="", server_pid=0)
    # torchrun's run: a job's results do not depend on its launcher (checked so), and
    if t.launcher == "slurm":
        t = dataclasses.replace(t, launcher="torchrun")  # a second srun would queue for the one node's 2 CPUs
    key = (t.launcher, t.world, tuple(t.overrides()))
    if key not in cache:
        n = len(list(root.glob("ref-*")))  # not len(cache): a failed reference keeps its dir (for its log)
        while True:  # claimed by its creation: trials run at once (--jobs) may look at the same time
            rdir = root / f"ref-{n}"
            try:
                rdir.mkdir()
                break
            except FileExistsError:
                n += 1
        (rdir / "cwd").mkdir()
        (rdir / "tmp").mkdir()
        run = rdir / "cwd" / "run"
        a = run_attempt(
            command(t, run),
            job_env(t, rdir, f"soak-ref-{os.getpid()}-{n}", False),
            rdir / "cwd",
            rdir / "run.log",
            600,
        )
        Path(short_tmp(rdir)).unlink(missing_ok=True)
        done = [run / str(i) for i in range(2)] if t.mode == "study" else [run]
        if a.rc != 0 or any(read_result(d).get("status") != "completed" for d in done):
            raise RuntimeError(f"the reference run failed (exit {a.rc}): see {rdir / 'run.log'}")
        cache[key] = run
    return cache[key]


@contextlib.contextmanager
def run_disk(t: Trial, run: Path):
    """disk_full: the run dir on a tmpfs of its own (the fault fills it), unmounted after; else nothing."""
    if t.fault != "disk_full":
        yield
        return
    run.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", DISK, "tmpfs", str(run)], capture_output=True
    ).returncode:
        raise RuntimeError(f"cannot mount a tmpfs at {run} for disk_full (needs root)")
    try:
        yield
    finally:
        # the run is copied off the tmpfs before it goes: a failed trial's files stay to be read
        keep = run.parent / "run-on-disk"
        shutil.copytree(run, keep, symlinks=True, ignore=shutil.ignore_patterns("soak-filler"))
        subprocess.run(["umount", "-l", str(run)], capture_output=True)
        shutil.rmtree(run, ignore_errors=True)
        keep.rename(run)


@contextlib.contextmanager
def tracking_server(t: Trial, tdir: Path, shared: Callable[[], str]):
    """tracking=mlflow: the trial's tracking URI. server=up: the soak run's one server; down: a port nothing
    listens on; killed: a server of the trial's own, which its fault kills (soak_toy) and which is gone
    after."""
    if t.tracking != "mlflow":
        yield
    elif t.server == "killed":
        (tdir / "mlflow").mkdir()
        with contextlib.contextmanager(serve)(tdir / "mlflow") as uri:
            t.tracking_uri, t.server_pid = str(uri), uri.pid
            yield
    elif t.server == "up":
        t.tracking_uri = shared()
        yield
    # down: a port held bound and never listened on, so no later server can take it (connections refused)
    else:
        with socket.socket() as held:
            held.bind(("127.0.0.1", 0))
            t.tracking_uri = f"http://127.0.0.1:{held.getsockname()[1]}"
            yield


def run_trial(t: Trial, root: Path, cache: dict, shared: Callable[[], str]) -> tuple[list[str], list[str]]:
    """Fault, resume until completed, check; (problems, notes)."""
    tdir = root / f"trial-{t.seed}"
    cwd, tmp = tdir / "cwd", tdir / "tmp"
    cwd.mkdir(parents=True)
    tmp.mkdir()
    run, before = cwd / "run", snapshot(cwd)
    # The uninterrupted reference runs beside the faulted attempts (its own dirs, trial id and session; faults
    # fire by call count, not by time): on 2 cores a trial takes less, and the faulted job meets load.
    with concurrent.futures.ThreadPoolExecutor(1) as pool, run_disk(t, run), tracking_server(t, tdir, shared):
        ref_job = pool.submit(reference, t, root, cache)
        flow = {"train": train_flow, "study": study_flow, "verify_resume": verify_flow}[t.mode]
        problems, notes = flow(t, tdir, cwd, run, ref_job.result)
    # no attempt after it: its last run failed
    failed = t.fault == "storage_loss" and t.launcher == "torchrun"
    Path(short_tmp(tdir)).unlink(missing_ok=True)  # the short name of its TMPDIR (the dir itself is checked)
    return problems + check_files(cwd, before, tmp, notes, failed), notes


def summary(done: list[tuple[Trial, bool, float]]) -> None:
    """Held and failed trials per value of each dimension, then the totals."""
    table: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for t, held, _ in done:
        for name, value in dimensions(t).items():
            table[(name, str(value))][0 if held else 1] += 1
    print(f"\n{'dimension':10s} {'value':10s} held failed")
    extra = [("launcher", SLURM)] if ("launcher", SLURM) in table else []  # drawn with --slurm only
    for name, value in [(n, str(v)) for n, values in DIMENSIONS.items() for v in values] + extra:
        if (name, value) in table:
            print(f"{name:10s} {value:10s} {table[name, value][0]:4d} {table[name, value][1]:6d}")
    walls = [w for _, _, w in done] or [0.0]
    held = sum(h for _, h, _ in done)
    print(
        f"{held}/{len(done)} trials held; wall per trial: median {statistics.median(walls):.0f}s, "
        f"max {max(walls):.0f}s, total {sum(walls) / 60:.1f} min"
    )


def report_failure(t: Trial, problems: list[str], root: Path) -> None:
    print(f"  FAILED trial seed {t.seed}: {json.dumps(dataclasses.asdict(t))}")
    for p in problems:
        print(f"    - {p}")
    print(f"    files: {root / f'trial-{t.seed}'}")
    print(f"    reproduce: {t.rerun()}")


class NotInPlan(ValueError):
    """``--only SEED --pairwise`` with a seed the plan does not hold."""


def part(text: str) -> tuple[int, int]:
    """--part K/N, 1 <= K <= N."""
    k, _, n = text.partition("/")
    if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise argparse.ArgumentTypeError(f"{text!r}: K/N with 1 <= K <= N, as 2/4")
    return int(k), int(n)


def choose(args: argparse.Namespace) -> list[Trial]:
    """The pairwise plan's trials (``--only``: the one with that seed) or trials drawn from seeds."""
    if args.pairwise:
        trials = plan_trials(args.seed, args.long, args.part)
        picked = [t for t in trials if args.only in (None, t.seed)]
        if not picked:
            raise NotInPlan(
                f"--only {args.only}: no trial of the pairwise plan of --seed {args.seed} has that seed. "
                "Fix: "
                f"the --seed the failure printed (python scripts/soak.py --pairwise --seed {args.seed} "
                "--plan "
                "lists its trials), or drop --pairwise for a trial drawn at random"
            )
        return picked
    seeds = [args.only] if args.only is not None else trial_seeds(args.seed, args.trials)[args.first - 1 :]
    return [draw(s, args.long, slurm=args.slurm) for s in seeds]


def run_all(
    trials: list[Trial], root: Path, keep: bool, first: int = 1, jobs: int = 1, until: float = float("inf")
) -> list[tuple[Trial, bool, float]]:
    """Every trial, ``jobs`` at a time (a trial mostly waits: its steps are sleeps, its processes start up;
    two at once on 2 cores is a loaded machine, which the trials must hold on too); each reported as it ends.
    None starts after ``until`` (a time.monotonic()): those run are the first ones, in order."""
    cache: dict = {}
    lock = threading.Lock()
    servers = contextlib.ExitStack()
    started: list[str] = []

    def shared() -> str:
        """The soak run's MLflow server (server=up trials), started at the first trial that needs it."""
        with lock:
            if not started:
                (root / "mlflow").mkdir(exist_ok=True)
                started.append(str(servers.enter_context(contextlib.contextmanager(serve)(root / "mlflow"))))
            return started[0]

    def one(i: int, t: Trial) -> tuple[Trial, bool, float] | None:
        t0 = time.time()
        if time.monotonic() >= until or STOPPING.is_set():
            return None
        try:
            problems, notes = run_trial(t, root, cache, shared)
        except Exception as e:  # the harness itself: still a failed trial, with its seed
            problems, notes = [f"harness error: {type(e).__name__}: {e}"], []
        if STOPPING.is_set():  # cut short by the stop: not the trial's failure
            return None
        wall = time.time() - t0
        with lock:
            print(
                f"[{i}/{len(trials) + first - 1}] {t.seed:10d} {t.label()}: "
                f"{'held' if not problems else 'FAILED'} "
                f"({wall:.0f}s; {'; '.join(notes)})",
                flush=True,
            )
            if problems:
                report_failure(t, problems, root)
        if not problems and not keep:
            shutil.rmtree(root / f"trial-{t.seed}", ignore_errors=True)
        return t, not problems, wall

    with servers, concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        done = list(pool.map(lambda it: one(*it), enumerate(trials, first)))
    if None in done:
        print(
            f"--minutes: stopped starting trials after {len(done) - done.count(None)} of {len(trials)}; "
            f"--first {first + done.index(None)} continues with the same --trials and --seed",
            flush=True,
        )
    return [d for d in done if d is not None]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--pairwise", action="store_true", help="the fixed plan covering every pair of dimension values"
    )
    ap.add_argument(
        "--part",
        type=part,
        help="K/N: only the K-th of the plan dealt into N parts, each with every "
        "value of every dimension (CI runs one a commit: every pair over N commits)",
    )
    ap.add_argument("--trials", type=int, default=10, help="how many trials to draw (not with --pairwise)")
    ap.add_argument(
        "--seed", type=int, default=0, help="the trials' seeds (--pairwise: their remaining details)"
    )
    ap.add_argument(
        "--first",
        type=int,
        default=1,
        help="start at this one of the --trials drawn (a soak run in "
        "parts: --trials 300 --first 151 runs the last 150 of the same 300)",
    )
    ap.add_argument("--only", type=int, help="run just the trial with this seed (as a failure prints it)")
    ap.add_argument("--long", action="store_true", help="about ten times more training per trial")
    ap.add_argument(
        "--slurm",
        action="store_true",
        help="draw srun on a SLURM cluster as a launcher too "
        "(scripts/slurm_local.sh up starts one; not with --pairwise)",
    )
    ap.add_argument("--plan", action="store_true", help="print the trials' draws and run nothing")
    ap.add_argument(
        "--keep", action="store_true", help="keep every trial's dir (failed ones are always kept)"
    )
    ap.add_argument(
        "--jobs", type=int, default=1, help="trials run at once (CI: 2: they must hold on a loaded machine)"
    )
    ap.add_argument("--workdir", type=Path, help="where trials run (default: a new temp dir)")
    ap.add_argument(
        "--minutes",
        type=float,
        help="start no trial after this many minutes (those started end); "
        "the summary covers the trials run and says which --first continues",
    )
    return ap


def _refuse_mixes(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Options that do not go together: said by argparse in one line, exit 2."""
    if args.minutes is not None and (args.pairwise or args.only is not None):
        ap.error(
            "--minutes bounds a run of --trials drawn at random (--first continues it); the pairwise plan "
            "and --only run whole: drop --minutes"
        )
    if args.first < 1 or (args.first > 1 and (args.pairwise or args.only is not None)):
        ap.error(f"--first {args.first}: one of the --trials drawn at random, counted from 1")
    if args.part and not args.pairwise:
        ap.error("--part deals the --pairwise plan into parts: add --pairwise, or drop --part")
    if args.slurm and args.pairwise:
        ap.error(
            "--slurm draws srun among the launchers at random; the --pairwise plan is fixed: drop one of them"
        )
    idle = (
        subprocess.run(["sinfo", "-h", "-t", "idle,mixed"], capture_output=True, text=True)
        if args.slurm
        else None
    )
    if idle is not None and idle.stdout.strip() == "":
        ap.error("--slurm: no SLURM node is up (sinfo lists none idle). Fix: scripts/slurm_local.sh up")


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    # data prep counts
    until = time.monotonic() + 60 * args.minutes if args.minutes is not None else float("inf")
    _refuse_mixes(ap, args)
    try:
        trials = choose(args)
    except NotInPlan as e:  # a seed the plan does not hold: said in one line, exit 2 like a config error
        print(f"soak.py: {e}", file=sys.stderr)
        return 2
    if args.plan:
        print("\n".join(f"{t.seed:10d} {t.label()}" for t in trials))
        print(f"the {'pairwise plan' if args.pairwise else 'draws'} {coverage(trials)}")
        return 0
    root = args.workdir or Path(tempfile.mkdtemp(prefix="ddplab-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    end_everything_when_stopped()
    print(f"soak: {len(trials)} trial(s) in {root}", flush=True)
    for t in trials:
        t.token_file, t.shard_dir, t.hf_dir = str(token_file(root)), str(shard_dir(root)), str(hf_dir(root))
    done = run_all(trials, root, args.keep, args.first, args.jobs, until)
    summary(done)
    if not args.keep and all(h for _, h, _ in done):
        shutil.rmtree(root, ignore_errors=True)
    return 0 if all(h for _, h, _ in done) else 1


if __name__ == "__main__":
    sys.exit(main())
