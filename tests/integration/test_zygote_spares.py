"""The job server's spares (tests/helpers/zygote.py): a self-launch's ranks, verify_resume's legs and their
ranks, and torchrun's workers (restarts included) fork from a spare of the process that starts them (a job's
second self-launch: from a fresh server); the server ends when its pytest process dies; what an in-process run
sets in the environment does not reach later jobs."""

from __future__ import annotations

import os
import sys

import pytest
from helpers import jobs
from helpers.zygote_cases import CASES


def processes(out) -> list[list[tuple[str, str]]]:
    """Per rank, per job: (its command line, its parent's), as toy_callbacks.NotesItsProcess noted them."""
    return [[tuple(line.split("\t")) for line in (out / f"rank{r}").read_text().splitlines()] for r in (0, 1)]


@pytest.mark.slow
def test_a_self_launch_forks_its_ranks_from_a_spare_of_the_job_and_a_second_launch_from_a_fresh_server(
    tmp_path,
):
    """A forked job's first self-launch takes the spare (no interpreter start); its second (a multirun's next
    job, in the same process) gets Python's own fresh server. The ranks of each come from one server; the
    two ways train alike (the self-launched cases above: the same lines, exit codes and results)."""
    out = tmp_path / "out"
    out.mkdir()
    jobs.assert_ok(
        jobs.python_train(
            [
                "-m",
                "model=mlp",
                "num_epochs=1",
                "limit_train_steps=1",
                "progress=none",
                "distributed.nproc_per_node=2",
                "optimizer.lr=0.1,0.2",
                "+callbacks.note._target_=toy_callbacks.NotesItsProcess",
                f"+callbacks.note.out={out}",
                f"hydra.sweep.dir={tmp_path / 'sweep'}",
            ],
            tmp_path,
        )
    )
    servers = [[parent for _, parent in rank] for rank in processes(out)]
    assert servers[0] == servers[1] and len(servers[0]) == 2, servers  # per job, both ranks from one server
    spare, fresh = servers[0]
    assert "helpers.zygote" in spare and "multiprocessing.forkserver import main" in fresh, servers


@pytest.mark.slow
def test_verify_resumes_legs_are_spares_of_the_job_and_their_rank_servers_spares_of_the_legs(tmp_path):
    """mode=verify_resume's three legs (`python -m ddplab.verify`, config on stdin) each take a spare of the
    forked job, and a 2-rank leg's ranks come from a spare of that leg; it passes as with fresh legs (the
    verify_resume case above: the same lines, legs' logs, exit code and result)."""
    out = tmp_path / "out"
    out.mkdir()
    proc = jobs.python_train(
        [
            "model=mlp",
            "mode=verify_resume",
            "num_epochs=1",
            "limit_train_steps=4",
            "progress=none",
            "distributed.nproc_per_node=2",
            f"hydra.run.dir={tmp_path / 'run'}",
            "+callbacks.note._target_=toy_callbacks.NotesItsProcess",
            f"+callbacks.note.out={out}",
        ],
        tmp_path,
    )
    jobs.assert_ok(proc)
    assert "verify_resume: PASS" in proc.stdout + proc.stderr
    ranks = processes(out)
    assert [len(r) for r in ranks] == [3, 3], ranks  # the uninterrupted leg, the one stopped, the resumed one
    assert all(
        "helpers.zygote" in own and "helpers.zygote" in server for rank in ranks for own, server in rank
    ), ranks


@pytest.mark.slow
def test_torchruns_workers_are_spares_of_the_forked_launcher_restarts_included(tmp_path):
    """Each worker torchrun starts (again after a restart) is a spare of the forked launcher, its child."""
    out = tmp_path / "out"
    out.mkdir()
    server = jobs._zygote()
    served = server.served
    jobs.assert_ok(
        jobs.run_cmd(
            [  # rank 1 SIGKILLed in its 2nd training forward, in the first attempt only
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=2",
                "--max-restarts=1",
                str(jobs.TRAIN),
                "model=mlp",
                "model._target_=toy.FaultyMLP",
                "+model.fault=kill",
                "+model.fault_call=2",
                "num_epochs=1",
                "limit_train_steps=3",
                "progress=none",
                f"hydra.run.dir={tmp_path / 'run'}",
                "+callbacks.note._target_=toy_callbacks.NotesItsProcess",
                f"+callbacks.note.out={out}",
            ],
            tmp_path,
            180,
        )
    )
    assert server.served == served + 1
    ranks = processes(out)
    assert [len(r) for r in ranks] == [2, 2], ranks  # the first attempt and the restart
    assert all("helpers.zygote" in own and "-u" not in own.split() for rank in ranks for own, _ in rank), (
        ranks
    )


@pytest.mark.slow
def test_the_server_ends_when_its_pytest_process_dies_without_closing_it(tmp_path):
    """Its pytest process killed (no atexit), the server notices within 5 s, ends and removes its socket's
    dir."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    code = (
        "import sys, time; from helpers.jobs import _zygote; z = _zygote(); "
        "print(z.proc.pid, z.ready, z.dir, flush=True); time.sleep(600)"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", code],
        env=jobs.job_env(),
        cwd=jobs.REPO / "tests",
        stdout=subprocess.PIPE,
        text=True,
    )
    pid, ready, folder = owner.stdout.readline().split()
    assert ready == "True"
    os.kill(owner.pid, signal.SIGKILL)  # no atexit: the server is left to notice by itself
    owner.wait()
    deadline = time.time() + 15
    while (
        time.time() < deadline
        and os.path.exists(f"/proc/{pid}")
        and "Z" not in open(f"/proc/{pid}/stat").read().split()[2]
    ):
        time.sleep(0.2)
    assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2]
    assert not Path(folder).exists()


@pytest.mark.slow
def test_what_an_in_process_run_sets_in_the_environment_does_not_reach_the_next_tests_jobs(tmp_path):
    """ddplab sets library defaults in its own process (MLflow's retries and timeout, MLflow's credential
    variables). conftest puts every variable back after a test, so a later test's job still fits the job
    server (CI at 57efb72: one in-process MLflow run sent every later job of that worker to a fresh
    interpreter)."""

    from ddplab.runtime import env

    server = jobs._zygote()
    with jobs.environment_put_back(()):  # what conftest does around every test
        env.library_default("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        env.offer_mlflow_credentials("someone", "hunter2")
        assert not server.fits(jobs.job_env())  # a job started now would go to a fresh interpreter
    assert "MLFLOW_TRACKING_PASSWORD" not in os.environ or os.environ["MLFLOW_TRACKING_PASSWORD"] != "hunter2"
    served = server.served
    proc = jobs.python_train([*CASES["completes"], f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert server.served == served + 1
