"""ddplab on a real SLURM cluster (``scripts/slurm_local.sh up``): three ways to launch 2 ranks, and requeue
on a time limit and on an operator's ``scontrol requeue``, resuming bitwise; a study's workers as an array.

Skipped when ``sinfo`` does not answer; ``.ci/run`` brings a one-node cluster up for them.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.compare import last_weights, result
from helpers.jobs import TRAIN, job_env, read_scalars, run_cmd
from helpers.slurm import job_info, release, sbatch, wait_job
from soak_driver import check_intervals

# One xdist worker takes them in turn (--dist loadgroup): the one-node cluster runs one 2-task job at a time,
# and a test's bound would count another test's job queued ahead of its own.
pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("slurm")]

SMALL = ["model=mlp", "num_epochs=2", "log_every_n_steps=5", "progress=log"]
# Each training forward sleeps: a run long enough to meet its time limit (88 steps x 0.6 s, 2 ranks).
SLOW = ["model=mlp", "model._target_=toy.SlowMLP", "num_epochs=4", "log_every_n_steps=5", "progress=log"]


def _cluster_up() -> str | None:
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"no SLURM here ({e})"
    if out.returncode != 0 or not re.search(r"^(idle|mixed|allocated)", out.stdout, re.M):
        return f"no SLURM node up (sinfo: {(out.stdout + out.stderr).strip()[:200]})"
    return None


@pytest.fixture(autouse=True, scope="module")
def _a_cluster() -> None:
    """Asked when a test of this module runs, not at its import: where sinfo is installed and no controller
    runs, sinfo waits ~9 s for one, which every pytest process paid while collecting (the inner loop too)."""
    why = _cluster_up()
    if why and os.environ.get("DDPLAB_REQUIRE_SLURM") == "1":  # .ci/run started a cluster: no silent skip
        raise RuntimeError(f"DDPLAB_REQUIRE_SLURM=1 but {why}")
    if why:
        pytest.skip(f"{why}: start one with scripts/slurm_local.sh up")


def srun_train(args: list[str]) -> str:
    return f"srun {sys.executable} {TRAIN} " + " ".join(args)


def test_sbatch_with_srun_tasks_as_ranks(tmp_path):
    t0 = time.monotonic()
    job = sbatch(tmp_path, srun_train(SMALL), ["--ntasks=2", "--cpus-per-task=1"])
    info = wait_job(job, tmp_path)
    secs = time.monotonic() - t0
    out = (tmp_path / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED", out[-3000:]
    run = tmp_path / "outputs" / f"slurm-{job}"  # named after the job: a requeue finds it
    res = result(run)
    assert res["status"] == "completed" and res["metrics"]["val/acc"] > 0.85, res
    log = (run / "train.log").read_text()
    assert "2 rank(s) on cpu (gloo)" in log and "batch: 64 samples per optimizer step = 2 rank(s) x 32" in log
    prov = json.loads((run / "provenance.json").read_text())
    assert prov["launcher"]["kind"] == "slurm" and prov["launcher"]["SLURM_JOB_ID"] == job
    print(f"sbatch+srun: val/acc={res['metrics']['val/acc']:.4f} in {secs:.1f} s (submit to end)")


def test_srun_one_task_running_torchrun(tmp_path):
    t0 = time.monotonic()
    cmd = (
        f"srun {sys.executable} -m torch.distributed.run --standalone --nproc_per_node=2 {TRAIN} "
        + " ".join(SMALL)
    )
    job = sbatch(tmp_path, cmd, ["--ntasks=1", "--cpus-per-task=2"])
    info = wait_job(job, tmp_path)
    secs = time.monotonic() - t0
    out = (tmp_path / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED", out[-3000:]
    run = tmp_path / "outputs" / f"slurm-{job}"
    res = result(run)
    assert res["status"] == "completed" and res["metrics"]["val/acc"] > 0.85, res
    assert "2 rank(s) on cpu (gloo)" in (run / "train.log").read_text()
    prov = json.loads((run / "provenance.json").read_text())
    assert prov["launcher"]["kind"] == "torchrun in a SLURM job"
    print(f"srun+torchrun: val/acc={res['metrics']['val/acc']:.4f} in {secs:.1f} s (submit to end)")


def test_submitit_slurm_sweep_of_two_jobs_with_two_tasks_each(tmp_path):
    t0 = time.monotonic()
    sweep = tmp_path / "sweep"
    proc = run_cmd(
        [
            sys.executable,
            str(TRAIN),
            "-m",
            "hydra/launcher=submitit_slurm",
            "hydra.launcher.tasks_per_node=2",
            "hydra.launcher.cpus_per_task=1",
            "hydra.launcher.mem_gb=2",
            "hydra.launcher.timeout_min=10",
            f"hydra.sweep.dir={sweep}",
            "optimizer.lr=0.1,0.05",
            *SMALL,
        ],
        tmp_path,
        timeout=300,
    )
    secs = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    accs = {}
    for job, lr in ((0, 0.1), (1, 0.05)):
        run = sweep / str(job)
        res = result(run)
        assert res["status"] == "completed", res
        assert f"optimizer.lr={lr}" in (run / ".hydra" / "overrides.yaml").read_text()
        assert "2 rank(s) on cpu (gloo)" in (run / "train.log").read_text()
        accs[lr] = res["metrics"]["val/acc"]
        assert json.loads((run / "provenance.json").read_text())["launcher"]["kind"] == "submitit_slurm"
    assert min(accs.values()) > 0.8
    assert "sweep: 2 jobs, 2 completed" in proc.stdout + proc.stderr  # the end-of-sweep summary
    print(f"submitit_slurm 2 jobs x 2 tasks: val/acc {accs} in {secs:.1f} s")


def _signal_to_checkpoint(log: str) -> list[float]:
    """Seconds from each stop signal to its checkpoint, from train.log's time stamps."""
    stamp = r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]"
    # A signal during start-up is said once the job's handler exists, with how long ago it came.
    got = re.findall(stamp + r".* received(?: during start-up, ([\d.]+) s ago)?: stopping at the", log)
    done = re.findall(stamp + r".* preempted: stopped by", log)

    def at(s: str) -> float:
        return time.mktime(time.strptime(s[:19], "%Y-%m-%d %H:%M:%S")) + int(s[20:]) / 1000

    return [round(at(end) - at(start) + float(ago or 0), 2) for (start, ago), end in zip(got, done)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The same training uninterrupted, once for the module (the sleep only stretches wall time: the
    numbers are the same with none)."""
    tmp_path = tmp_path_factory.mktemp("reference")
    ref = tmp_path / "ref"
    proc = run_cmd(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(TRAIN),
            *SLOW,
            "+model.delay_s=0",
            f"hydra.run.dir={ref}",
        ],
        tmp_path,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return ref


def _assert_same_as_uninterrupted(run: Path, ref: Path) -> None:
    w, r = last_weights(run), last_weights(ref)
    assert w.keys() == r.keys() and all(torch.equal(w[k], r[k]) for k in w)  # bitwise
    s, t = read_scalars(run)["train/loss"], read_scalars(ref)["train/loss"]
    # A stop between log steps logs the interval so far before its checkpoint: the run's log steps are the
    # reference's plus its stop steps, each once, and each reference interval's mean is kept.
    stops = {
        int(n)
        for n in re.findall(r"preempted: stopped by \S+ at step (\d+)", (run / "train.log").read_text())
    }
    assert [st for st, _ in s] == sorted({st for st, _ in t} | stops)  # each step logged once, none missing
    assert check_intervals("train/loss", dict(s), dict(t)) == []
    assert result(run)["status"] == "completed"


def test_time_limit_requeues_and_resumes_bitwise(tmp_path, reference):
    # --time=3 with USR1 90 s before it: SLURM checks time limits periodically, so the warning comes some
    # 90-120 s after the start, before the ~135 s of training (1.5 s a step) end; every start of the job gets
    # its own warning, so it is requeued once or more. The checkpoint must come before the limit (its SIGTERM
    # would be a second signal: an exit without one). The lead is 90 s, not 30: the warning may land during a
    # start-up, and a start-up on a loaded machine took 20-50 s (CI: USR1@30 gave lags of 6-50 s). And the
    # limit is 3 minutes, not 2: with 30 s from start to warning, start-ups of 30 s made no step between
    # requeues (CI at 925ef34: 12 requeues in 400 s, each warned during its start-up).
    lead = 90
    t0 = time.monotonic()
    # An array job (of one task): ddplab names it <array job>_<task>, for its run dir and for the requeue.
    array = sbatch(
        tmp_path,
        srun_train([*SLOW, "+model.delay_s=1.5"]),
        ["--ntasks=2", "--cpus-per-task=1", "--time=3", f"--signal=USR1@{lead}", "--requeue", "--array=1"],
    )
    job = f"{array}_1"
    info = wait_job(job, tmp_path, timeout=800)
    secs = time.monotonic() - t0
    out = "".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert info["JobState"] == "COMPLETED", out[-4000:]
    requeues = int(info["Restarts"])
    assert requeues >= 1, out[-4000:]
    run = tmp_path / "outputs" / f"slurm-{job}"
    log = (run / "train.log").read_text()
    stops = re.findall(r"preempted: stopped by SIGUSR1 at step (\d+)", log)
    assert len(stops) == log.count(f"requeueing SLURM job {job}:") == requeues, log[-4000:]
    assert [f"SLURM requeue {n}: continuing" in log for n in range(1, requeues + 1)] == [True] * requeues
    lag = _signal_to_checkpoint(log)
    assert len(lag) == requeues and max(lag) < lead, lag  # each checkpoint before the time limit
    # 0 steps lost: every restart resumed at the step its stop checkpointed.
    resumed = re.findall(r"resumed from \S+: \d+ epoch\(s\), (\d+) step\(s\) done", log)
    assert resumed == stops, (resumed, stops)
    _assert_same_as_uninterrupted(run, reference)
    print(
        f"time limit: {requeues} requeue(s) at steps {stops}, signal -> checkpoint {lag} s, bitwise equal, "
        f"{secs:.0f} s submit to end"
    )


def test_operator_requeue_resumes_bitwise(tmp_path, reference):
    job = sbatch(
        tmp_path, srun_train([*SLOW, "+model.delay_s=0.1"]), ["--ntasks=2", "--cpus-per-task=1", "--requeue"]
    )
    run = tmp_path / "outputs" / f"slurm-{job}"
    t0 = time.monotonic()
    while "epoch 1 step 10/" not in (run / "train.log").read_text() if (run / "train.log").exists() else True:
        assert time.monotonic() - t0 < 120, job_info(job)
        time.sleep(0.2)
    subprocess.run(["scontrol", "requeue", job], check=True)
    info = wait_job(job, tmp_path, timeout=300)
    out = (tmp_path / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) == 1, out[-4000:]
    log = (run / "train.log").read_text()
    assert "preempted: stopped by SIGTERM at step" in log and "SLURM requeue 1: continuing" in log
    assert "requeueing SLURM job" not in log  # SLURM requeued it itself: ddplab only checkpointed
    lag = _signal_to_checkpoint(log)
    assert len(lag) == 1 and lag[0] < 30, lag  # the stop's checkpoint inside SLURM's default KillWait
    # and 0 steps lost: the resumed run ends where the reference does
    _assert_same_as_uninterrupted(run, reference)
    print(f"operator requeue: signal -> checkpoint {lag} s, bitwise equal")


def test_submitit_preemption_checkpoints_then_submitit_requeues(tmp_path, reference):
    """submitit's protocol: its signal (USR2) reaches ddplab first, which checkpoints at the next agreed
    step, then hands the signal to submitit's handler, which resubmits the job and requeues it."""
    sweep = tmp_path / "sweep"
    cmd = [
        sys.executable,
        str(TRAIN),
        "-m",
        "hydra/launcher=submitit_slurm",
        "hydra.launcher.tasks_per_node=2",
        "hydra.launcher.cpus_per_task=1",
        "hydra.launcher.mem_gb=2",
        f"hydra.sweep.dir={sweep}",
        # submitit counts a signal in the last 20 % (or 10 min) of the time limit as a time-out, and
        # requeues those only max_num_timeout times (0 by default); 60 min: this one is a preemption.
        "hydra.launcher.timeout_min=60",
        *SLOW,
        "+model.delay_s=0.15",
    ]
    with open(tmp_path / "sweep.log", "w") as out:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=job_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        log = sweep / "0" / "train.log"
        t0 = time.monotonic()
        while not (log.exists() and "epoch 1 step 10/" in log.read_text()):
            assert time.monotonic() - t0 < 120 and proc.poll() is None, (tmp_path / "sweep.log").read_text()[
                -3000:
            ]
            time.sleep(0.2)
        job = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split()[0]
        subprocess.run(["scancel", "--signal=USR2", job], check=True)
        while proc.poll() is None:
            assert time.monotonic() - t0 < 300, (tmp_path / "sweep.log").read_text()[-3000:]
            release(job, job_info(job))
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, (tmp_path / "sweep.log").read_text()[-3000:]
    text = log.read_text()
    assert "preempted: stopped by SIGUSR2 at step" in text and "handing SIGUSR2 to submitit" in text
    assert "SLURM requeue 1: continuing from the last checkpoint" in text
    assert int(job_info(job)["Restarts"]) == 1
    lag = _signal_to_checkpoint(text)
    assert len(lag) == 1 and lag[0] < 30, lag  # the stop's checkpoint inside SLURM's default KillWait
    _assert_same_as_uninterrupted(sweep / "0", reference)
    print(f"submitit preemption: signal -> checkpoint {lag} s, bitwise equal")


def test_a_study_run_by_a_slurm_array_of_two_workers(tmp_path):
    """mode=study as docs/studies.md says to run it on SLURM: one worker per array task, the journal
    storage."""
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    study, journal = tmp_path / "study", tmp_path / "journal.log"
    args = [
        "hparams_search=study",
        f"study.dir={study}",
        f"study.storage=journal:{journal}",
        "study.n_trials=4",
        "study.pruner=null",
        "model=mlp",
        "num_epochs=2",
        "limit_train_steps=4",
        "progress=log",
    ]
    job = sbatch(tmp_path, srun_train(args), ["--array=0-1", "--ntasks=1", "--cpus-per-task=1"])
    infos = [wait_job(f"{job}_{i}", tmp_path) for i in (0, 1)]
    logs = "\n".join(p.read_text()[-2000:] for p in tmp_path.glob("slurm-*.out"))
    assert [i["JobState"] for i in infos] == ["COMPLETED", "COMPLETED"], logs
    told = optuna.load_study(
        study_name="digits_lr_wd", storage=JournalStorage(JournalFileBackend(str(journal)))
    )
    assert [t.state.name for t in told.get_trials()] == ["COMPLETE"] * 4
    for t in told.get_trials():
        assert result(study / str(t.number))["trial"]["value"] == t.value
    ran = [
        int(n)
        for n in re.findall(
            r"trial (\d+) \(", "\n".join(p.read_text() for p in tmp_path.glob("outputs/slurm-*/train.log"))
        )
    ]
    assert sorted(ran) == [0, 1, 2, 3], ran  # each trial once, over the two array tasks


def test_a_soak_trial_under_srun_resumes_bitwise(tmp_path):
    """scripts/soak.py --slurm: srun launches the 2 ranks; SIGUSR1 to srun itself, which forwards it to them:
    the job is preempted with its checkpoint, resumed under srun and bitwise its uninterrupted (torchrun)
    twin."""
    proc = run_cmd(
        [
            sys.executable,
            "scripts/soak.py",
            "--slurm",
            "--only",
            "106647342",
            "--workdir",
            str(tmp_path / "s"),
        ],
        Path(TRAIN).parent,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    # the trial that seed draws (its feature in play, drawn since, is EMA): the label's words, any spacing
    assert re.search(r"slurm\s+x2 ddp\s+stream\s+train\s+ema\s+SIGUSR1->launcher@backward", proc.stdout), (
        proc.stdout
    )
    assert re.search(r"preempted at step \d+ \(SIGUSR1\), exit 138", proc.stdout), proc.stdout[-2000:]
    assert "1/1 trials held" in proc.stdout
