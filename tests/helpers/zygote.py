"""The tests' jobs without an interpreter's start-up each time: a process per pytest worker imports what every
job imports (torch, Hydra, ddplab, TensorBoard, with train.preload: ~2 of the ~3 CPU-seconds a one-step job
costs) once, then forks a child per job (``helpers.jobs._servable``: train.py, torch's launchers, ``python -m
ddplab``, tests/workers). The child is a process of its own (pid, session, working dir, environment, stdout
and stderr pipes the caller reads to their end, as ``communicate()`` does) that runs the script as
``__main__`` and ends as the interpreter's own exit does (threads joined, atexit handlers, streams flushed,
exit code), as a fresh one does, without the module teardown after them
(``zygote_server.end_as_an_interpreter``: in a fork it copied ~30,000 of the server's pages, a third of a
short job's CPU).

Only where nothing the job reads at import time can differ: its environment is the server's but for
``MAY_DIFFER``, what a launcher gives a rank (``LAUNCHER_KEYS``) and PYTHONPATH entries before the server's
that shadow none of its imports (the child puts them on ``sys.path``). Tests that read a process's exec'd
command line or ``/proc/PID/environ`` ask for a real interpreter (``helpers.jobs.start(fresh=True)``);
``DDPLAB_TEST_FRESH=1`` makes every job one."""

from __future__ import annotations

import contextlib
import json
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from helpers.proctree import stacks_then_kill

# Entries a job may have that the server did not: read at run time only (tempfile's cache is reset; inductor
# reads its cache dir when it compiles, and an in-process run in pytest sets it), or the tests' own switches.
MAY_DIFFER = (
    "TMPDIR",
    "PYTEST_CURRENT_TEST",
    "DDPLAB_TEST_FRESH",
    "DDPLAB_TEST_CPU",
    "TORCHINDUCTOR_CACHE_DIR",
    "COUNT_OUT",
)
# What a launcher gives a rank the tests start by hand (plain processes with an init_method, srun's tasks):
# read when the process group forms, never at import (not OMP_NUM_THREADS: the OpenMP runtime reads it at
# load).
LAUNCHER_KEYS = re.compile(r"RANK|LOCAL_RANK|WORLD_SIZE|MASTER_ADDR|MASTER_PORT|SLURM_\w+")


class Zygote:
    def __init__(self, env: dict[str, str]) -> None:
        self.env, self.served = env, 0  # jobs it forked
        # their CPU seconds (a forked job is the server's child: the caller's rusage misses it)
        self.cpu = 0.0
        self.dir = Path(tempfile.mkdtemp(prefix="ddpz-"))
        self.path = self.dir / "s"
        # what the server itself says, out of any test's output
        with open(self.dir / "server.log", "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "helpers.zygote_server", str(self.path), str(os.getpid())],
                env=env,
                cwd=Path(__file__).parents[1],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                start_new_session=True,
            )
        self.ready = "ready\n" in iter(self.proc.stdout.readline, "")  # up to "ready", or EOF: it died
        self.proc.stdout.close()
        # the top-level modules the server imported, and those an interpreter runs as it starts: a job's own
        # PYTHONPATH entry holding one of them would have changed the job's start (a fork's is done)
        self.modules = {"sitecustomize", "usercustomize"} | (
            set((self.dir / "modules").read_text().split()) if self.ready else set()
        )

    def fits(self, env: dict[str, str]) -> bool:
        # tests/soak_toy.py's fault switches are read at run time; but its target "all" finds the trial's
        # processes by the SOAK_TRIAL_ID in /proc/PID/environ, which shows what a process was exec'd with: not
        # a fork's
        soak = '"target": "all"' not in env.get("SOAK_FAULT", "")

        def strip(e: dict[str, str]) -> dict[str, str]:
            return {
                k: v
                for k, v in e.items()
                if k not in MAY_DIFFER
                and not (soak and k.startswith("SOAK_"))
                and not (k not in self.env and LAUNCHER_KEYS.fullmatch(k))
                and k != "PYTHONPATH"
            }

        more = more_path(self.env.get("PYTHONPATH", ""), env.get("PYTHONPATH", ""))
        shadows = more is not None and any(
            p.name.split(".")[0] in self.modules for d in more if Path(d).is_dir() for p in Path(d).iterdir()
        )
        return (
            self.ready
            and self.proc.poll() is None
            and strip(env) == strip(self.env)
            and more is not None
            and not shadows
        )

    def start(
        self,
        argv: list[str],
        cwd: Path,
        env: dict[str, str],
        stdout: Any = subprocess.PIPE,
        stderr: Any = subprocess.PIPE,
    ) -> Job | None:
        """The job forked, as ``subprocess.Popen(..., stdout=, stderr=, start_new_session=True)`` starts it
        (``subprocess.PIPE``, ``subprocess.STDOUT`` for stderr, or a file); None where the server cannot take
        it (not fitting, gone, or a working dir Popen would refuse): the caller starts a fresh interpreter."""
        if not self.fits(env) or not Path(cwd).is_dir():
            return None
        ours, theirs = {}, []  # our ends of PIPEs; the descriptors the job gets as its stdout and stderr
        for name, given in (("stdout", stdout), ("stderr", stderr)):
            if given == subprocess.PIPE:
                ours[name], w = os.pipe()
                theirs.append(w)
            else:
                fd = theirs[0] if given == subprocess.STDOUT else given.fileno()
                theirs.append(os.dup(fd))
        conn = socket.socket(socket.AF_UNIX)
        try:
            conn.connect(str(self.path))
            socket.send_fds(conn, [b"F"], theirs)
            conn.sendall((json.dumps({"argv": argv, "cwd": str(cwd), "env": env}) + "\n").encode())
            pid = int(_line(conn, 30))
        except (OSError, ValueError):  # the server is gone: nothing started
            conn.close()
            for fd in ours.values():
                os.close(fd)
            return None
        finally:
            for fd in theirs:  # the job holds its own copies
                os.close(fd)
        self.served += 1
        return Job(self, conn, pid, [sys.executable, *argv], ours)

    def run(
        self, argv: list[str], cwd: Path, env: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess | None:
        """The job's CompletedProcess (its output read to the end, as ``communicate()`` reads it); None where
        the server cannot take it."""
        job = self.start(argv, cwd, env)
        if job is None:
            return None
        try:
            out, err = job.communicate(timeout)
        except subprocess.TimeoutExpired:
            stacks = stacks_then_kill(job.pid)
            out, err = job.communicate(30)
            raise AssertionError(
                f"timed out after {timeout}s: {argv}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}"
                f"\n--- where each process was\n{stacks}"
            ) from None
        return subprocess.CompletedProcess(job.args, job.returncode, out, err)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)


def more_path(served: str, job: str) -> list[str] | None:
    """The entries a job's PYTHONPATH puts before the server's (a user's package dir), which its fork puts on
    ``sys.path`` as the interpreter would have; None where it differs otherwise (a fresh interpreter then)."""
    if job == served:
        return []
    if not served:
        return job.split(os.pathsep)
    ending = os.pathsep + served
    if job == ending or not job.endswith(ending):  # an empty entry (the working dir) first, or another path
        return None
    return job[: -len(ending)].split(os.pathsep)


class Job:
    """A forked job as ``subprocess.Popen`` shows one: ``pid`` (signal it, or its session, as any process),
    ``poll``, ``wait``, ``communicate`` (text), ``send_signal``/``terminate``/``kill``, ``returncode``. Its
    exit code comes from the server, whose child it is (a signal's: minus its number, as Popen says)."""

    def __init__(self, server: Zygote, conn: socket.socket, pid: int, args: list[str], pipes: dict[str, int]):
        self.server, self.conn, self.pid, self.args = server, conn, pid, args
        self.returncode: int | None = None
        self.stdout = self.stderr = None  # communicate() returns what the pipes held
        self._pipes = pipes
        self._read: dict[int, list[bytes]] = {fd: [] for fd in pipes.values()}
        self._got = b""  # the server's reply so far: "<exit code> <CPU seconds>\n"

    def poll(self) -> int | None:
        return self._reply(0)

    def wait(self, timeout: float | None = None) -> int:
        if self._reply(timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        deadline = None if timeout is None else time.monotonic() + timeout
        if not _read_to_end(self._read, deadline):  # until every holder closed them, as communicate() waits
            raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()) + 30)
        texts = {name: b"".join(self._read[fd]).decode(errors="replace") for name, fd in self._pipes.items()}
        for fd in self._pipes.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._pipes = {name: -1 for name in self._pipes}
        return texts.get("stdout"), texts.get("stderr")

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never a pid the server reaped, which may be another process's by now
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _reply(self, timeout: float | None) -> int | None:
        """The exit code, once the server has sent it (within ``timeout``: 0 looks, None waits)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None and not self._got.endswith(b"\n"):
            self.conn.settimeout(None if deadline is None else max(0.0, deadline - time.monotonic()))
            try:
                chunk = self.conn.recv(64)
            except (TimeoutError, BlockingIOError):
                return None
            if not chunk:
                raise OSError(f"the job server closed the connection of job {self.pid}")
            self._got += chunk
        if self.returncode is None:
            rc, cpu = self._got.split()
            self.conn.close()
            self.returncode, self.server.cpu = int(rc), self.server.cpu + float(cpu)
        return self.returncode


def _line(conn: socket.socket, timeout: float) -> str:
    """One reply line (read byte-wise: a timed-out file object cannot be read again)."""
    conn.settimeout(timeout)
    got = b""
    while not got.endswith(b"\n"):
        chunk = conn.recv(1)
        if not chunk:
            raise OSError("the job server closed the connection")
        got += chunk
    return got.decode()


def _read_to_end(pipes: dict[int, list[bytes]], deadline: float | None) -> bool:
    """Read the pipes into their lists until EOF (True), or until the deadline (False; None: no deadline)."""
    with selectors.DefaultSelector() as sel:
        for fd in pipes:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 65536)
                if chunk:
                    pipes[key.fd].append(chunk)
                else:
                    sel.unregister(key.fd)
    return True
