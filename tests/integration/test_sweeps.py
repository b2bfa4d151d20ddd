"""Sweeps: Hydra multirun inside torchrun, self-launched DDP jobs under launcher plugins, Optuna,
summaries."""

import re
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import torch
from helpers.jobs import REPO, assert_ok, own_tmpdir, python_train, read_scalars, run_cmd, torchrun

from ddplab.events import events_in, read_hparams
from ddplab.rundir import read_result
from ddplab.sweep import summarize

pytestmark = pytest.mark.dist


def sweep_jobs(cwd: Path) -> list[Path]:
    sweeps = sorted((cwd / "multirun").glob("*/*"))
    return sorted(
        (p for s in sweeps for p in s.iterdir() if p.is_dir() and p.name.isdigit()),
        key=lambda p: (p.parent.name, int(p.name)),
    )


def test_multirun_inside_torchrun_two_ranks_four_jobs(tmp_path):
    tmp_env, scratch_left = own_tmpdir(tmp_path)
    proc = torchrun(
        2,
        ["-m", "optimizer.lr=0.1,0.01", "model=mlp,convnet", "num_epochs=1", "progress=none"],
        tmp_path,
        timeout=300,
        extra_env=tmp_env,
    )
    assert_ok(proc)
    jobs = sweep_jobs(tmp_path)
    assert [j.name for j in jobs] == ["0", "1", "2", "3"]  # exactly 4 job dirs, none per rank
    assert len(list((tmp_path / "multirun").glob("*/*"))) == 1
    assert scratch_left() == []  # no rank's throwaway Hydra dir stays
    seen = set()
    for job in jobs:
        events = list(events_in(job).glob("events.out.tfevents*"))
        assert len(events) == 1
        hp = read_hparams(job)
        s = read_scalars(job)
        res = read_result(job)
        assert res["status"] == "completed"
        assert hp["world_size"] == 2.0 and hp["model"] in ("mlp", "convnet")
        seen.add((hp["optimizer.lr"], hp["model"]))
        assert s["val/acc"][-1][1] == pytest.approx(res["metrics"]["val/acc"], abs=1e-6)
        assert s["val/acc_best"][-1][1] == pytest.approx(res["metrics"]["val/acc_best"], abs=1e-6)
    assert seen == {(0.1, "mlp"), (0.1, "convnet"), (0.01, "mlp"), (0.01, "convnet")}

    # The summary tool agrees with each job's own numbers and sorts by the objective.
    rows = summarize(jobs[0].parent)
    accs = [r["objective"] for r in rows]
    assert accs == sorted(accs, reverse=True) and len(rows) == 4
    for r in rows:
        assert r["objective"] == read_result(jobs[0].parent / str(r["job"]))["metrics"]["val/acc"]
    table = run_cmd(
        [sys.executable, str(REPO / "scripts" / "sweep_summary.py"), str(jobs[0].parent)], tmp_path
    )
    assert_ok(table)
    best = rows[0]
    assert table.stdout.splitlines()[2].startswith(f"| {best['job']} | completed | ")
    assert f"{best['objective']:.6g}" in table.stdout.splitlines()[2]
    csv = (jobs[0].parent / "summary.csv").read_text().splitlines()
    assert csv[0].startswith("job,status,swept,objective") and len(csv) == 5
    # what the sweep varied
    assert all(re.search(r',"lr=0\.0?1,model=(mlp|convnet)",', row) for row in csv[1:])


def _log_window(job: Path) -> tuple[datetime, datetime]:
    stamps = re.findall(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]", (job / "train.log").read_text(), re.M)
    parse = lambda t: datetime.strptime(t, "%Y-%m-%d %H:%M:%S,%f")  # noqa: E731
    return parse(stamps[0]), parse(stamps[-1])


def test_joblib_runs_two_self_launched_ddp_jobs_in_parallel(tmp_path):
    proc = python_train(
        [
            "-m",
            "hydra/launcher=joblib",
            "hydra.launcher.n_jobs=2",
            "optimizer.lr=0.1,0.01",
            "model=mlp",
            "num_epochs=3",
            "distributed.nproc_per_node=2",
            "progress=log",
        ],
        tmp_path,
        timeout=300,
    )
    assert_ok(proc)
    out = proc.stdout + proc.stderr
    assert "address already in use" not in out.lower()
    jobs = sweep_jobs(tmp_path)
    assert [j.name for j in jobs] == ["0", "1"]
    for job in jobs:
        assert read_result(job)["status"] == "completed"
        assert "2 rank(s) on cpu (gloo)" in (job / "train.log").read_text()
        assert len(list(events_in(job).glob("events*"))) == 1
    (a0, a1), (b0, b1) = _log_window(jobs[0]), _log_window(jobs[1])
    assert a0 < b1 and b0 < a1  # the two jobs' training overlapped in time


def test_submitit_local_runs_a_two_job_sweep(tmp_path):
    proc = python_train(
        [
            "-m",
            "hydra/launcher=submitit_local",
            "hydra.launcher.timeout_min=5",
            "optimizer.lr=0.1,0.01",
            "model=mlp",
            "num_epochs=1",
            "distributed.nproc_per_node=2",
            "progress=log",
        ],
        tmp_path,
        timeout=300,
    )
    assert_ok(proc)
    jobs = sweep_jobs(tmp_path)
    assert [j.name for j in jobs] == ["0", "1"]
    for job in jobs:
        res = read_result(job)
        assert res["status"] == "completed" and res["metrics"]["val/num_samples"] == 359


def test_failing_job_is_recorded_and_the_sweep_goes_on(tmp_path):
    # Job 0 crashes in rank 1 at its 3rd step; job 1 never reaches the fault.
    proc = python_train(
        [
            "-m",
            "model=mlp",
            "model._target_=toy.FaultyMLP",
            "+model.fault_call=3,100000",
            "num_epochs=1",
            "distributed.nproc_per_node=2",
            "distributed.timeout_s=30",
            "progress=none",
        ],
        tmp_path,
        timeout=300,
    )
    assert_ok(proc)  # the sweep itself completes
    jobs = sweep_jobs(tmp_path)
    failed, ok = read_result(jobs[0]), read_result(jobs[1])
    assert failed["status"] == "failed" and "rank 1" in failed["error"]
    assert ok["status"] == "completed"
    rows = summarize(jobs[0].parent)
    assert [r["status"] for r in rows] == ["completed", "failed"]  # failures listed last, with the error
    assert rows[1]["error"]


def test_failing_job_inside_torchrun_sweep_stops_it_promptly(tmp_path):
    # Inside torchrun the ranks cannot be re-paired after one failed mid-collective:
    # the sweep stops with the failure recorded and named, instead of desynchronising.
    t0 = time.perf_counter()
    proc = torchrun(
        2,
        [
            "-m",
            "model=mlp",
            "model._target_=toy.FaultyMLP",
            "+model.fault_call=3,100000",
            "num_epochs=1",
            "distributed.timeout_s=60",
            "progress=none",
        ],
        tmp_path,
        timeout=300,
    )
    assert proc.returncode != 0 and time.perf_counter() - t0 < 60  # well before the 60 s timeout
    out = proc.stdout + proc.stderr
    assert "rank 1/2 failed in epoch 1, step 3: RuntimeError: injected crash on rank 1" in out
    assert "a failed job stops a sweep inside torchrun" in out
    jobs = sweep_jobs(tmp_path)
    assert read_result(jobs[0])["status"] == "failed"


def test_optuna_under_torchrun_trains_rank_zero_sample_on_every_rank(tmp_path):
    # An unseeded sampler draws different values in each rank's sweeper.
    proc = torchrun(
        2,
        [
            "hparams_search=optuna",
            "hydra.sweeper.n_trials=4",
            "hydra.sweeper.sampler.seed=null",
            "model=mlp",
            "num_epochs=1",
            "progress=none",
        ],
        tmp_path,
        timeout=300,
    )
    assert_ok(proc)
    out = proc.stdout + proc.stderr
    tables = re.findall(r"ranks: 0@.*? cfg=(\w+), 1@.*? cfg=(\w+)", out)
    assert len(tables) == 4  # 4 trials completed
    assert all(a == b for a, b in tables)  # both ranks trained the same config in every trial
    assert "rank 1: this rank was given a different config than rank 0" in out
    jobs = sweep_jobs(tmp_path)
    assert len(jobs) == 4
    for job in jobs:
        overrides = (job / ".hydra" / "overrides.yaml").read_text()
        lr = float(re.search(r"optimizer\.lr=([0-9.e-]+)", overrides).group(1))
        assert read_hparams(job)["optimizer.lr"] == pytest.approx(lr)  # rank 0's sample was used
        assert read_result(job)["status"] == "completed"
    assert "Best value:" in out


def test_optuna_four_trials_on_digits(tmp_path):
    proc = python_train(
        ["hparams_search=optuna", "hydra.sweeper.n_trials=4", "num_epochs=2", "progress=none"],
        tmp_path,
        timeout=300,
    )
    assert_ok(proc)
    jobs = sweep_jobs(tmp_path)
    assert len(jobs) == 4 and all(read_result(j)["status"] == "completed" for j in jobs)
    best = max(read_result(j)["metrics"]["val/acc"] for j in jobs)
    assert f"Best value: {best}" in proc.stdout + proc.stderr


def test_sweep_resume_auto_continues_unfinished_and_skips_finished_jobs(tmp_path):
    base = ["-m", "optimizer.lr=0.1,0.05", "model=mlp", "num_epochs=2", "progress=none"]
    assert_ok(python_train(base + ["stop_after_epochs=1"], tmp_path))  # both jobs stop after epoch 1
    first = sweep_jobs(tmp_path)
    assert all(read_result(j)["metrics"]["epoch"] == 1 for j in first)
    second_run = python_train(base + ["resume=auto"], tmp_path)  # same command + resume=auto
    assert_ok(second_run)
    out = second_run.stdout + second_run.stderr
    assert out.count("1 epoch(s), 22 step(s) done") == 2
    third_run = python_train(base + ["resume=auto"], tmp_path)
    assert_ok(third_run)
    assert (third_run.stdout + third_run.stderr).count("already finished: 2 of 2 epochs done") == 2
    sweeps = sorted((tmp_path / "multirun").glob("*/*"))
    assert len(sweeps) == 3
    second = [j for j in sweep_jobs(tmp_path) if j.parent == sweeps[1]]
    third = [j for j in sweep_jobs(tmp_path) if j.parent == sweeps[2]]
    for j2, j3 in zip(second, third):
        m2, m3 = read_result(j2)["metrics"], read_result(j3)["metrics"]
        assert m2["epoch"] == 2 and m2["step"] == 44
        assert m3["val/acc"] == m2["val/acc"]  # the finished job was not trained again


def test_slurm_and_submitit_task_variables_become_ranks(monkeypatch):
    from ddplab.runtime import env

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        # set, then delete: monkeypatch then restores the original state (absent) after the test, also
        # for the values adopt_scheduler_env writes below (a bare delenv of an absent key records nothing)
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[03-05,09]")
    monkeypatch.setenv("SLURM_JOB_ID", "123456")
    assert env.is_launched() and env.rank() == 5
    import os

    assert (os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"], os.environ["MASTER_ADDR"]) == (
        "8",
        "1",
        "gpu03",
    )
    assert os.environ["MASTER_PORT"] == str(10000 + 123456 % 20000)
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node-a[7-8],gpu1")
    assert env._first_host() == "node-a7"


def test_an_srun_task_bound_to_its_own_gpu_trains_on_it_and_a_launcher_that_overbooks_one_is_refused(
    monkeypatch,
):
    """srun --gpus-per-task=1 gives each task one visible GPU, cuda:0, whatever its SLURM_LOCALID; torchrun
    with more processes than GPUs is still refused, naming the count."""
    from ddplab.runtime import group

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for k in ("SLURM_STEP_ID", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=3 but only 1 CUDA device\(s\) are visible"):
        group._pick_device("auto", 3)
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("SLURM_PROCID", "3")
    assert group._pick_device("auto", 3) == torch.device("cuda", 0)
    # two visible of four tasks: not a per-task binding
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(RuntimeError, match="LOCAL_RANK=3 but only 2 CUDA device"):
        group._pick_device("cuda", 3)


def test_a_slurm_batch_job_is_named_for_its_run_dir_and_requeue(monkeypatch):
    from ddplab import cli
    from ddplab.runtime import env

    for k in (
        "RANK",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_ARRAY_JOB_ID",
        "SLURM_ARRAY_TASK_ID",
        "SUBMITIT_EXECUTOR",
        "TORCHELASTIC_RESTART_COUNT",
    ):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    monkeypatch.setenv("ENVIRONMENT", "BATCH")
    assert env.slurm_job() == "77" and env.restarts() == {"SLURM requeue": 2}
    assert cli.prepare_argv(["train.py", "num_epochs=1"])[-1] == "hydra.run.dir=outputs/slurm-77"
    # named: kept
    assert cli.prepare_argv(["train.py", "hydra.run.dir=mine"]) == ["train.py", "hydra.run.dir=mine"]
    # a sweep: its own
    assert "hydra.run.dir=outputs/slurm-77" not in cli.prepare_argv(["train.py", "-m", "a=1,2"])
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "70")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "7")
    assert env.slurm_job() == "70_7"  # how scontrol requeue names an array task
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    assert env.slurm_job() is None  # submitit requeues its own jobs
    monkeypatch.delenv("SUBMITIT_EXECUTOR")
    monkeypatch.setenv("ENVIRONMENT", "")
    assert env.slurm_job() is None  # salloc / interactive srun: no batch script to run again
    # The batch script's own shell (no job step) is one process, not rank 0 of SLURM_NTASKS.
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    assert not env.is_launched()
