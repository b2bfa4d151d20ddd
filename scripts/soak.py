"""Fault-injection soak of the preemption promises: nothing lost, bitwise resume, exact metrics, no run mixed
up with another (issue 22, item 9; issue 32). One trial at a time (2 ranks at most), its reference beside it.

    python scripts/soak.py --pairwise                     # CI's fixed plan: every pair of dimension values once
    python scripts/soak.py --pairwise --plan              # ... its trials and pair coverage, nothing runs
    python scripts/soak.py --trials 20 --seed 1           # 20 trials drawn at random from seed 1
    python scripts/soak.py --only 1234567 [--long]        # one trial again, exactly (a failure prints the command)

A trial (tests/soak_plan.py) is the launcher (``python train.py``, ``torchrun --standalone --nproc_per_node=2``,
``python train.py distributed.nproc_per_node=2``), the strategy (none for one process; ddp or fsdp for two), the
data (the digits in memory, or a user IterableDataset through ddplab's stream path), checkpoint.async_save, the
step time (log-uniform 1 ms - 4 s in three bands, few steps when long; ``--long``: ~10x more training),
grad_accum_steps (1-3), and one fault: SIGTERM/SIGINT/SIGUSR1/SIGKILL sent by rank r on its k-th call of a phase
(data fetch, forward, backward, between micro-batches, optimizer step, evaluation, checkpoint write) to itself, the
other rank, its launcher or every process of the job (tests/soak_toy.py, from inside the job, once); from its seed
log_every_n_steps (1-100), checkpoint.every_n_steps, epochs, r and k. ``--pairwise`` fixes the dimensions by the
plan, the rest from each trial's seed. The job reruns with ``resume=auto`` until it completes, and the trial checks:

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
6. SIGTERM/SIGINT/SIGUSR1: signal -> every process of the job gone within 30 s (torchrun's grace).
Exit 1 if any trial failed; each failure prints its seed, config and the command that reruns it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
# tests/: the in-job half (faults, delays), the trials and the plan, the one bitwise comparison
from helpers.compare import load_whole  # noqa: E402
from soak_plan import (DIMENSIONS, TOKEN_BLOCK, TOKEN_WINDOWS, Trial, coverage, dimensions, draw,  # noqa: E402
                       plan_trials, trial_seeds)
from soak_toy import check_events, describe, kill, same, snapshot, trial_pids  # noqa: E402

TRAIN = REPO / "train.py"
GRACE_S = 30.0  # torchrun's (and SLURM's, Kubernetes') wait before SIGKILL
COMPARED = ("model", "optimizer", "scheduler", "loop", "rng")


def command(t: Trial, run: Path, resume: bool = False) -> list[str]:
    args = t.overrides() + [f"hydra.run.dir={run}"] + (["resume=auto"] if resume else [])
    if t.launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(TRAIN), *args]
    return [sys.executable, str(TRAIN), *args] + (["distributed.nproc_per_node=2"] if t.launcher == "selflaunch" else [])


def job_env(t: Trial, tdir: Path, trial_id: str, fault: bool) -> dict[str, str]:
    """helpers.jobs.job_env()'s environment, plus the trial's: its own TMPDIR, its id, the delays and the fault."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "TORCHELASTIC", "SOAK_"))}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TMPDIR=str(tdir / "tmp"), SOAK_TRIAL_ID=trial_id,
               SOAK_DIR=str(tdir), PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "tests"), env.get("PYTHONPATH")])))
    if fault:
        env.update(SOAK_DELAY_S=repr(t.step_s / t.accum), SOAK_EVAL_DELAY_S=repr(t.eval_s),
                   SOAK_FAULT=json.dumps({"phase": "fetch" if t.phase in ("data", "between") else t.phase, "k": t.k,
                                          "rank": t.rank, "target": t.target, "signal": t.signal, "dir": str(tdir)}))
    return env


@dataclasses.dataclass
class Attempt:
    rc: int | None
    ended: float  # the launched process
    gone: float | None  # every process of the trial (None: some outlived it by 30 s)
    left: list[str]
    timed_out: bool


def run_attempt(cmd: list[str], env: dict[str, str], cwd: Path, log: Path, timeout: float) -> Attempt:
    """Run to the end; then wait up to 30 s for the rest of the trial's processes, killing (by pid) any left."""
    trial_id = env["SOAK_TRIAL_ID"]
    with open(log, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    timed_out = False
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill(trial_pids(trial_id))
        proc.wait()
    except BaseException:
        kill(trial_pids(trial_id))
        raise
    ended = time.time()
    while time.time() - ended < GRACE_S:
        left = trial_pids(trial_id)
        if not left:
            return Attempt(proc.returncode, ended, time.time(), [], timed_out)
        time.sleep(0.1)
    left = [describe(p) for p in trial_pids(trial_id)]
    kill(trial_pids(trial_id))
    return Attempt(proc.returncode, ended, None, left, timed_out)


def read_result(run: Path) -> dict:
    try:
        return json.loads((run / "result.json").read_text())
    except (OSError, ValueError):
        return {}


def load(path: Path) -> dict:
    import torch

    return torch.load(path, map_location="cpu", weights_only=False)


def reference(t: Trial, root: Path, cache: dict) -> Path:
    """The uninterrupted run of t's config and launcher (no delays, no fault), made once per soak run."""
    key = (t.launcher, tuple(t.overrides()))
    if key not in cache:
        n = len(list(root.glob("ref-*")))  # not len(cache): a failed reference keeps its dir (for its log)
        rdir = root / f"ref-{n}"
        (rdir / "cwd").mkdir(parents=True)
        (rdir / "tmp").mkdir()
        run = rdir / "cwd" / "run"
        a = run_attempt(command(t, run), job_env(t, rdir, f"soak-ref-{os.getpid()}-{n}", False),
                        rdir / "cwd", rdir / "run.log", 600)
        if a.rc != 0 or read_result(run).get("status") != "completed":
            raise RuntimeError(f"the reference run failed (exit {a.rc}): see {rdir / 'run.log'}")
        cache[key] = run
    return cache[key]


def check_preempted(run: Path, what: str) -> list[str]:
    """A run that says preempted: its checkpoint exists and holds the step it names."""
    res = read_result(run)
    if res.get("status") != "preempted":
        return []
    ck = res.get("checkpoint")
    if not ck or not Path(ck).is_file():
        return [f"{what}: result.json says preempted at step {res.get('step')} with checkpoint {ck!r}, no such file"]
    step = load(Path(ck))["loop"]["step"]
    return [] if step == res.get("step") else [f"{what}: result.json step {res.get('step')} but {ck} holds step {step}"]


def check_fault(t: Trial, a: Attempt, run: Path, tdir: Path, notes: list[str]) -> list[str]:
    """The attempt the fault fired in: invariants 3 and 6 for a graceful signal."""
    if not (tdir / "fired").exists():
        return ["the fault never fired (k beyond the calls the job made?)"]
    fired = json.loads((tdir / "fired").read_text())
    notes.append(f"fired at step {fired['step']}")
    res = read_result(run)
    if t.signal == "SIGKILL":
        notes.append(f"exit {a.rc}, {res.get('status', 'no result.json')}")
        return []
    problems = []
    if a.gone is not None:
        took = a.gone - fired["time"]
        notes.append(f"gone {took:.1f}s after the signal")
        if took >= GRACE_S:
            problems.append(f"{t.signal}: the job took {took:.1f}s to exit, beyond the {GRACE_S:.0f}s grace")
    status = res.get("status")
    if status == "completed" and a.rc == 0:
        notes.append("completed: the signal came after the last stop check")
    elif status == "completed" and t.launcher == "torchrun" and t.target in ("launcher", "all"):
        # torchrun's agent, signalled, exits 1 (its SignalException) whatever its ranks did: its code, not ours.
        notes.append(f"completed: the signal came after the last stop check (torchrun's agent exit {a.rc})")
    elif status == "preempted" and a.rc != 0:
        notes.append(f"preempted at step {res['step']} ({res.get('signal')}), exit {a.rc}")
        if res["step"] < fired["step"]:
            problems.append(f"stopped at step {res['step']}, before step {fired['step']} where the signal came: lost")
    else:
        problems.append(f"after {t.signal}: exit {a.rc} with result.json status {status!r} ({res.get('error', '')[:300]})")
    return problems


def check_final(run: Path, ref: Path, skip_rng: bool = False) -> list[str]:
    """Invariants 1 and 3 (the end): completed, and the final state bitwise the uninterrupted run's. ``skip_rng``:
    the streams were not restored (RNGStreams restores only mid-epoch: each epoch reseeds them), so the last
    checkpoint's ``rng`` entry is the fresh process's, not the reference's."""
    res = read_result(run)
    if res.get("status") != "completed":
        return [f"never completed: result.json {json.dumps(res)[:300]}"]
    # load_whole: an FSDP checkpoint's model and optimizer, read back from the shards its step file names
    mine, theirs = load_whole(run / "checkpoints" / "last.pt"), load_whole(ref / "checkpoints" / "last.pt")
    problems = [f"final {k} differs from the uninterrupted run's at {d}" for k in COMPARED
                if not (skip_rng and k == "rng") and (d := same(mine.get(k), theirs.get(k), k))]
    mine["results"].pop("last_train"), theirs["results"].pop("last_train")  # its vitals/* are timings
    problems += [f"final results differ at {d}"] if (d := same(mine["results"], theirs["results"], "results")) else []
    if res.get("metrics", {}).get("step") != mine["loop"]["step"]:
        problems.append(f"result.json step {res.get('metrics', {}).get('step')} != last.pt's {mine['loop']['step']}")
    return problems + check_events(run, ref)


def check_files(cwd: Path, before: dict, tmp: Path, notes: list[str]) -> list[str]:
    """Invariant 5: only the run dir changed in the working dir; ddplab's scratch is gone from TMPDIR."""
    after = snapshot(cwd)
    outside = sorted(p for p in set(before) | set(after) if p != "run" and not p.startswith("run/")
                     and before.get(p) != after.get(p))
    problems = [f"written outside the run dir: {outside[:10]}"] if outside else []
    ours = [p.name for p in tmp.glob("ddplab-rank*")] + [f"{p.parent.name}/{p.name}" for p in tmp.glob("ddplab-*/*")]
    if ours:
        problems.append(f"ddplab scratch left in TMPDIR: {ours}")
    others = sorted({p.name.split("_")[0] for p in tmp.iterdir() if not p.name.startswith("ddplab-")})
    if others:
        notes.append(f"TMPDIR also holds {others} (not ddplab's)")
    return problems


def run_trial(t: Trial, root: Path, cache: dict) -> tuple[list[str], list[str]]:
    """Fault, resume until completed, check; (problems, notes)."""
    tdir = root / f"trial-{t.seed}"
    cwd, tmp = tdir / "cwd", tdir / "tmp"
    cwd.mkdir(parents=True)
    tmp.mkdir()
    run, before = cwd / "run", snapshot(cwd)
    # The uninterrupted reference runs beside the faulted attempts (its own dirs, trial id and session; faults
    # fire by call count, not by time): on 2 cores a trial takes less, and the faulted job meets load.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        ref_job = pool.submit(reference, t, root, cache)
        problems, notes, final_eval_resume = fault_and_resume(t, tdir, cwd, run)
        ref = ref_job.result()
    return problems + check_final(run, ref, final_eval_resume) + check_files(cwd, before, tmp, notes), notes


def fault_and_resume(t: Trial, tdir: Path, cwd: Path, run: Path) -> tuple[list[str], list[str], bool]:
    """The faulted run, then resumes until it completes (at most 3): problems, notes, resumed at the last epoch's end."""
    log, env, notes = tdir / "run.log", job_env(t, tdir, f"soak-{os.getpid()}-{t.seed}", True), []
    timeout = 180 + 3 * t.epochs * (t.steps_per_epoch * t.step_s + 2 * t.eval_s)
    attempts = [run_attempt(command(t, run), env, cwd, log, timeout)]
    problems = check_fault(t, attempts[0], run, tdir, notes) + check_preempted(run, "the faulted run")
    final_eval_resume = False
    while read_result(run).get("status") != "completed" and len(attempts) < 4:
        loop = load(run / "checkpoints" / "last.pt")["loop"] if (run / "checkpoints" / "last.pt").exists() else {}
        final_eval_resume = loop.get("epoch") == t.epochs and not loop.get("batches_in_epoch")
        attempts.append(run_attempt(command(t, run, resume=True), env, cwd, log, timeout))
        if attempts[-1].rc != 0:
            problems.append(f"resume {len(attempts) - 1} exited {attempts[-1].rc}")
        problems += check_preempted(run, f"resume {len(attempts) - 1}")
    for i, a in enumerate(attempts):
        problems += [f"attempt {i} timed out after {timeout:.0f}s"] if a.timed_out else []
        problems += [f"attempt {i}: processes alive {GRACE_S:.0f}s after it ended: {a.left}"] if a.left else []
    last_eval = ["rng not compared: resumed at the last epoch's end"] if final_eval_resume else []
    notes += [f"{len(attempts)} run(s)"] + last_eval
    return problems, notes, final_eval_resume


def summary(done: list[tuple[Trial, bool, float]]) -> None:
    """Held and failed trials per value of each dimension, then the totals."""
    table: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for t, held, _ in done:
        for name, value in dimensions(t).items():
            table[(name, str(value))][0 if held else 1] += 1
    print(f"\n{'dimension':10s} {'value':10s} held failed")
    for name, value in [(n, str(v)) for n, values in DIMENSIONS.items() for v in values]:
        if (name, value) in table:
            print(f"{name:10s} {value:10s} {table[name, value][0]:4d} {table[name, value][1]:6d}")
    walls = [w for _, _, w in done]
    held = sum(h for _, h, _ in done)
    print(f"{held}/{len(done)} trials held; wall per trial: median {statistics.median(walls):.0f}s, "
          f"max {max(walls):.0f}s, total {sum(walls) / 60:.1f} min")


def report_failure(t: Trial, problems: list[str], root: Path) -> None:
    print(f"  FAILED trial seed {t.seed}: {json.dumps(dataclasses.asdict(t))}")
    for p in problems:
        print(f"    - {p}")
    print(f"    files: {root / f'trial-{t.seed}'}")
    print(f"    reproduce: {t.rerun()}")


def token_file(root: Path) -> Path:
    """The data=tokens trials' token file, written once per soak run beside the trials (bytes of a generated
    corpus: TOKEN_WINDOWS windows of TOKEN_BLOCK tokens)."""
    from ddplab.data import write_tokens
    from ddplab.data.tabular import generated_corpus

    path = root / "tokens.bin"
    if not path.exists():
        text = generated_corpus(sentences=4000, seed=0).encode()[:TOKEN_WINDOWS * TOKEN_BLOCK + 1]
        write_tokens(list(text), path, "uint16", 256)
    return path


class NotInPlan(ValueError):
    """``--only SEED --pairwise`` with a seed the plan does not hold."""


def choose(args: argparse.Namespace) -> list[Trial]:
    """The pairwise plan's trials (``--only``: the one with that seed) or trials drawn from seeds."""
    if args.pairwise:
        trials = plan_trials(args.seed, args.long)
        picked = [t for t in trials if args.only in (None, t.seed)]
        if not picked:
            raise NotInPlan(f"--only {args.only}: no trial of the pairwise plan of --seed {args.seed} has that seed. Fix: "
                             f"the --seed the failure printed (python scripts/soak.py --pairwise --seed {args.seed} --plan "
                             "lists its trials), or drop --pairwise for a trial drawn at random")
        return picked
    return [draw(s, args.long) for s in ([args.only] if args.only is not None else trial_seeds(args.seed, args.trials))]


def run_all(trials: list[Trial], root: Path, keep: bool) -> list[tuple[Trial, bool, float]]:
    cache, done = {}, []
    for i, t in enumerate(trials, 1):
        t0 = time.time()
        try:
            problems, notes = run_trial(t, root, cache)
        except Exception as e:  # the harness itself: still a failed trial, with its seed
            problems, notes = [f"harness error: {type(e).__name__}: {e}"], []
        wall = time.time() - t0
        done.append((t, not problems, wall))
        print(f"[{i}/{len(trials)}] {t.seed:10d} {t.label()}: {'held' if not problems else 'FAILED'} "
              f"({wall:.0f}s; {'; '.join(notes)})", flush=True)
        if problems:
            report_failure(t, problems, root)
        elif not keep:
            shutil.rmtree(root / f"trial-{t.seed}", ignore_errors=True)
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairwise", action="store_true", help="the fixed plan covering every pair of dimension values")
    ap.add_argument("--trials", type=int, default=10, help="how many trials to draw (not with --pairwise)")
    ap.add_argument("--seed", type=int, default=0, help="the trials' seeds (--pairwise: their remaining details)")
    ap.add_argument("--only", type=int, help="run just the trial with this seed (as a failure prints it)")
    ap.add_argument("--long", action="store_true", help="about ten times more training per trial")
    ap.add_argument("--plan", action="store_true", help="print the trials' draws and run nothing")
    ap.add_argument("--keep", action="store_true", help="keep every trial's dir (failed ones are always kept)")
    ap.add_argument("--workdir", type=Path, help="where trials run (default: a new temp dir)")
    args = ap.parse_args(argv)
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
    print(f"soak: {len(trials)} trial(s) in {root}", flush=True)
    for t in trials:
        t.token_file = str(token_file(root))
    done = run_all(trials, root, args.keep)
    summary(done)
    if not args.keep and all(h for _, h, _ in done):
        shutil.rmtree(root, ignore_errors=True)
    return 0 if all(h for _, h, _ in done) else 1


if __name__ == "__main__":
    sys.exit(main())
