"""The soak's checks of one trial (scripts/soak.py): run an attempt to its end and find every process of the
trial gone, then the invariants its docstring numbers — the fault's effect (3, 6), the final state (1, 2, 3),
the files (4, 5) — and the one-line errors a fault that is not a signal must end in."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import time
from pathlib import Path

from helpers.compare import load_whole, same
from soak_driver import check_events, describe, events_dir, kill, snapshot
from soak_plan import SIGNALS, Trial
from soak_toy import trial_pids

GRACE_S = 30.0  # torchrun's (and SLURM's, Kubernetes') wait before SIGKILL
COMPARED = ("model", "optimizer", "scheduler", "loop", "rng")


@dataclasses.dataclass
class Attempt:
    rc: int | None
    ended: float  # the launched process
    gone: float | None  # every process of the trial (None: some outlived it by 30 s)
    left: list[str]
    timed_out: bool
    out: str = ""  # what this attempt printed (stdout and stderr)


def run_attempt(cmd: list[str], env: dict[str, str], cwd: Path, log: Path, timeout: float) -> Attempt:
    """Run to the end; then wait up to 30 s for the rest of the trial's processes, killing (by pid) any
    left."""
    trial_id = env["SOAK_TRIAL_ID"]
    start = log.stat().st_size if log.exists() else 0
    with open(log, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
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
    if "SLURM_JOB_NAME" in env and (proc.returncode or 0) < 0:  # srun killed: its job allocation outlives it
        # (InactiveLimit=0, SLURM's default), holding the node's CPUs from every later srun: cancelled, as its
        # user would
        subprocess.run(["scancel", "--name", env["SLURM_JOB_NAME"]], capture_output=True, timeout=30)
    while time.time() - ended < GRACE_S:
        left = trial_pids(trial_id)
        if not left:
            return Attempt(proc.returncode, ended, time.time(), [], timed_out, _since(log, start))
        time.sleep(0.1)
    left = [describe(p) for p in trial_pids(trial_id)]
    kill(trial_pids(trial_id))
    return Attempt(proc.returncode, ended, None, left, timed_out, _since(log, start))


def _since(log: Path, start: int) -> str:
    with open(log, errors="replace") as f:
        f.seek(start)
        return f.read()


def read_result(run: Path) -> dict:
    try:
        return json.loads((run / "result.json").read_text())
    except (OSError, ValueError):
        return {}


def load(path: Path) -> dict:
    import torch

    return torch.load(path, map_location="cpu", weights_only=False)


def check_preempted(run: Path, what: str) -> list[str]:
    """A run that says preempted: its checkpoint exists and holds the step it names."""
    res = read_result(run)
    if res.get("status") != "preempted":
        return []
    ck = res.get("checkpoint")
    if not ck or not Path(ck).is_file():
        return [
            f"{what}: result.json says preempted at step {res.get('step')} with checkpoint {ck!r}, no such "
            "file"
        ]
    step = load(Path(ck))["loop"]["step"]
    return (
        []
        if step == res.get("step")
        else [f"{what}: result.json step {res.get('step')} but {ck} holds step {step}"]
    )


def check_fault(t: Trial, a: Attempt, run: Path, tdir: Path, notes: list[str]) -> list[str]:
    """The attempt the fault fired in: invariants 3 and 6 for a graceful signal."""
    if not (tdir / "fired").exists():
        return ["the fault never fired (k beyond the calls the job made?)"]
    fired = json.loads((tdir / "fired").read_text())
    notes.append(f"fired at step {fired['step']}")
    if t.fault not in SIGNALS and t.fault != "bad_file":
        return check_one_line(t, a, notes)
    res = read_result(run)
    if (
        t.signal == "SIGKILL"
        or t.launcher == "slurm"
        and t.target in ("launcher", "all")
        and t.signal == "SIGTERM"
    ):
        # srun, sent SIGTERM, cancels its step: SLURM kills the ranks at once, as SIGKILL does (SLURM's
        # choice)
        notes.append(f"exit {a.rc}, {res.get('status', 'no result.json')}")
        return []
    problems = []
    if a.gone is not None:
        took = a.gone - fired["time"]
        notes.append(f"gone {took:.1f}s after the signal")
        if took >= GRACE_S:
            problems.append(f"{t.signal}: the job took {took:.1f}s to exit, beyond the {GRACE_S:.0f}s grace")
    status = res.get("status")
    if status == "completed" and (a.rc == 0 or t.mode == "study"):  # a worker signalled ends after telling it
        notes.append(f"completed: the signal came after the last stop check (exit {a.rc})")
    elif status == "completed" and t.launcher == "torchrun" and t.target in ("launcher", "all"):
        # torchrun's agent, signalled, exits 1 (its SignalException) whatever its ranks did: its code, not
        # ours.
        notes.append(f"completed: the signal came after the last stop check (torchrun's agent exit {a.rc})")
    elif status == "preempted" and a.rc != 0:
        notes.append(f"preempted at step {res['step']} ({res.get('signal')}), exit {a.rc}")
        if res["step"] < fired["step"]:
            problems.append(
                f"stopped at step {res['step']}, before step {fired['step']} where the signal came: lost"
            )
    else:
        problems.append(
            f"after {t.signal}: exit {a.rc} with result.json status {status!r} ({res.get('error', '')[:300]})"
        )
    return problems


def check_final(run: Path, ref: Path, skip_rng: bool = False) -> list[str]:
    """Invariants 1 and 3 (the end): completed, and the final state bitwise the uninterrupted run's.
    ``skip_rng``: the streams were not restored (RNGStreams restores only mid-epoch: each epoch reseeds them),
    so the last checkpoint's ``rng`` entry is the fresh process's, not the reference's."""
    res = read_result(run)
    if res.get("status") != "completed":
        return [f"never completed: result.json {json.dumps(res)[:300]}"]
    # load_whole: an FSDP checkpoint's model and optimizer, read back from the shards its step file names
    mine, theirs = load_whole(run / "checkpoints" / "last.pt"), load_whole(ref / "checkpoints" / "last.pt")
    problems = [
        f"final {k} differs from the uninterrupted run's at {d}"
        for k in COMPARED
        if not (skip_rng and k == "rng") and (d := same(mine.get(k), theirs.get(k), k))
    ]
    mine["results"].pop("last_train"), theirs["results"].pop("last_train")  # its vitals/* are timings
    problems += (
        [f"final results differ at {d}"] if (d := same(mine["results"], theirs["results"], "results")) else []
    )
    if res.get("metrics", {}).get("step") != mine["loop"]["step"]:
        problems.append(
            f"result.json step {res.get('metrics', {}).get('step')} != last.pt's {mine['loop']['step']}"
        )
    return problems + check_events(run, ref)


def check_tracking(t: Trial, runs: list[Path], notes: list[str]) -> list[str]:
    """Invariant 8 (tracking=mlflow with the server up): each run's MLflow run FINISHED, holding TensorBoard's
    scalars (as TensorBoard rounds them) at the same steps, each step once: a resume continues the same MLflow
    run and sends no step twice; vitals/* aside (a recomputed step's timings differ, and only its first send
    counts). A fault that kills the job (SIGKILL, bad_file, a full disk, a lost storage) loses what its writer
    still had queued, which no resume sends again (TensorBoard's record is whole): there, steps may be
    missing, but never twice, never other values, and the run's last step is there. tracking=wandb: the same
    of the W&B run's files (:func:`check_wandb`)."""
    if t.tracking == "wandb":
        return check_wandb(t, runs, notes)
    if t.tracking != "mlflow" or t.server != "up":
        return []
    from mlflow.tracking import MlflowClient

    from ddplab.events import read_scalars

    client, problems, seen, missing = MlflowClient(t.tracking_uri), [], 0, 0
    for run in runs:
        run_id = _tracked_id(run, "mlflow.json", "run_id", problems)
        if run_id is None:
            continue
        for key, points in read_scalars(events_dir(run)).items():
            if key.startswith("vitals/"):
                continue
            seen += len(points)
            history = client.get_metric_history(run_id, key)
            got = dict(sorted((m.step, m.value) for m in history))
            if len(history) != len(got):
                problems.append(f"{run.name}: MLflow's {key} at steps {sorted(m.step for m in history)[:20]}")
            problems += _against_tensorboard(run.name, "MLflow", key, got, dict(points), _lossy(t))
            missing += len(set(dict(points)) - set(got))
        status = client.get_run(run_id).info.status
        problems += [f"{run.name}: MLflow run {status}, not FINISHED"] if status != "FINISHED" else []
    notes.append(
        f"MLflow compared: {seen} TensorBoard points in {len(runs)} run(s)"
        + (f", {missing} lost to the kill" if missing else "")
    )
    return problems


def check_wandb(t: Trial, runs: list[Path], notes: list[str]) -> list[str]:
    """Invariant 8 for W&B (offline): each attempt that reached W&B wrote a file of the one W&B run named in
    ``wandb.json``; together they hold TensorBoard's scalars, each (step, key) in one file only; the last
    file ends the run (an exit record, code 0). Lossy faults as for MLflow."""
    from ddplab import wandb_files as wf
    from ddplab.events import read_scalars

    problems, seen, missing = [], 0, 0
    for run in runs:
        run_id = _tracked_id(run, "wandb.json", "run_id", problems)
        if run_id is None:
            continue
        files, rows = wf.run_files(run, run_id), {}
        if not files:
            problems.append(f"{run.name}: no W&B file of run {run_id}")
            continue
        for file in files:
            for step, row in wf.history(file).items():
                twice = sorted(set(row) & set(rows.get(step, {})))
                problems += [f"{run.name}: W&B step {step} sent twice: {twice[:5]}"] if twice else []
                rows.setdefault(step, {}).update(row)
        for key, points in read_scalars(events_dir(run)).items():
            if not key.startswith("vitals/"):
                seen += len(points)
                got = {step: row[key] for step, row in rows.items() if key in row}
                problems += _against_tensorboard(run.name, "W&B", key, got, dict(points), _lossy(t))
                missing += len(set(dict(points)) - set(got))
        ends = [r.exit.exit_code for r in wf.read_records(files[-1]) if r.WhichOneof("record_type") == "exit"]
        problems += [] if ends == [0] else [f"{run.name}: the last W&B file's exit records: {ends}, not [0]"]
    notes.append(
        f"W&B compared: {seen} TensorBoard points in {len(runs)} run(s)"
        + (f", {missing} lost to the kill" if missing else "")
    )
    return problems


def _lossy(t: Trial) -> bool:
    """A fault that kills the job: what its tracker's writer still had queued is lost."""
    return t.signal == "SIGKILL" or t.fault in ("disk_full", "storage_loss")


def _tracked_id(run: Path, name: str, field: str, problems: list[str]) -> str | None:
    """The tracker's run id a resume continues (None, said, where it is missing or unreadable)."""
    record = run / name
    if not record.exists():
        problems.append(f"{run.name}: no {name}: the run never reached its tracker's run")
        return None
    try:
        return json.loads(record.read_text())[field]
    except (ValueError, KeyError) as e:
        problems.append(f"{run.name}: {name} unreadable ({type(e).__name__}): a resume loses that run")
        return None


def _against_tensorboard(
    name: str, tracker: str, key: str, got: dict[int, float], tb: dict[int, float], lossy: bool
) -> list[str]:
    """The tracker's points of ``key`` against TensorBoard's: its steps (all of them unless lossy, the last
    always) and its values as TensorBoard rounds them (float32)."""
    import numpy as np

    if not set(got) <= set(tb) or (not lossy and set(got) != set(tb)) or max(got, default=None) != max(tb):
        return [f"{name}: {tracker}'s {key} at steps {sorted(got)[:20]}, TensorBoard's at {sorted(tb)[:20]}"]
    if any(np.float32(got[st]) != np.float32(tb[st]) for st in got):
        return [f"{name}: {tracker}'s {key} values differ from TensorBoard's"]
    return []


def check_files(
    cwd: Path, before: dict, tmp: Path, notes: list[str], failed_under_torchrun: bool = False
) -> list[str]:
    """Invariant 5: only the run dir changed in the working dir; ddplab's scratch is gone from TMPDIR.
    ``failed_under_torchrun``: the job's last run failed for good under torchrun, whose restarts need rank 0's
    memo of the run dir: it stays (the next ddplab start removes it once the agent is gone), noted."""
    after = snapshot(cwd)
    outside = sorted(
        p
        for p in set(before) | set(after)
        if p.split("/")[0] not in ("run", "run-again") and before.get(p) != after.get(p)
    )
    problems = [f"written outside the run dir: {outside[:10]}"] if outside else []
    ours = [p.name for p in tmp.glob("ddplab-rank*")] + [
        f"{p.parent.name}/{p.name}" for p in tmp.glob("ddplab-*/*")
    ]
    memos = [o for o in ours if failed_under_torchrun and o.startswith("ddplab-") and "/run-" in o]
    notes += [f"torchrun's restart memo of the failed job kept: {memos}"] if memos else []
    ours = [o for o in ours if o not in memos]
    # a streamed source's count record (ddplab.data.counts) is kept on purpose: the next run checks a given
    # dataset.num_samples against it
    counts = [o for o in ours if o.split("/")[-1].startswith("stream-count-") and o.endswith(".json")]
    notes += [f"{len(counts)} stream count record(s) kept"] if counts else []
    ours = [o for o in ours if o not in counts]
    if ours:
        problems.append(f"ddplab scratch left in TMPDIR: {ours}")
    others = sorted({p.name.split("_")[0] for p in tmp.iterdir() if not p.name.startswith("ddplab-")})
    if others:
        notes.append(f"TMPDIR also holds {others} (not ddplab's)")
    return problems


# What each fault that is not a signal must be said with (the job's one line): the cause, as the OS or SQLite
# said it.
CAUSES = {
    "disk_full": ("No space left on device", "free on its file system"),
    "storage_loss": ("attempt to write a readonly database", "no such table", "unable to open database file"),
}


def check_one_line(t: Trial, a: Attempt, notes: list[str]) -> list[str]:
    """disk_full, storage_loss: the job fails (non-zero exit), naming the cause, without a traceback."""
    errors = [line for line in a.out.splitlines() if "ERROR" in line or "error:" in line]
    notes.append(f"exit {a.rc}: {errors[-1][-160:] if errors else 'no error line'}")
    problems = [f"{t.fault}: the job exited 0"] if a.rc == 0 else []
    # torchrun's agent exits 1 for any
    if t.fault == "storage_loss" and t.launcher != "torchrun" and a.rc != 3:
        problems.append(f"storage_loss: the worker exited {a.rc}, not 3 (a lost storage)")
    ours = tracebacks(a.out)
    if ours:
        problems.append(f"{t.fault}: {len(ours)} traceback(s): {ours[0][:600]!r}")
    if not any(cause in a.out for cause in CAUSES[t.fault]):
        problems.append(
            f"{t.fault}: no line names the cause ({' / '.join(CAUSES[t.fault])}): {a.out[-800:]!r}"
        )
    return problems


def tracebacks(out: str) -> list[str]:
    """The tracebacks in ``out``, less torchrun's own report of a failed rank (its agent's, printed for any
    failure, not a ddplab process's)."""
    blocks = ["Traceback" + b for b in out.split("Traceback")[1:]]
    return [b for b in blocks if "torch/distributed/run.py" not in b[:800]]


def spoil_newest(ckpt_dir: Path, notes: list[str], keep_one: bool = False) -> None:
    """bad_file: the newest step file truncated in place (last.pt links to it: both names see it), as a file
    half copied or rotted on disk is. ``keep_one``: only if an older one is left to fall back to."""
    steps = sorted(ckpt_dir.glob("step-*.pt"))
    if len(steps) < 1 + keep_one:
        notes.append(f"{len(steps)} checkpoint(s): none spoilt")
        return
    steps[-1].write_bytes(steps[-1].read_bytes()[:100])
    notes.append(f"spoilt {steps[-1].name}")
