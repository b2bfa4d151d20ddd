"""The job server's side of helpers/zygote.py (``python -m helpers.zygote_server PATH PARENT``): it imports
what every job imports once, then forks a child per job request, which becomes that job (its argv, cwd,
environment, file descriptors) and runs it as ``python train.py`` would."""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import sys
import tempfile
from pathlib import Path
from typing import Callable, NoReturn

from helpers.zygote import more_path


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


def end_as_an_interpreter(run: Callable[[], None]) -> NoReturn:
    """Run the job, then end as the interpreter's exit does, in its order: non-daemon threads joined, the
    atexit handlers (ddplab's one collection among them), stdout and stderr flushed (a failed flush: exit
    120), the exit code SystemExit gives (None: 0; not an int: printed, 1). What it skips is only the module
    teardown after them, which Python does not promise to finalize anything in: in a fork, that teardown
    writes to every page the server shares with it (each object's count, freed memory), ~30,000 copied pages
    and ~0.25 CPU-s a process, a third of a short job's CPU, which a fresh interpreter never pays. Anything
    else (KeyboardInterrupt, as Python re-raises SIGINT at its end) goes on to the interpreter's own exit."""
    import atexit
    import threading

    try:
        run()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    threading._shutdown()  # noqa: SLF001  (what Py_FinalizeEx calls first: the non-daemon threads joined)
    atexit._run_exitfuncs()  # noqa: SLF001  (then the handlers, last registered first)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            code = 120
    os._exit(code)


if __name__ == "__main__":
    job = serve(sys.argv[1], int(sys.argv[2]))
    # Only a forked child gets here: it runs train.py as `python train.py` would (or a module as `python -m`),
    # and ends as an interpreter does (an uncaught exception printed, exit 1; SystemExit's code; threads
    # joined; atexit handlers), without the module teardown (end_as_an_interpreter).
    become(*job)
    del job
    end_as_an_interpreter(lambda: run_as_main(list(sys.argv)))
