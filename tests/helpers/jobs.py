"""Compose the real conf/, launch real processes, read TensorBoard back."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, open_dict

from ddplab.config import register_configs
from ddplab.events import read_scalars  # noqa: F401  (re-exported for the tests)
from helpers.proctree import stacks_then_kill

register_configs()  # what train.py does before composing
REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "train.py"
CONF = REPO / "conf"


def compose_cfg(overrides: list[str] | None = None, run_dir: Path | None = None) -> DictConfig:
    """The config `python train.py OVERRIDES` would get, optionally pinned to run_dir."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides or [])
    if run_dir is not None:
        with open_dict(cfg):
            cfg.run_dir = str(run_dir)
    return cfg


# Set (by conftest) while a test marked `cuda` runs: only those tests' jobs see the host's GPUs.
JOBS_ON_GPU = "DDPLAB_TEST_JOBS_ON_GPU"


_AT_START = dict(os.environ)  # this pytest process's environment before any test changed it


@contextlib.contextmanager
def environment_put_back(checked: tuple[str, ...]) -> Iterator[None]:
    """Fail where the block leaves one of `checked` changed; put every other variable back as it was. An
    in-process run sets library defaults (MLflow's retries, KERAS_BACKEND, MLflow's credential variables,
    inductor's switches): left behind, they would reach every later test's jobs, and keep them from the job
    server, whose environment must equal theirs."""
    before = dict(os.environ)
    yield
    try:
        changed = {
            k: (before.get(k), os.environ.get(k)) for k in checked if before.get(k) != os.environ.get(k)
        }
        assert not changed, f"the test left the job's environment changed (before, after): {changed}"
    finally:
        for k in set(os.environ) - set(before):
            del os.environ[k]
        os.environ.update({k: v for k, v in before.items() if os.environ.get(k) != v})


def job_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = {
        k: v
        for k, v in (os.environ if base is None else base).items()
        if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "TORCHELASTIC"))
    }
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    # tests/toy.py models and datasets are importable as `toy.X` in every rank.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "tests"), env.get("PYTHONPATH")]))
    if os.environ.get(JOBS_ON_GPU) != "1":  # the jobs are gloo-on-CPU jobs (2-3 ranks) on a GPU host too
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def run_cmd(
    args: list[str], cwd: Path, timeout: float = 300, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run to completion; on timeout say where each of its processes was, then kill them all (torchrun's
    workers too). ``python train.py`` and ``python -m torch.distributed.run`` are forked from this worker's
    pre-imported server where the job's environment allows (helpers/zygote.py), with their processes' spares
    (helpers/spares.py)."""
    if _servable(args) and os.environ.get("DDPLAB_TEST_FRESH") != "1":
        done = _zygote().run(args[1:], cwd, {**job_env(), **(extra_env or {})}, timeout)
        if done is not None:
            return done
    proc = subprocess.Popen(
        args,
        cwd=cwd,
        env={**job_env(), **(extra_env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stacks = stacks_then_kill(proc.pid)
        out, err = proc.communicate()
        raise AssertionError(
            f"timed out after {timeout}s: {args}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}"
            f"\n--- where each process was\n{stacks}"
        ) from None
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def start(
    args: list[str],
    cwd: Path,
    stdout: Any = subprocess.PIPE,
    stderr: Any = subprocess.PIPE,
    extra_env: dict[str, str] | None = None,
    fresh: bool = False,
) -> Any:
    """Started, not waited for, in a session of its own (so a signal to the group reaches torchrun's workers
    too): a ``subprocess.Popen``, or where it is ``python train.py`` or torchrun and the environment allows,
    the job forked from this worker's server (a Popen-like ``helpers.zygote.Job``: its pid, poll, wait,
    communicate, signals). ``fresh``: a real interpreter whatever the job (a test that reads its processes'
    command lines or ``/proc/PID/environ``, which show what a process was exec'd with)."""
    env = {**job_env(), **(extra_env or {})}
    if not fresh and _servable(args) and os.environ.get("DDPLAB_TEST_FRESH") != "1":
        job = _zygote().start(args[1:], cwd, env, stdout, stderr)
        if job is not None:
            return job
    return subprocess.Popen(
        args, cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=True, start_new_session=True
    )


# `python -m` modules the job server runs: torch's launchers (the current one and the legacy one) and ddplab's
# commands; scripts: train.py, the tests' own hand-launched ranks (tests/workers), the token files' maker (a
# corpus a fixture writes: ~4 CPU-s of imports in a fresh interpreter, nine times a suite) and the scripts a
# test runs only for what they print (the metrics and sweep tables, the DP-vs-DDP benchmark's refusal).
SERVED_MODULES = ("torch.distributed.run", "torch.distributed.launch", "ddplab")
SERVED_SCRIPTS = tuple(
    REPO / "scripts" / name
    for name in ("make_tokens.py", "show_metrics.py", "sweep_summary.py", "bench_dp_vs_ddp.py")
)


def _servable(args: list[str]) -> bool:
    return (
        len(args) > 1
        and args[0] == sys.executable
        and (
            (args[1] == "-m" and len(args) > 2 and args[2] in SERVED_MODULES)
            or Path(args[1]).name == "train.py"
            or Path(args[1]).parent == REPO / "tests" / "workers"
            or Path(args[1]) in SERVED_SCRIPTS
        )
    )


def torchrun(
    nproc: int,
    script_args: list[str],
    cwd: Path,
    timeout: float = 300,
    script: Path = TRAIN,
    extra_env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=N script ARGS` (a free port each time)."""
    return run_cmd(torchrun_cmd(nproc, script_args, script), cwd, timeout, extra_env)


def torchrun_cmd(nproc: int, script_args: list[str], script: Path = TRAIN) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(script),
        *script_args,
    ]


def ranks(
    n: int, script_args: list[str], cwd: Path, timeout: float = 300, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """The job on ``n`` ranks, the same job whichever launcher starts it: plain ``python train.py`` for one,
    its self-launch for more (``distributed.nproc_per_node=n``: ranks forked from one pre-imported server,
    where torchrun starts n + 1 interpreters, ~4 CPU-s each; past the machine's cores, CI's 2, the ranks share
    them: ``distributed.oversubscribe_cpu``)."""
    if n == 1:
        return python_train(script_args, cwd, timeout, extra_env)
    return python_train(
        [*script_args, f"distributed.nproc_per_node={n}", "distributed.oversubscribe_cpu=true"],
        cwd,
        timeout,
        extra_env,
    )


def rank_kills_itself(d: Path, rank: int, k: int) -> dict[str, str]:
    """Environment for tests/soak_toy.py's injector (with ``+callbacks.soak._target_=soak_toy.SoakCallback``):
    rank ``rank`` SIGKILLs itself before its ``k``-th optimizer step; ``d/fired`` records where. ``d`` lies
    outside the run dir, which the job must create itself."""
    import json

    d.mkdir(parents=True, exist_ok=True)
    spec = {"phase": "optimizer", "k": k, "rank": rank, "target": "self", "signal": "SIGKILL", "dir": str(d)}
    return {"SOAK_FAULT": json.dumps(spec), "SOAK_TRIAL_ID": str(d), "SOAK_DIR": str(d)}


def python_train(
    args: list[str], cwd: Path, timeout: float = 300, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``python train.py ARGS``: forked from this worker's pre-imported server where the job's environment
    allows (helpers/zygote.py), else a fresh interpreter."""
    return run_cmd([sys.executable, str(TRAIN), *args], cwd, timeout, extra_env)


_ZYGOTES: list = []
_ZYGOTE_START = threading.Lock()


def _zygote():
    """This pytest process's server (started at its first job, with the environment jobs get; killed at
    exit)."""
    with _ZYGOTE_START:
        if not _ZYGOTES:
            import atexit

            from helpers.zygote import Zygote

            # the environment jobs get from this process as it started: not from whichever test came first
            # (one that set a variable would leave every later job to a fresh interpreter)
            _ZYGOTES.append(
                Zygote({k: v for k, v in job_env(_AT_START).items() if k != "PYTEST_CURRENT_TEST"})
            )
            atexit.register(_ZYGOTES[0].close)
    return _ZYGOTES[0]


def own_tmpdir(tmp_path: Path) -> tuple[dict[str, str], Callable[[], list[str]]]:
    """A TMPDIR of the test's own, and what ddplab's ranks left in it (their scratch Hydra dirs,
    ``ddplab-rank*``): the machine's temp dir also holds the scratch of jobs other tests run beside this one
    (pytest -n 2), so a before/after look there is a race."""
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    return {"TMPDIR": str(tmp)}, lambda: sorted(p.name for p in tmp.glob("ddplab-rank*"))


def run_killed_after_step(cfg: DictConfig, step: int) -> None:
    """``ddplab.run(cfg)`` in this process, crashed by an exception right after optimizer step ``step``
    (a process dying mid-run, without any graceful stop)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    import ddplab

    calls: list[int] = []

    def kill(opt, *_):
        calls.append(1)
        if len(calls) == step:
            raise RuntimeError(f"killed at step {step}")

    handle = register_optimizer_step_post_hook(kill)
    try:
        with pytest.raises(RuntimeError, match=f"killed at step {step}"):
            ddplab.run(cfg)
    finally:
        handle.remove()


def job_dirs(cwd: Path) -> list[Path]:
    """Hydra single-run dirs under cwd/outputs/<date>/<time>."""
    return sorted(p for p in (cwd / "outputs").glob("*/*") if p.is_dir())


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    )


@contextlib.contextmanager
def tmpfs(path: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at ``path`` (``options``: "size=600k" for a disk that fills, "ro,size=1m"), unmounted
    after; the test skips where mounting needs root it does not have."""
    path.mkdir(parents=True, exist_ok=True)
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True
    ).returncode:
        pytest.skip(f"cannot mount a tmpfs ({options}) here (needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], capture_output=True)


def free_port() -> int:
    """A loopback port nothing listens on, for a server a test starts later. Below the kernel's ephemeral
    range: a port bind(("", 0)) hands out is free only until the kernel gives it to the next socket that asks,
    such as torchrun --standalone's store or any outgoing connection (seen: EADDRINUSE in a 2-rank tcp://
    init)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    pick = random.SystemRandom()
    for _ in range(500):
        port = pick.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{max(1024, low - 12000)}, {low})")
