"""``python train.py ARGS`` for the tests without an interpreter's start-up each time: a process per pytest
worker imports what every job imports (torch, torch._dynamo, Hydra, ddplab, TensorBoard: ~2.5 of the ~3.6
CPU-seconds a one-step job costs) once, then forks a child per job. The child is a process of its own (its own
pid, session, working dir, environment, stdout and stderr) that runs train.py as ``__main__`` and ends
through the interpreter's own exit (threads joined, atexit handlers, exit code), as a fresh one does.

Only ``helpers.jobs.python_train`` uses it, and only where nothing the job reads at import time can differ:
the job's environment must be the one the server started with (``TMPDIR`` and pytest's own entries aside).
Launchers (torchrun, SLURM, the self-launch's ranks), signals and process-tree tests start real interpreters.
``DDPLAB_TEST_FRESH=1`` makes every job a fresh interpreter again."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

# Entries a job may have that the server did not: read at run time only (tempfile's cache is reset).
MAY_DIFFER = ("TMPDIR", "PYTEST_CURRENT_TEST")


class Zygote:
    def __init__(self, env: dict[str, str]) -> None:
        self.env, self.lock, self.served = env, threading.Lock(), 0  # jobs it forked
        self.dir = Path(tempfile.mkdtemp(prefix="ddpz-"))
        self.path = self.dir / "s"
        self.proc = subprocess.Popen([sys.executable, "-m", "helpers.zygote", str(self.path), str(os.getpid())], env=env,
                                     cwd=Path(__file__).parents[1], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, text=True, start_new_session=True)
        self.ready = self.proc.stdout.readline().strip() == "ready"

    def fits(self, env: dict[str, str]) -> bool:
        strip = lambda e: {k: v for k, v in e.items() if k not in MAY_DIFFER}  # noqa: E731
        return self.ready and self.proc.poll() is None and strip(env) == strip(self.env)

    def run(self, argv: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess | None:
        """The job's CompletedProcess; None where the server cannot take it (busy in another thread, or not
        fitting): the caller starts a fresh interpreter."""
        if not self.fits(env) or not self.lock.acquire(blocking=False):
            return None
        try:
            self.served += 1
            return self._run(argv, cwd, env, timeout)
        finally:
            self.lock.release()

    def _run(self, argv, cwd, env, timeout):
        out, err = (tempfile.NamedTemporaryFile("w+", dir=self.dir, suffix=s, delete=False) for s in (".out", ".err"))
        with socket.socket(socket.AF_UNIX) as s, out, err:
            s.connect(str(self.path))
            s.sendall((json.dumps({"argv": argv, "cwd": str(cwd), "env": env, "stdout": out.name,
                                   "stderr": err.name}) + "\n").encode())
            reply = s.makefile()
            pid = int(reply.readline())
            s.settimeout(timeout)
            try:
                rc = int(reply.readline())
            except (TimeoutError, socket.timeout):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                s.settimeout(30)
                reply.readline()
                raise AssertionError(f"timed out after {timeout}s: {argv}\n--- stdout\n{out.read()[-3000:]}\n"
                                     f"--- stderr\n{err.read()[-3000:]}")
            texts = out.read(), err.read()
        for f in (out, err):
            os.unlink(f.name)
        return subprocess.CompletedProcess([sys.executable, *argv], rc, *texts)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        for p in self.dir.iterdir():
            p.unlink()
        self.dir.rmdir()


def serve(path: str, parent: int) -> dict:
    """Import, then fork a child per request; returns only in a child, with its request. The server answers
    each request with the child's pid, then its exit code (a signal's: minus its number, as Popen says)."""
    import gc

    import hydra  # noqa: F401
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch.utils.tensorboard  # noqa: F401
    from torch.distributed.elastic.multiprocessing.errors import record  # noqa: F401

    import ddplab.cli  # noqa: F401
    import ddplab.config  # noqa: F401
    import ddplab.train.assemble  # noqa: F401
    import ddplab.train.loop  # noqa: F401

    gc.freeze()  # what it imported stays out of the children's collections (and their pages shared)
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen()
    print("ready", flush=True)
    server.settimeout(5)
    while True:
        try:
            conn, _ = server.accept()
        except TimeoutError:
            if os.getppid() != parent:  # its pytest process died without closing it: nothing will call again
                import shutil

                shutil.rmtree(Path(path).parent, ignore_errors=True)
                os._exit(0)
            continue
        conn.settimeout(None)
        request = json.loads(conn.makefile().readline())
        pid = os.fork()
        if pid == 0:
            server.close()
            conn.close()
            return request
        conn.sendall(f"{pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        with contextlib.suppress(OSError):
            conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
        conn.close()


def become(request: dict) -> None:
    """The child: a process of its own, as ``subprocess.Popen(..., start_new_session=True)`` makes one."""
    os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    for fd, name, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY),
                            (2, request["stderr"], os.O_WRONLY)):
        opened = os.open(name, flags)
        os.dup2(opened, fd)
        os.close(opened)
    sys.argv = list(request["argv"])
    sys.path[0] = str(Path(sys.argv[0]).resolve().parent)  # as `python train.py` sets it


if __name__ == "__main__":
    job = serve(sys.argv[1], int(sys.argv[2]))
    # Only a forked child gets here: it runs train.py as `python train.py` would, and ends as an interpreter
    # does (an uncaught exception printed, exit 1; SystemExit's code; threads joined; atexit handlers).
    become(job)
    del job
    import runpy

    runpy.run_path(sys.argv[0], run_name="__main__")
