"""tests/toy.py's models and task that misbehave on purpose: an unused parameter, an injected fault (crash,
hang, SIGKILL, NaN, Inf gradients), slow steps, an abort at exit, a task that returns something wrong.
Named by `_target_=toy.X` (toy.py re-exports them). Test code may read RANK; ddplab's own code never does
outside ddplab.runtime.env.
"""

import atexit
import os
import signal
import time

import torch
from torch import nn

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
    """Crashes, hangs (fault="hang", or "hang_until_killed": ended by SIGTERM), gets SIGKILLed, makes the loss
    NaN (fault="nonfinite") or the gradients Inf with a finite loss (fault="infgrad") on `fault_rank` at its
    `fault_call`-th training forward — once per process, and only before any torchrun restart."""

    def __init__(
        self, fault: str = "crash", fault_rank: int = 1, fault_call: int = 3, fault_marker: str = "", **kw
    ):
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
                # sleep go on, holding torchrun for its 30 s grace): the tests that need a hung rank, not that
                # wait.
                signal.signal(signal.SIGTERM, lambda *_: os._exit(128 + signal.SIGTERM))
            time.sleep(3600)  # hang
        return out


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


class BadTask:
    """ClassificationTask that returns something wrong on purpose (fault=vector_loss | nonfinite |
    zero_count)."""

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
