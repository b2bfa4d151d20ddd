"""Loader workers leave their rank's process group and take SIGTERM from their rank alone (so a launcher's
stop signal, to the group or to every process of the job, is the rank's to act on:
ddplab.runtime.signals.shield_worker): a rank killed outright must still take its workers with it — even when
their queue to the rank is full, where torch's own parent watch hangs in multiprocessing's exit — and a rank's
own terminate() still ends them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

RANK = r"""
import os, sys, time, torch
from torch.utils.data import DataLoader, Dataset
from ddplab.runtime.signals import shield_worker

class Big(Dataset):  # 1 MB of bytes a sample: pickled through the worker's pipe, which fills at once
    def __len__(self): return 10_000
    def __getitem__(self, i): return b"x" * (1 << 20)

loader = iter(DataLoader(Big(), batch_size=None, num_workers=2, prefetch_factor=8,
                         worker_init_fn=shield_worker))
next(loader)
print(" ".join(str(w.pid) for w in loader._workers), flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_a_killed_ranks_loader_workers_end_within_two_seconds_though_their_queue_is_full():
    rank = subprocess.Popen([sys.executable, "-c", RANK], stdout=subprocess.PIPE, text=True)
    workers = [int(p) for p in rank.stdout.readline().split()]
    assert len(workers) == 2 and all(alive(p) for p in workers)
    time.sleep(1.0)  # the workers fill their queues
    os.kill(rank.pid, signal.SIGKILL)
    rank.wait()
    deadline = time.monotonic() + 2.5  # the workers' watch looks once a second (signals.LAUNCHER_POLL_S)
    while time.monotonic() < deadline and any(alive(p) for p in workers):
        time.sleep(0.1)
    left = [p for p in workers if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert left == []


SERVING = r"""
import signal, sys, torch
from torch.utils.data import DataLoader, Dataset
from ddplab.runtime.signals import WorkerShield

class Small(Dataset):
    def __len__(self): return 10_000
    def __getitem__(self, i): return torch.full((4,), i)

shield = WorkerShield()
with shield.starting():  # as ddplab's loaders fork their workers
    loader = iter(DataLoader(Small(), batch_size=None, num_workers=2, worker_init_fn=shield))
next(loader)
print(" ".join(str(w.pid) for w in loader._workers), flush=True)
sys.stdin.readline()  # the test has sent SIGTERM to both workers
print(sum(int(next(loader)[0]) for _ in range(50)), flush=True)  # both still serve batches
signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's watch would raise on the death this test causes
w = loader._workers[0]
# the rank's own SIGTERM (torch's shutdown after a timeout; Python's exit): status 0, as torch's
w.terminate()
w.join(5)
print(w.exitcode, flush=True)
"""


@pytest.mark.slow  # a second or more: a training run or a process (the inner loop stays under a minute)
def test_loader_workers_take_sigterm_from_their_rank_alone():
    """SLURM signals every process of a job (and ``kill -TERM`` of a process tree does the same): a worker
    ended by that fails its rank ("DataLoader worker exited unexpectedly") before the rank can checkpoint."""
    rank = subprocess.Popen(
        [sys.executable, "-c", SERVING],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        workers = [int(p) for p in rank.stdout.readline().split()]
        assert len(workers) == 2, rank.stderr.read()
        for p in workers:
            os.kill(p, signal.SIGTERM)
        time.sleep(0.5)
        assert all(alive(p) for p in workers)
        rank.stdin.write("\n")
        rank.stdin.flush()
        out, err = rank.communicate(timeout=30)
        # batches 1..50, then an exit torch calls clean
        assert out.split() == [str(sum(range(1, 51))), "0"], err
        assert rank.returncode == 0, err
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline and any(alive(p) for p in workers):
            time.sleep(0.1)
        assert not any(alive(p) for p in workers)
    finally:
        rank.kill()


FORKING = r"""
import os, signal, sys, torch
from torch.utils.data import DataLoader, Dataset
from ddplab.runtime.signals import WorkerShield

class Forks(Dataset):  # a sample made by a process the worker forks: is SIGTERM blocked in it?
    def __len__(self): return 4
    def __getitem__(self, i):
        pid = os.fork()
        if pid == 0:
            os._exit(int(signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])))
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

shield = WorkerShield()
with shield.starting():
    loader = DataLoader(Forks(), batch_size=None, num_workers=1, worker_init_fn=shield)
    print([int(b) for b in loader], flush=True)
"""


@pytest.mark.slow
def test_what_a_loader_worker_forks_takes_sigterm_as_usual():
    """The worker blocks SIGTERM (its one thread takes it); a process it forks inherited that block."""
    out = subprocess.run([sys.executable, "-c", FORKING], capture_output=True, text=True, timeout=60)
    assert out.stdout.split("\n")[0] == "[0, 0, 0, 0]", out.stderr[-2000:]


STOPPED = r"""
import atexit, os, signal, sys, time, torch
from torch.utils.data import DataLoader, Dataset
from ddplab.runtime import signals

class StopsAtTwo(Dataset):  # its worker stops itself fetching sample 2: a SIGTERM sent to it stays pending
    def __len__(self): return 8
    def __getitem__(self, i):
        if i == 2:
            os.kill(os.getpid(), signal.SIGSTOP)
        return i

shield = signals.WorkerShield()
with shield.starting():
    it = iter(DataLoader(StopsAtTwo(), batch_size=None, num_workers=1, worker_init_fn=shield,
                         prefetch_factor=2))
first, worker = next(it), it._workers[0].pid
# it prefetches sample 2: stopped
while open(f"/proc/{worker}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
    time.sleep(0.01)
print(first, worker, flush=True)
if sys.argv[1] == "without":  # multiprocessing's own exit: terminate, then a join without a bound
    atexit.unregister(signals._end_workers_at_exit)
sys.exit(0)  # the rank ends with the live iterator's worker stopped
"""


@pytest.mark.slow
def test_a_ranks_exit_kills_a_loader_worker_that_cannot_take_its_sigterm_within_its_bound():
    """A worker that cannot run its SIGTERM taker (here: stopped) would hold multiprocessing's exit join, and
    the rank, for ever; ddplab's exit hook joins for WORKER_EXIT_S, then kills it. Without the hook: still
    held."""
    from ddplab.runtime.signals import WORKER_EXIT_S

    ends = {}
    for how in ("with", "without"):
        rank = subprocess.Popen(
            [sys.executable, "-c", STOPPED, how],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        worker = None
        try:
            first, worker = rank.stdout.readline().split()
            assert first == "0"
            t0 = time.monotonic()
            try:
                rank.wait(WORKER_EXIT_S + 10)
                ends[how] = (rank.returncode, time.monotonic() - t0, alive(int(worker)))
            except subprocess.TimeoutExpired:
                ends[how] = (None, time.monotonic() - t0, alive(int(worker)))
        finally:  # the worker left its rank's group (shield_worker): killed by its pid
            for pid in (-rank.pid, *([int(worker)] if worker else [])):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            rank.wait()
    code, took, worker_left = ends["with"]
    assert code == 0 and WORKER_EXIT_S - 0.5 <= took <= WORKER_EXIT_S + 5 and not worker_left, ends
    assert ends["without"][0] is None, ends  # held past WORKER_EXIT_S + 10 s


STALE = r"""
import gc, os, sys
from torch.utils.data import DataLoader, Dataset
from ddplab.runtime.signals import WorkerShield

marker = sys.argv[1]

class Stale:  # garbage in a reference cycle, with a finalizer: only the cyclic collector frees it
    def __init__(self):
        self.me = self
    def __del__(self):
        with open(marker, "a") as f:
            f.write(f"{os.getpid()}\n")

class CollectsInWorker(Dataset):
    def __len__(self): return 2
    def __getitem__(self, i):
        gc.collect()  # a collection in the worker, as any allocation there may start one
        return i

gc.disable()  # the cycle stays uncollected until the fork, as garbage does between two collections
Stale()
shield = WorkerShield()
loader = DataLoader(CollectsInWorker(), batch_size=None, num_workers=1, worker_init_fn=shield)
with shield.starting():
    it = iter(loader)
print([int(b) for b in it], flush=True)
gc.enable()
gc.collect()
print(os.getpid(), flush=True)
"""


@pytest.mark.slow
def test_a_loader_worker_never_finalizes_what_it_inherited_from_its_rank(tmp_path):
    """The soak's pairwise trial 2027837527 (torchrun, a study's second trial, an HF stream read by 2 loader
    workers): a worker forked while the rank's last epoch's loader iterator was garbage in a cycle, not yet
    collected, collected it itself; its finalizer shut the old workers down from the wrong process
    ("AssertionError: can only test a child process") and hung there, before the worker's watch started: two
    ranks waited for data until distributed.timeout_s, and the hung workers outlived the job. A worker now
    leaves what it inherited to its rank: each finalizer runs once, in the process that made the object."""
    marker = tmp_path / "finalized"
    out = subprocess.run(
        [sys.executable, "-c", STALE, str(marker)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    batches, rank = out.stdout.splitlines()[:2]
    assert batches == "[0, 1]"
    assert marker.read_text().split() == [rank], (marker.read_text(), rank)
