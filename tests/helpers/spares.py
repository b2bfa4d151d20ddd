"""Processes a forked job would start as fresh interpreters, forked from it instead (helpers/zygote.py).

A job forked from the tests' job server already holds the imports every process of a job makes (~3 CPU-s
each): torch's launcher and ranks, and a self-launch's rank server. Before the job runs anything (it is
still the server's clean fork), it forks spares of itself, one per process it will start:

* a **rank server**: ``python train.py distributed.nproc_per_node=N`` forks its ranks from multiprocessing's
  fork server, which Python starts as ``python -c "from multiprocessing.forkserver import main; main(...)"``
  through ``multiprocessing.util.spawnv_passfds``; the job's first such start hands the spare the command and
  its two descriptors instead, and the spare runs the command;
* **torchrun's workers**: ``python -m torch.distributed.run ... train.py`` starts each rank as
  ``python -u train.py ...`` (``SubprocessHandler._popen``, in a session of its own); a spare takes each, with
  its environment and output files, and runs the script as that interpreter would.

A spare is then what the fresh interpreter would have been: a child of the job (a rank's parent is torchrun's
agent; the rank server's, the self-launching job), in the session it would be in, with the environment,
working dir, descriptors, ignored signals and signal mask an exec keeps. Only its start is cheaper. It takes a
start only where nothing an import reads differs from the job's own start (else the import would have gone
otherwise) and while spares last; else Python starts a fresh interpreter, as always. A spare never asked
ends when the job does (its end of the pair reads EOF). ``DDPLAB_TEST_FRESH=1``: no spares.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading

FORKSERVER = re.compile(r"from multiprocessing\.forkserver import main; main\((\d+), (\d+), ")
# Entries a process may get that the job did not start with, which only run-time code reads: what the
# self-launch adds (runtime/env.py's prepare_self_launch) and what torchrun's agent gives each rank.
ADDED_AT_LAUNCH = re.compile(
    r"DDPLAB_SELF_LAUNCHED|OMP_NUM_THREADS|RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|"
    r"GROUP_RANK|GROUP_WORLD_SIZE|ROLE_RANK|ROLE_NAME|ROLE_WORLD_SIZE|MASTER_ADDR|"
    r"MASTER_PORT|TORCHELASTIC_\w+|TORCH_NCCL_ASYNC_ERROR_HANDLING|NCCL_ASYNC_ERROR_HANDLING"
)


def imports_alike(before: dict[str, str], now: dict[str, str]) -> bool:
    """Nothing an import reads differs: every entry the job started with is as it was (OMP_NUM_THREADS, which
    a launcher sets only where unset, included), and what was added is only what a launcher adds."""
    return all(now.get(k) == v for k, v in before.items()) and all(
        ADDED_AT_LAUNCH.fullmatch(k) for k in set(now) - set(before)
    )


def _exec_keeps() -> dict:
    """What an exec'd child keeps of this process's signal state: ignored signals and the mask."""
    ignored = []
    for sig in signal.valid_signals():
        try:
            if signal.getsignal(sig) == signal.SIG_IGN:
                ignored.append(int(sig))
        except (OSError, ValueError):
            pass
    return {"ignored": ignored, "mask": [int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])]}


class Spare:
    """A fork of this (still clean) process, waiting for the one start it will take."""

    def __init__(self, earlier: list[Spare] = ()) -> None:
        self.ours, theirs = socket.socketpair()
        self.pid = os.fork()
        if self.pid == 0:
            for sibling in (self, *earlier):  # held here, an earlier spare would not see the job's end
                sibling.ours.close()
            self.request, self.fds = self._wait(theirs)  # only returns with a start to take
            return
        theirs.close()

    @staticmethod
    def _wait(conn: socket.socket) -> tuple[dict, list[int]]:
        try:
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 4)
        except OSError:
            msg, fds = b"", []
        conn.close()
        if not msg:  # the job ended without asking
            os._exit(0)
        return json.loads(msg), fds

    def hand(self, request: dict, fds: list[int]) -> bool:
        """Give the spare its start; False where it is gone (then start a fresh interpreter)."""
        try:
            socket.send_fds(self.ours, [json.dumps({**request, **_exec_keeps()}).encode()], fds)
            return True
        except OSError:
            return False
        finally:
            self.ours.close()

    def take_over(self) -> None:
        """In the spare: the environment, working dir and signal state the exec'd process would have."""
        import tempfile

        from ddplab.runtime import env

        os.environ.clear()
        os.environ.update(self.request["env"])
        tempfile.tempdir = None
        os.chdir(self.request["cwd"])
        env._PARENT_AT_START = os.getppid()  # the process that started it
        # ignored stays ignored across exec; handlers reset (none are set)
        for sig in self.request["ignored"]:
            signal.signal(sig, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_SETMASK, self.request["mask"])


def offer_a_rank_server(said: list) -> None:
    """One spare for the job's first fork server (multiprocessing.util.spawnv_passfds is wrapped)."""
    from multiprocessing import util

    started_with, spare = dict(os.environ), Spare()
    if spare.pid == 0:
        _serve_forks(spare, said)  # never returns
    spawn, spares = util.spawnv_passfds, [spare]

    def spawnv_passfds(path, args, passfds):
        cmd = args[-1] if len(args) > 2 and args[-2] == "-c" else ""
        if not spares or not FORKSERVER.match(cmd) or not imports_alike(started_with, dict(os.environ)):
            return spawn(path, args, passfds)
        spare = spares.pop()
        fds = [int(fd) for fd in passfds]
        if not spare.hand({"cmd": cmd, "passfds": fds, "env": dict(os.environ), "cwd": os.getcwd()}, fds):
            return spawn(path, args, passfds)
        return spare.pid

    util.spawnv_passfds = spawnv_passfds


def _serve_forks(spare: Spare, said: list) -> None:
    import warnings

    code = 0
    try:
        spare.take_over()
        sys.argv = ["-c"]
        for w in said:  # the imports' warnings, which a fresh server prints too
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
        # the descriptors, under numbers of their own here
        here = dict(zip(spare.request["passfds"], spare.fds))
        listener, alive = (here[int(n)] for n in FORKSERVER.match(spare.request["cmd"]).groups())
        cmd = FORKSERVER.sub(
            f"from multiprocessing.forkserver import main; main({listener}, {alive}, ",
            spare.request["cmd"],
            1,
        )
        exec(cmd, {"__name__": "__main__"})  # noqa: S102  (Python's own command, as `python -c` runs it)
    except SystemExit as e:  # how the server ends, once its last client is gone
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001  (as an interpreter's end: the traceback, exit 1)
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def offer_workers(count: int, said: list) -> dict | None:
    """``count`` spares for torchrun's workers (its ``SubprocessHandler._popen`` is wrapped). In a spare given
    a worker: that worker's request (argv, the rest already taken over), which the caller then runs; else
    None."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler as sh

    started_with = dict(os.environ)
    request, spares = _fork_spares(count, said)
    if request is not None:
        return request
    popen = sh.SubprocessHandler._popen

    def _popen(self, args, env):
        ours = (
            len(args) > 2
            and args[0] == sys.executable
            and args[1] == "-u"
            and str(args[2]).endswith(".py")
            and imports_alike(started_with, env)
        )
        if not ours or not spares:
            return popen(self, args, env)
        spare = spares.pop(0)
        outs = [f.fileno() for f in (self._stdout, self._stderr) if f is not None]
        request = {
            "argv": [str(a) for a in args[2:]],
            "env": dict(env),
            "cwd": os.getcwd(),
            "setsid": True,
            "std": [t for t, f in ((1, self._stdout), (2, self._stderr)) if f is not None],
        }
        if not spare.hand(request, outs):
            return popen(self, args, env)
        return Started(spare.pid, args)

    sh.SubprocessHandler._popen = _popen
    return None


def torchrun_workers(argv: list[str]) -> int:
    """The workers torchrun may start for ``argv``: per node, once per attempt (its restarts)."""
    got = {"nproc_per_node": "1", "max_restarts": "0"}
    for i, a in enumerate(argv):
        key, _, value = a.lstrip("-").replace("-", "_").partition("=")
        if key in got and a.startswith("--"):
            got[key] = value or (argv[i + 1] if i + 1 < len(argv) else "")
    try:
        return int(got["nproc_per_node"]) * (int(got["max_restarts"]) + 1)
    except ValueError:  # "auto", "cpu": none
        return 0


def offer_module_runs(count: int, module: str, said: list) -> dict | None:
    """``count`` spares for children started as ``subprocess.Popen([sys.executable, "-m", module, ...])``
    (verify_resume's legs; Popen's ``_execute_child`` is wrapped): the spare gets the child's stdin, stdout
    and stderr, and the Popen its pid, as if it had forked and exec'd. In a spare given a start: its
    request."""
    import inspect

    started_with = dict(os.environ)
    request, spares = _fork_spares(count, said)
    if request is not None:
        return request
    execute = subprocess.Popen._execute_child
    params = inspect.signature(execute)

    def _execute_child(self, *args):
        a = params.bind(self, *args).arguments
        cmd, env = (
            [str(x) for x in a["args"]] if isinstance(a["args"], list) else [],
            a["env"] or dict(os.environ),
        )
        ours = (
            cmd[:3] == [sys.executable, "-m", module]
            and not a["shell"]
            and a["executable"] is None
            and a["preexec_fn"] is None
            and not a["pass_fds"]
            and a["uid"] is None
            and a["gid"] is None
            and imports_alike(started_with, dict(env))
        )
        std = [(t, fd) for t, fd in ((0, a["p2cread"]), (1, a["c2pwrite"]), (2, a["errwrite"])) if fd != -1]
        request = {
            "argv": cmd[1:],
            "env": {str(k): str(v) for k, v in env.items()},
            "cwd": str(a["cwd"] or os.getcwd()),
            "std": [t for t, _ in std],
            "setsid": bool(a["start_new_session"]),
        }
        if not ours or not spares or not (spare := spares.pop(0)).hand(request, [fd for _, fd in std]):
            return execute(self, *args)
        self.pid, self._child_created = spare.pid, True
        self._close_pipe_fds(
            *(a[k] for k in ("p2cread", "p2cwrite", "c2pread", "c2pwrite", "errread", "errwrite"))
        )

    subprocess.Popen._execute_child = _execute_child
    return None


def _fork_spares(count: int, said: list) -> tuple[dict | None, list[Spare]]:
    """``count`` spares of this process; in a spare once it is given a start: (its request, []) with the start
    taken over (``_become``); here: (None, the spares)."""
    spares: list[Spare] = []
    for _ in range(count):
        spare = Spare(spares)
        if spare.pid == 0:
            return _become(spare, said), []
        spares.append(spare)
    return None, spares


def _become(spare: Spare, said: list) -> dict:
    """The process Popen would have started: its session (SubprocessHandler starts each torchrun worker in one
    of its own), its stdin, stdout and stderr, then environment, working dir and signal state. (Popen's child
    puts SIGPIPE and SIGXFSZ back to the default before its exec; Python then ignores both again at start, as
    they are here.)"""
    import warnings

    if spare.request["setsid"]:
        os.setsid()
    for fd, target in zip(spare.fds, spare.request["std"]):  # the pipes and files Popen set up for the child
        os.dup2(fd, target)
        os.close(fd)
    spare.take_over()
    for w in said:  # the imports' warnings, which a fresh interpreter prints too
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    return spare.request


class Started(subprocess.Popen):
    """A ``Popen`` for a child already running (a spare that took the start): wait, poll and signals work as
    for one Popen started, since it is this process's own child."""

    def __init__(self, pid: int, args) -> None:  # noqa: D107  (no super().__init__: that would start one)
        self.args, self.pid, self.returncode = args, pid, None
        self.stdin = self.stdout = self.stderr = None
        self._waitpid_lock = threading.Lock()
        self._input = None
        self._communication_started = False
        self._child_created = True
        self._sigint_wait_secs = 0.25
        self._closed_child_pipe_fds = True
        self.text_mode = False
        self.encoding = self.errors = None
        self.universal_newlines = False
        self.pipesize = -1
