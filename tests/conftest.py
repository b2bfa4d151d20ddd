"""Fixtures and pytest hooks. The shared helpers are the ``helpers`` package (jobs, counting, compare,
study)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Bytecode written as modules are first imported, by this process and every one it starts (xdist's workers,
# the jobs): the README's install skips pip's compiling of every installed file (--no-compile: ~130 of its
# CPU-s, for 20,000 files the tests mostly never import), and where PYTHONDONTWRITEBYTECODE is set (the
# development VM and CI) no process would write it, so every fresh interpreter (torchrun's ranks, study
# workers, scripts) compiled torch's and ddplab's modules anew. Before helpers.jobs: the job server starts
# with this environment.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

import helpers.jobs  # noqa: E402  (registers ddplab's configs as train.py does, before any test composes)

# Fixtures that tests of both tiers (tests/unit/, tests/integration/) take: one copy each, in helpers/.
pytest_plugins = ["helpers.checkpoints", "helpers.steps", "helpers.trust"]

# Markers (pyproject.toml registers them; --strict-markers refuses others):
#   slow  — seconds or more: whole training runs, real processes. `pytest -m "not slow"` is the inner loop.
#   dist  — starts real multi-process jobs (gloo on CPU); always slow too.
#   slurm — submits jobs to a real SLURM cluster; always slow too.
#   netns — two hosts made of network namespaces (scripts/netns_cluster.sh); always slow too.
#   cuda  — needs a CUDA GPU: skipped without one (the reason names CUDA, so .ci/run allows the skip).


def pytest_configure(config):
    import torch

    # In-process jobs run with one intra-op thread, as the jobs the tests launch do (helpers.jobs.job_env sets
    # OMP_NUM_THREADS=1): two threads a worker, beside the other worker and both workers' jobs on 2 cores,
    # spin-wait for cores that are busy.
    torch.set_num_threads(1)
    # Under `-n 3 --dist loadgroup` a test that is in no xdist_group is a unit of its own, handed to whichever
    # worker is free: the tests of a module that share a module-scoped run (test_resume_world_sizes' reference
    # runs, 13 processes) land on both workers, between other modules' tests, and pytest builds the run again
    # each time its module comes back. Those tests are one group each (one worker, one after another). xdist
    # would then start the biggest groups first, ahead of the soak: the order below is kept instead.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if config.getvalue("dist") == "loadgroup" and _drops_xdist_groups():
        raise pytest.UsageError(
            f"--dist loadgroup: pytest {pytest.__version__} drops the xdist_group of every test "
            "(pytest-dev/pytest-xdist#1386). Fix: pip install 'pytest<9.2'"
        )


def _drops_xdist_groups() -> bool:
    """xdist groups tests by a suffix it adds to their node ids; pytest 9.2 drops it, so every group is spread
    over both workers without a word: the slurm tests then run at once and one's scancel signals the other's
    job (a clean clone's CI failed so). xdist 3.8.0 is the newest, and broken, release as of writing."""
    from importlib.metadata import version

    from packaging.version import Version

    return Version(pytest.__version__) >= Version("9.2") and Version(version("pytest-xdist")) <= Version(
        "3.8.0"
    )


def pytest_collection_modifyitems(config, items):
    import torch

    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    # The soak plan (12 minutes, the longest test by far) first: under `-n 3` one worker runs it while the
    # others takes the rest, instead of it starting last and running alone; then the slurm tests, whose jobs
    # mostly wait on SLURM (one worker takes them in turn, beside the rest).
    items.sort(
        key=lambda item: (
            item.name != "test_the_pairwise_soak_plan_holds_every_invariant",
            item.get_closest_marker("slurm") is None,
        )
    )
    # .ci/run runs them in a phase of their own, beside this one
    if os.environ.get("DDPLAB_SLURM_APART") == "1":
        apart = [item for item in items if item.get_closest_marker("slurm")]
        items[:] = [item for item in items if not item.get_closest_marker("slurm")]
        config.hook.pytest_deselected(items=apart)
    for item in items:
        # keras: its import alone takes seconds (a parametrized case of an otherwise quick test)
        if item.get_closest_marker("dist") or item.get_closest_marker("slurm") or "keras" in item.name:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("cuda") and not torch.cuda.is_available():
            item.add_marker(no_gpu)


_STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")


@pytest.fixture(autouse=True)
def _leaves_no_signal_state():
    """A test that runs ddplab in this process (a study, a job) must leave the stop signals' handlers and
    ddplab's held signals as it found them: a leak failed a later, unrelated test, whichever the xdist worker
    ran next (CI at c386c65). Checked after each test, so the test that leaks is the one that fails."""
    import signal

    from ddplab.runtime import signals

    def state():
        return (
            [signal.getsignal(getattr(signal, s)) for s in _STOP_SIGNALS],
            list(signals._EARLY),
            list(signals._FOR_LIFE),
        )

    before = state()
    yield
    assert state() == before, f"this test left signal state behind: {before} -> {state()}"


def _session_root(config) -> Path:
    """The session's temp root: xdist's workers each have a dir under it, the process that starts them has
    it."""
    base = config._tmp_path_factory.getbasetemp()  # noqa: SLF001  (pytest's own tmp_path_factory)
    return base.parent if hasattr(config, "workerinput") else base


@pytest.fixture(scope="session")
def mlflow_server(request):
    """One real `mlflow server` on loopback for the session's MLflow tests, shared by the workers
    (helpers/tracking.py); its URI."""
    pytest.importorskip("mlflow", reason="the mlflow extra: pip install 'ddplab[mlflow]'")
    from helpers.tracking import shared

    return shared(_session_root(request.config))


def pytest_sessionfinish(session):
    if not hasattr(session.config, "workerinput"):  # the process that started the workers (or the only one)
        from helpers.tracking import stop

        stop(_session_root(session.config))


@pytest.fixture
def small() -> list[str]:
    """Overrides that keep a digits run to a second or two."""
    return ["num_epochs=1", "model=mlp", "log_every_n_steps=5", "progress=log"]


# What a CI machine may lack, so a test may skip there: a GPU, a SLURM cluster or the two-host cluster (the
# first phase of .ci/run; later phases start them), a CPU that computes bf16 natively. Any other skip — `ss`
# missing, a mount refused, keras absent — would hide an untested promise: under DDPLAB_CI=1 (.ci/run) it
# fails instead.
CI_MAY_SKIP = ("CUDA", "GPU", "SLURM", "computes bf16 natively", "two-host cluster")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.skipped and os.environ.get("DDPLAB_CI") == "1" and not hasattr(rep, "wasxfail"):
        reason = str(rep.longrepr[2] if isinstance(rep.longrepr, tuple) else rep.longrepr)
        if not any(word in reason for word in CI_MAY_SKIP):
            rep.outcome = "failed"
            rep.longrepr = (
                f"skipped under DDPLAB_CI=1: {reason}. Fix: make .ci/run provide what this test needs"
            )


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """The same for a whole file skipped while it is collected (an extra missing: ``helpers.extras.needs`` at
    its top): a broken transformers, datasets or mlflow would otherwise make ~50 tests vanish with CI
    green."""
    outcome = yield
    rep = outcome.get_result()
    if rep.skipped and os.environ.get("DDPLAB_CI") == "1":
        reason = str(rep.longrepr[2] if isinstance(rep.longrepr, tuple) else rep.longrepr)
        if not any(word in reason for word in CI_MAY_SKIP):
            rep.outcome = "failed"
            rep.longrepr = (
                f"{collector.nodeid} skipped under DDPLAB_CI=1: {reason}. Fix: make .ci/run install it"
            )


# The variables that place a process in a job: ddplab reads them at every run, so one a test leaves behind
# changes every later in-process run of the session (LOCAL_RANK=1 makes a GPU host ask for cuda:1; a CPU
# host would not notice).
_JOB_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "CUDA_VISIBLE_DEVICES",
)


@pytest.fixture(autouse=True)
def _job_env_left_as_found():
    with helpers.jobs.environment_put_back(_JOB_ENV):
        yield


@pytest.fixture(autouse=True)
def _gpu_only_for_cuda_tests(request):
    """Jobs a test starts see the host's GPUs only where the test is marked `cuda` (helpers.jobs.job_env).
    Not monkeypatch: its undo would come after _job_env_left_as_found's check and hide the tests' leaks."""
    cuda = request.node.get_closest_marker("cuda") is not None
    if cuda:
        os.environ[helpers.jobs.JOBS_ON_GPU] = "1"
    yield
    if cuda:
        os.environ.pop(helpers.jobs.JOBS_ON_GPU, None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """DDPLAB_TEST_CPU=FILE: each test's wall and CPU seconds (its own process and every process it started
    and reaped: the ranks, launchers, servers) appended to FILE.<worker> as JSON lines, to see where CI's CPU
    goes (2 cores, ~94 % busy: wall time alone hides which tests cost the machine)."""
    out = os.environ.get("DDPLAB_TEST_CPU")
    if not out:
        yield
        return
    import json
    import resource
    import time

    def cpu() -> float:
        forked = sum(z.cpu for z in helpers.jobs._ZYGOTES)  # jobs forked by the server (not our children)
        return forked + sum(
            r.ru_utime + r.ru_stime
            for r in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
        )

    t0, c0 = time.monotonic(), cpu()
    yield
    line = {"test": item.nodeid, "wall": round(time.monotonic() - t0, 2), "cpu": round(cpu() - c0, 2)}
    with open(f"{out}.{os.environ.get('PYTEST_XDIST_WORKER', 'main')}", "a") as f:
        f.write(json.dumps(line) + "\n")
