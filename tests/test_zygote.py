"""The tests' job server (tests/helpers/zygote.py): a job forked from it ends as the same job in a fresh
interpreter does — exit code, its words on stdout and stderr, what it writes — so the tests that use it
(``python_train``) test what ``python train.py`` does."""

from __future__ import annotations

import json
import re
import sys

import pytest

from helpers import jobs

CASES = {
    "completes": ["model=mlp", "num_epochs=1", "limit_train_steps=2", "progress=none"],
    "config error": ["model=mlp", "num_epochs=0"],
    "a callback's exception": ["model=mlp", "num_epochs=1", "limit_train_steps=3", "progress=none",
                               "+callbacks.bug._target_=toy_callbacks.FailsOnRank", "+callbacks.bug.rank=0",
                               "+callbacks.bug.step=2"],
    "a process left holding stdout": ["model=mlp", "num_epochs=1", "limit_train_steps=1", "progress=none",
                                      "+callbacks.late._target_=toy_callbacks.LeavesAWriterBehind"],
    "SIGTERM after step 1": ["model=mlp", "num_epochs=1", "limit_train_steps=3", "progress=none",
                             "+callbacks.stop._target_=toy_callbacks.SignalAtStep", "+callbacks.stop.sig=SIGTERM",
                             "+callbacks.stop.step=1"],
}


def words(text: str, run: str) -> list[str]:
    """The lines less what differs between any two runs: clock times, durations, rates, the run dir."""
    text = text.replace(run, "RUN").replace(run.rsplit("/", 1)[1], "RUN")
    text = re.sub(r"\d\d:\d\d:\d\d", "T", text)
    text = re.sub(r"[\d,]+(\.\d+)? ?(s|ms|samples/s|it/s)\b", "N", text)
    return [line for line in text.splitlines() if "cfg=" not in line]  # the rank table's config hash names the dir


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_forked_job_ends_as_the_same_job_in_a_fresh_interpreter(case, tmp_path):
    ends = {}
    for how in ("forked", "fresh"):
        argv = [str(jobs.TRAIN), *CASES[case], f"hydra.run.dir={tmp_path / how}"]
        if how == "forked":
            server = jobs._zygote()
            served = server.served
            proc = server.run(argv, tmp_path, jobs.job_env(), 120)
            from helpers.zygote import MAY_DIFFER

            now = jobs.job_env()
            changed = sorted(k for k in set(now) | set(server.env) if k not in MAY_DIFFER and now.get(k) != server.env.get(k))
            assert proc is not None and server.served == served + 1, f"not taken; environment entries changed: {changed}"
        else:
            proc = jobs.run_cmd([sys.executable, *argv], tmp_path, 120)
        result = json.loads((tmp_path / how / "result.json").read_text()) if (tmp_path / how / "result.json").exists() else {}
        ends[how] = (proc.returncode, words(proc.stdout, str(tmp_path / how)), words(proc.stderr, str(tmp_path / how)),
                     {k: v for k, v in result.items() if k in ("status", "step", "epoch", "error")})
    assert ends["forked"] == ends["fresh"]
    assert ends["forked"][0] == {"completes": 0, "config error": 2, "a callback's exception": 1,
                                 "a process left holding stdout": 0, "SIGTERM after step 1": 143}[case]
    assert ("written-after-the-job-exited" in ends["forked"][1]) == (case == "a process left holding stdout")


@pytest.mark.slow
def test_the_server_ends_when_its_pytest_process_dies_without_closing_it(tmp_path):
    """Its pytest process killed (no atexit), the server notices within 5 s, ends and removes its socket's dir."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    code = ("import sys, time; from helpers.jobs import _zygote; z = _zygote(); "
            "print(z.proc.pid, z.ready, z.dir, flush=True); time.sleep(600)")
    owner = subprocess.Popen([sys.executable, "-c", code], env=jobs.job_env(), cwd=jobs.REPO / "tests",
                             stdout=subprocess.PIPE, text=True)
    pid, ready, folder = owner.stdout.readline().split()
    assert ready == "True"
    os.kill(owner.pid, signal.SIGKILL)  # no atexit: the server is left to notice by itself
    owner.wait()
    deadline = time.time() + 15
    while time.time() < deadline and os.path.exists(f"/proc/{pid}") and "Z" not in open(f"/proc/{pid}/stat").read().split()[2]:
        time.sleep(0.2)
    assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2]
    assert not Path(folder).exists()



@pytest.mark.slow
def test_what_an_in_process_run_sets_in_the_environment_does_not_reach_the_next_tests_jobs(tmp_path):
    """ddplab sets library defaults in its own process (MLflow's retries and timeout, MLflow's credential
    variables). conftest puts every variable back after a test, so a later test's job still fits the job server
    (CI at 57efb72: one in-process MLflow run sent every later job of that worker to a fresh interpreter)."""
    import os

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
