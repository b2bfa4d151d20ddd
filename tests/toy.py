"""Models and datasets that misbehave on purpose, named by `_target_` in tests.

The test launchers put this folder on PYTHONPATH, so `model._target_=toy.X`
works in every rank. Test code may read RANK; ddplab's own code never does
outside ddplab.runtime.env.
"""

import atexit
import os
import signal
import time

import torch
from torch import nn

from ddplab.data import Splits, synthetic
from ddplab.models import MLP


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


class UnusedParamMLP(MLP):
    """An MLP with an extra head that forward never calls: its parameters get no gradient."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.aux_head = nn.Linear(4, 3)


_FAULTED = []  # once per process: an in-process resume must not fault again


class FaultyMLP(MLP):
    """Crashes, hangs (fault="hang", or "hang_until_killed": ended by SIGTERM), gets SIGKILLed, makes the loss NaN (fault="nonfinite") or the gradients Inf with a finite
    loss (fault="infgrad") on `fault_rank` at its `fault_call`-th training forward — once per process, and only
    before any torchrun restart."""

    def __init__(self, fault: str = "crash", fault_rank: int = 1, fault_call: int = 3, fault_marker: str = "", **kw):
        super().__init__(**kw)
        self.fault, self.fault_rank, self.fault_call, self.calls = fault, fault_rank, fault_call, 0
        self.fault_marker = fault_marker  # a file noting the fault, written just before it happens

    def forward(self, x):
        out = super().forward(x)
        if not self.training:
            return out
        self.calls += 1
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if _rank() == self.fault_rank and self.calls == self.fault_call and first_attempt and not _FAULTED:
            _FAULTED.append(self.fault)
            if self.fault_marker:
                with open(self.fault_marker, "w") as f:
                    f.write(f"{self.fault} rank {_rank()} pid {os.getpid()} call {self.calls}")
            if self.fault == "crash":
                raise RuntimeError(f"injected crash on rank {_rank()}")
            if self.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.fault == "nonfinite":
                return out * float("nan")
            if self.fault == "infgrad":
                out.register_hook(lambda g: torch.full_like(g, float("inf")))
                return out
            if self.fault == "hang_until_killed":
                # Hung, but ended by the launcher's SIGTERM (ddplab's handler would only note it and let the
                # sleep go on, holding torchrun for its 30 s grace): the tests that need a hung rank, not that wait.
                signal.signal(signal.SIGTERM, lambda *_: os._exit(128 + signal.SIGTERM))
            time.sleep(3600)  # hang
        return out


class _Slow(torch.utils.data.Dataset):
    def __init__(self, data, delay_s: float, rank: int):
        self.data, self.delay = data, delay_s if _rank() == rank else 0.0

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        if self.delay:
            time.sleep(self.delay)
        return self.data[i]


def slow_synthetic(delay_s: float = 0.002, slow_rank: int = 1, **kw) -> Splits:
    """synthetic() served through a DataLoader, with per-sample delay on one rank."""
    s = synthetic(**kw)
    return Splits(_Slow(s.train, delay_s, slow_rank), s.val, s.num_classes)


class SlowMLP(MLP):
    """An MLP whose training forward sleeps ``delay_s`` (and eval forward ``eval_delay_s``): a run long enough
    to be signalled mid-way. ``trace``: rank 0 appends "train|eval <time>" per forward to that file, so a test
    knows how far the run got when it sends its signal."""

    def __init__(self, delay_s: float = 0.02, eval_delay_s: float = 0.0, trace: str | None = None, **kw):
        super().__init__(**kw)
        self.delay_s, self.eval_delay_s, self.trace = delay_s, eval_delay_s, trace

    def forward(self, x):
        if self.trace and _rank() == 0:
            with open(self.trace, "a") as f:
                f.write(f"{'train' if self.training else 'eval'} {time.time()}\n")
        time.sleep(self.delay_s if self.training else self.eval_delay_s)
        return super().forward(x)


class AbortAtExitMLP(SlowMLP):
    """A SlowMLP whose rank ``abort_rank`` dies of SIGABRT as its interpreter exits, after the job ended (as
    a rank did once in the soak: "terminate called without an active exception" after a clean preemption)."""

    def __init__(self, abort_rank: int = 1, pid_dir: str | None = None, **kw):
        super().__init__(**kw)
        if pid_dir:  # self-launched ranks get RANK after they start: /proc/PID/environ cannot tell them apart
            with open(os.path.join(pid_dir, f"rank{_rank()}.pid"), "w") as f:
                f.write(str(os.getpid()))
        if _rank() == abort_rank:
            atexit.register(os.abort)
        else:  # the others take their time to exit: the launcher hears of the abort first
            atexit.register(time.sleep, 3)


RECORDED: list[tuple[str, int]] = []  # (hook, loop step) per Recorder call, in order (in-process runs)


class Recorder:
    """A user's callback (not a ddplab.callbacks.Callback subclass: duck typing is enough) that records
    every hook it receives."""

    def _note(self, hook, state):
        RECORDED.append((hook, state.loop.step))

    def setup(self, state): self._note("setup", state)
    def on_fit_start(self, state): self._note("on_fit_start", state)
    def on_step_end(self, state, step): self._note("on_step_end", state)
    def on_log(self, state, values, step): self._note("on_log", state)
    def on_eval_end(self, state, metrics): self._note("on_eval_end", state)
    def on_save(self, state, path): self._note("on_save", state)
    def on_load(self, state, path): self._note("on_load", state)
    def on_exception(self, state, exc): self._note("on_exception", state)
    def on_fit_end(self, state, metrics): self._note("on_fit_end", state)


class TrainingOnlyRecorder(Recorder):
    """A Recorder that serves training only (like a study trial's reporter): mode=eval leaves it out."""

    training_only = True

    def _note(self, hook, state):
        RECORDED.append((f"training_only.{hook}", state.loop.step))


class SignalJobAtLastSave:
    """Rank 0 sends SIGINT to every process of the job (a Ctrl-C in the terminal) right after the last
    checkpoint of the run, noting the time in ``stamp``: too late to stop anything, the job completes."""

    def __init__(self, last: int, stamp: str):
        self.last, self.stamp = last, stamp

    def on_save(self, state, path):
        if _rank() == 0 and state.loop.step == self.last and not os.path.exists(self.stamp):
            with open(self.stamp, "w") as f:
                f.write(repr(time.time()))
            os.killpg(os.getpgid(0), signal.SIGINT)


class KillLauncherAtFitEnd:
    """Rank 0 SIGKILLs its launcher (torchrun's agent) once training is over, and waits to be re-parented:
    the job then completes with no launcher (as when the agent dies during the last steps)."""

    def on_fit_end(self, state, metrics):
        if _rank() == 0:
            parent = os.getppid()
            os.kill(parent, signal.SIGKILL)
            t0 = time.monotonic()
            while os.getppid() == parent and time.monotonic() - t0 < 10:
                time.sleep(0.05)


class BadTask:
    """ClassificationTask that returns something wrong on purpose (fault=vector_loss | nonfinite | zero_count)."""

    metric_names = ("acc",)
    maximize = ("acc",)

    def __init__(self, fault: str = "vector_loss"):
        from ddplab.task import ClassificationTask

        self.fault, self.inner = fault, ClassificationTask()

    def __call__(self, model, batch):
        from ddplab.task import TaskOutput

        out = self.inner(model, batch)
        if self.fault == "vector_loss":
            return TaskOutput(out.loss.repeat(3), out.size, out.metrics)
        if self.fault == "nonfinite":
            return TaskOutput(out.loss * float("nan"), out.size, out.metrics)
        if self.fault == "zero_count":
            return TaskOutput(out.loss, out.size, {"acc": (out.metrics["acc"][0], 0)})
        return out


def ragged_digits(**kw):
    """digits whose collate function drops one label: a batch whose tensors disagree on their length."""
    from ddplab.data import digits

    s = digits(**kw)

    def collate(samples):
        return torch.stack([x for x, _ in samples]), torch.stack([y for _, y in samples])[:-1]

    return {"train": s.train, "val": s.val, "collate_fn": collate}


class _Noisy(torch.utils.data.Dataset):
    """Samples plus noise from a numpy generator of the dataset's own, which no checkpoint holds."""

    def __init__(self, base, seed):
        import numpy as np

        self.base, self.rng = base, np.random.default_rng(seed)

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        return x + torch.from_numpy(self.rng.normal(0.0, 0.5, tuple(x.shape)).astype("float32")), y


def noisy_digits(noise_seed=None, **kw):
    """digits with per-sample noise: ``noise_seed=None``, an unseeded generator (no two runs alike); a
    seed, the same noise each run, but after a resume the generator starts again from that seed."""
    from ddplab.data import digits

    s = digits(**kw)
    return {"train": _Noisy(s.train, noise_seed), "val": s.val}


class _TorchNoisy(torch.utils.data.Dataset):
    """Samples plus noise drawn from torch's global generator (what the docs tell users to do: ddplab seeds and
    checkpoints it)."""

    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        return x + 0.5 * torch.randn(x.shape), y


def torch_noisy_digits(**kw):
    """digits with per-sample noise from torch's global generator."""
    from ddplab.data import digits

    s = digits(**kw)
    return {"train": _TorchNoisy(s.train), "val": s.val}


class DigitStream(torch.utils.data.IterableDataset):
    """An IterableDataset over the digits: one order per (seed, epoch), split over DataLoader workers. It has no
    state_dict(): torchdata replays it on resume. ``short_on_rank``: that rank's stream ends ``short`` samples
    early (a user's rank-dependent stream)."""

    def __init__(self, x, y, seed=0, short_on_rank=None, short=0):
        self.x, self.y, self.seed, self.epoch, self.pos = x, y, seed, 0, 0
        self.short_on_rank, self.short = short_on_rank, short

    def set_epoch(self, epoch):
        self.epoch, self.pos = epoch, 0

    def __len__(self):
        return len(self.y)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        w, nw = (info.id, info.num_workers) if info else (0, 1)
        order = torch.randperm(len(self.y), generator=torch.Generator().manual_seed(self.seed * 1000 + self.epoch))
        if self.short_on_rank is not None and _rank() == self.short_on_rank:
            order = order[: len(order) - self.short]
        mine = order[w::nw]
        while self.pos < len(mine):
            i = int(mine[self.pos])
            self.pos += 1
            yield self.x[i], self.y[i]


class StatefulDigitStream(DigitStream):
    """The same stream with its position as state: torchdata restores it (in each worker) instead of replaying."""

    def state_dict(self):
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, sd):
        self.epoch, self.pos = sd["epoch"], sd["pos"]


def digit_stream(stateful=True, short_on_rank=None, short=0, **kw):
    """digits' training set as a (Stateful)DigitStream; validation a stream too, in stored order."""
    from ddplab.data import digits

    s = digits(**kw)
    cls = StatefulDigitStream if stateful else DigitStream
    return {"train": cls(s.train.x, s.train.y, kw.get("split_seed", 0), short_on_rank, short),
            "val": ValStream(s.val.x, s.val.y)}


class ValStream(torch.utils.data.IterableDataset):
    """Validation samples as a stream in their stored order."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __iter__(self):
        return zip(self.x, self.y)


class RankDependentStream(torch.utils.data.IterableDataset):
    """A user's stream that is not the same on every rank. ``how="shards_itself"``: it yields only its rank's
    share (torch.distributed.get_rank(), what datasets' split_dataset_by_node does), its __len__ that share's;
    ``how="python_shuffle"``: each epoch's order from Python's global random, which ddplab seeds per rank."""

    def __init__(self, x, y, how):
        self.x, self.y, self.how = x, y, how

    def _share(self):
        import torch.distributed as dist

        on = self.how == "shards_itself" and dist.is_initialized()
        return (dist.get_rank(), dist.get_world_size()) if on else (0, 1)

    def __len__(self):
        rank, world = self._share()
        return len(range(rank, len(self.y), world))

    def __iter__(self):
        import random

        order = list(range(len(self.y)))
        if self.how == "python_shuffle":
            random.shuffle(order)
        rank, world = self._share()
        for i in order[rank::world]:
            yield self.x[i], self.y[i]


def rank_dependent_stream(how, **kw):
    """digits' training set as a RankDependentStream; validation a stream in stored order."""
    from ddplab.data import digits

    s = digits(**kw)
    return {"train": RankDependentStream(s.train.x, s.train.y, how), "val": ValStream(s.val.x, s.val.y)}


STALLS: list[tuple[int, float]] = []  # (step, seconds the loop paused) per checkpoint, in-process runs


class StallRecorder:
    """Records how long each checkpoint held the loop (the manager's ``last_stall_s``)."""

    def on_save(self, state, path):
        STALLS.append((state.loop.step, state.checkpoints.last_stall_s))


class SlowDisk:
    """A slow file system under the checkpoints: every step file takes ``delay_s`` longer to write.
    ``signal_at``: rank 0 sends ``signal`` as that step's file starts being written (the write is then in
    flight, in the background with checkpoint.async_save): to its whole process group (``to="group"``, what
    SLURM does) or to its launcher only (``to="launcher"``: torchrun's agent, its parent)."""

    def __init__(self, delay_s: float = 0.0, signal_at: int = 0, signal: str = "SIGTERM", to: str = "group"):
        self.delay_s, self.signal_at, self.signal, self.to = delay_s, signal_at, signal, to
        self._real = None

    def setup(self, state):
        from ddplab.checkpoint import files

        real = self._real = files.save_atomic

        def slow(obj, path):
            if self.signal_at and path.name == f"step-{self.signal_at:08d}.pt":
                sig = getattr(signal, self.signal)
                os.kill(os.getppid(), sig) if self.to == "launcher" else os.killpg(os.getpgid(0), sig)
            time.sleep(self.delay_s)
            real(obj, path)

        files.save_atomic = slow  # files.save looks it up at each call

    def _restore(self):  # an in-process run leaves the next one a normal disk
        from ddplab.checkpoint import files

        if self._real is not None:
            files.save_atomic, self._real = self._real, None

    def on_fit_end(self, state, metrics):
        self._restore()

    def on_exception(self, state, exc):
        self._restore()


class LoadsEachSave:
    """A user's on_save that uploads each checkpoint: it opens ``path`` with torch.load and appends
    "<loop step now> <the file's loop step>" (or the error's type) to ``<record>-rank<r>.txt``."""

    def __init__(self, record: str):
        self.record = record

    def on_save(self, state, path):
        try:
            got = str(torch.load(path, map_location="cpu", weights_only=True)["loop"]["step"])
        except Exception as e:
            got = type(e).__name__
        with open(f"{self.record}-rank{_rank()}.txt", "a") as f:
            f.write(f"{state.loop.step} {got}\n")


def saves_seen(record: str, rank: int = 0) -> list[tuple[int, str]]:
    """LoadsEachSave's record of one rank: (loop step when on_save fired, the file's step or the error)."""
    with open(f"{record}-rank{rank}.txt") as f:
        return [(int(a), b) for a, b in (line.split() for line in f)]


class FailsOnRank:
    """A user's callback with a bug that shows on one rank only: ``rank`` raises after optimizer step ``step``."""

    def __init__(self, rank: int = 1, step: int = 3):
        self.rank, self.step = rank, step

    def on_step_end(self, state, step):
        if step == self.step and state.dist.rank == self.rank:
            raise RuntimeError(f"FailsOnRank: a callback's own bug on rank {self.rank} at step {step}")


class _DyingFile:
    """What torch.save writes through, for DiesMidWrite: after ``after_bytes`` the bytes so far are flushed,
    noted, and the process is SIGKILLed — from inside torch.save, on whatever thread writes."""

    def __init__(self, f, after_bytes: int, note: str):
        self.f, self.after, self.note, self.written = f, after_bytes, note, 0

    def write(self, data):
        n = self.f.write(data)
        self.written += len(data)
        if self.written >= self.after:
            self.f.flush()
            inner = self.f
            while not hasattr(inner, "fileno"):  # ddplab's own wrapper around the open file
                inner = inner.f
            inner.flush()
            os.fsync(inner.fileno())
            import threading

            with open(self.note, "w") as out:
                out.write(f"{threading.current_thread().name} {inner.name} {os.path.getsize(inner.name)}")
            os.kill(os.getpid(), signal.SIGKILL)
        return n

    def flush(self):
        self.f.flush()


class DiesMidWrite:
    """The process dies by SIGKILL inside the real checkpoint writer's torch.save, once ``after_bytes`` of step
    ``at``'s checkpoint are on disk. ``note`` gets "<thread> <file being written> <its size>" just before."""

    def __init__(self, at: int, note: str, after_bytes: int = 65536):
        self.at, self.note, self.after = at, note, after_bytes

    def setup(self, state):
        real = torch.save

        def save(obj, f, *a, **k):
            loop = obj.get("loop") if isinstance(obj, dict) else None
            if isinstance(loop, dict) and loop.get("step") == self.at:
                f = _DyingFile(f, self.after, self.note)
            return real(obj, f, *a, **k)

        torch.save = save
