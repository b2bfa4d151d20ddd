"""The tests' jobs without an interpreter's start-up each time: a process per pytest worker imports what every
job imports (torch, Hydra, ddplab, TensorBoard, with train.preload: ~2 of the ~3 CPU-seconds a one-step job
costs) once, then forks a child per job (``helpers.jobs._servable``: train.py, torch's launchers, ``python -m
ddplab``, tests/workers). The child is a process of its own (pid, session, working dir, environment, stdout
and stderr pipes the caller reads to their end, as ``communicate()`` does) that runs the script as
``__main__`` and ends through the interpreter's own exit (threads joined, atexit handlers, exit code), as a
fresh one does.

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
                [sys.executable, "-m", "helpers.zygote", str(self.path), str(os.getpid())],
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
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.pid, signal.SIGKILL)
            out, err = job.communicate(30)
            raise AssertionError(
                f"timed out after {timeout}s: {argv}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}"
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


def serve(path: str, parent: int) -> tuple[dict, list[int], list]:
    """Import, then fork a child per request; returns only in a child: its request, its stdout and stderr fds,
    and the warnings the imports raised (a fresh job prints them). The server answers each request with the
    child's pid, then its exit code (a signal's: minus its number, as Popen says) and CPU seconds."""
    import gc
    import warnings

    with warnings.catch_warnings(record=True) as said:
        import hydra  # noqa: F401
        import torch  # noqa: F401
        import torch.distributed.run  # noqa: F401  (torchrun's launcher)
        import torch.utils.tensorboard  # noqa: F401
        from torch.distributed.elastic.multiprocessing.errors import record  # noqa: F401

        import ddplab.cli  # noqa: F401
        import ddplab.config  # noqa: F401
        import ddplab.train.assemble  # noqa: F401
        import ddplab.train.loop  # noqa: F401
        import ddplab.train.preload  # noqa: F401  (last: its wrappers, as a rank server's)
        import helpers.spares  # noqa: F401

        ddplab.config.register_configs()  # as train.py does first (a job's call then finds them stored)
    gc.freeze()  # what it imported stays out of the children's collections (and their pages shared)
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen()
    (Path(path).parent / "modules").write_text("\n".join(sorted({m.partition(".")[0] for m in sys.modules})))
    print("ready", flush=True)
    return (*_serve_jobs(server, parent, Path(path).parent), said)


def _serve_jobs(server: socket.socket, parent: int, home: Path) -> tuple[dict, list[int]]:
    """A child per request, any number running at once; each answered with its pid, then, once it exited, its
    exit code and CPU seconds. Returns only in a child: its request and its stdout and stderr fds."""
    woken, wake = os.pipe()  # SIGCHLD's wakeup: a child exited
    os.set_blocking(wake, False)
    signal.set_wakeup_fd(wake)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the signal reaches the wakeup fd
    jobs: dict[int, socket.socket] = {}
    sel = selectors.DefaultSelector()
    sel.register(server, selectors.EVENT_READ)
    sel.register(woken, selectors.EVENT_READ)
    while True:
        if os.getppid() != parent:  # its pytest process died without closing it: nothing will call again
            import shutil

            shutil.rmtree(home, ignore_errors=True)
            os._exit(0)
        for key, _ in sel.select(5):
            if key.fileobj is woken:
                os.read(woken, 4096)
                continue
            conn, _ = server.accept()
            _, fds, _, _ = socket.recv_fds(conn, 1, 2)
            request = json.loads(conn.makefile().readline())
            pid = os.fork()
            # a process as a fresh one starts: no handler, no wakeup fd, none of the server's sockets
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                sel.close()
                for sock in (server, conn, *jobs.values()):
                    sock.close()
                os.close(woken)
                os.close(wake)
                return request, fds
            # the child's now: the caller sees EOF once the job (and whatever it started) closed them
            for fd in fds:
                os.close(fd)
            conn.sendall(f"{pid}\n".encode())
            jobs[pid] = conn
        _reap(jobs)


def _reap(jobs: dict[int, socket.socket]) -> None:
    """Tell each exited job's caller its exit code and CPU (its own and its reaped children's: not the
    caller's to see, the job being the server's child)."""
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = jobs.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(
                    f"{os.waitstatus_to_exitcode(status)} {usage.ru_utime + usage.ru_stime}\n".encode()
                )
            conn.close()


def become(request: dict, fds: list[int], said: list) -> None:
    """The child: a process of its own, as ``subprocess.Popen(..., start_new_session=True)`` makes one. Before
    it runs anything, the spares of the processes it will start (helpers/spares.py): it may return as one."""
    import multiprocessing.process
    import warnings

    from ddplab.runtime import env

    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((devnull, 0), (fds[0], 1), (fds[1], 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    served_path = os.environ.get("PYTHONPATH", "")
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[1:1] = [
        os.path.abspath(d) for d in more_path(served_path, os.environ.get("PYTHONPATH", "")) or ()
    ]
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    env._PARENT_AT_START = os.getppid()  # read at import (in the server): this process's parent is the server
    for w in said:  # what the imports warned, on this job's stderr as a fresh interpreter prints it
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    argv = list(request["argv"])
    if os.environ.get("DDPLAB_TEST_FRESH") != "1":
        from helpers import spares

        if argv[:2] in (["-m", "torch.distributed.run"], ["-m", "torch.distributed.launch"]):
            argv = (spares.offer_workers(spares.torchrun_workers(argv), said) or {"argv": argv})["argv"]
        else:
            if "mode=verify_resume" in argv:  # its three legs, each `python -m ddplab.verify`
                argv = (spares.offer_module_runs(3, "ddplab.verify", said) or {"argv": argv})["argv"]
            if argv[0] == "-m":  # as in a fresh `python -m`: not yet imported (its rank server re-runs it)
                _not_yet_run(argv[1])
            spares.offer_a_rank_server(said)  # the job's, or the leg's (a spare of the job, now a leg)
    multiprocessing.process.ORIGINAL_DIR = os.getcwd()  # what a fresh interpreter records at start
    sys.argv = argv
    # as `python train.py` sets it, or `python -m` (runpy then puts the module's file in argv[0])
    sys.path[0] = os.getcwd() if argv[0] == "-m" else str(Path(argv[0]).resolve().parent)


def _not_yet_run(module: str) -> None:
    """Forget the module `python -m` runs, so runpy runs it anew: a package's ``__main__`` (the package
    itself, ``ddplab``, stays: a fresh ``python -m ddplab`` imports it as one too)."""
    package = hasattr(sys.modules.get(module), "__path__")
    sys.modules.pop(f"{module}.__main__" if package else module, None)


def run_as_main(argv: list[str]) -> None:
    """``python SCRIPT`` or ``python -m MODULE``: the code runs as ``__main__``, and an uncaught exception's
    traceback starts where a fresh interpreter's does (at the script, or at runpy's frames for ``-m``)."""
    import runpy
    import types

    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]
            _not_yet_run(argv[1])  # imported by the server (what it imports is), not yet run as __main__
            # the module's own namespace, as `python -m`
            sys.modules["__main__"] = types.ModuleType("__main__")
            runpy._run_module_as_main(argv[1])  # noqa: SLF001  (what `python -m` calls: its frames, its argv)
        else:
            runpy.run_path(argv[0], run_name="__main__")
    except Exception as e:  # noqa: BLE001  (SystemExit and KeyboardInterrupt end the process as they would)
        tb = e.__traceback__.tb_next  # this function's frame
        while argv[0] != "-m" and tb is not None and tb.tb_frame.f_code.co_filename != argv[0]:
            tb = tb.tb_next  # runpy's run_path frames, which a fresh `python train.py` has not
        sys.excepthook(type(e), e.with_traceback(tb), tb)  # (Python's own hook prints the exception's)
        raise SystemExit(1) from None


if __name__ == "__main__":
    job = serve(sys.argv[1], int(sys.argv[2]))
    # Only a forked child gets here: it runs train.py as `python train.py` would (or a module as `python -m`),
    # and ends as an interpreter does (an uncaught exception printed, exit 1; SystemExit's code; threads
    # joined; atexit handlers).
    become(*job)
    del job
    run_as_main(list(sys.argv))
