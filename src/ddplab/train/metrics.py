"""Metric accumulators and their one-collective reduction, for any named task metrics.

Per step, only device-side stores happen (no ``.item()``, no collective):
on a GPU these are queued kernels and never stall the host. Once per log
interval every rank's numbers are packed into one row (:class:`Slots` names
its slots) and exchanged in a single collective
(:func:`ddplab.runtime.collectives.all_ranks_rows`), from which
sample-weighted means (sums / counts — not a mean of rank means) and the
max/min over ranks (stragglers) are read. The task's metric names ride along
in the row; this module never needs to know them in advance.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Iterable

import torch
from torch import Tensor

from ddplab.runtime.collectives import all_ranks_rows, all_ranks_values, any_rank
from ddplab.runtime.group import Dist
from ddplab.task import TaskError, TaskOutput

log = logging.getLogger("ddplab")


class Slots:
    """Named slots of a packed per-rank row: ``row[slots["loss"]]`` instead of magic offsets."""

    def __init__(self, names: Iterable[str]):
        self.names = list(names)
        self.index = {n: i for i, n in enumerate(self.names)}

    def __getitem__(self, name: str) -> int:
        return self.index[name]

    def __len__(self) -> int:
        return len(self.names)


def _metric_slots(metric_names: Iterable[str]) -> list[str]:
    return [s for m in metric_names for s in (f"{m}.sum", f"{m}.count")]


def _means(
    total: list[float], slots: Slots, metric_names: Iterable[str], where: str = ""
) -> dict[str, float]:
    """num_samples, the sample-weighted loss and each metric's sum/count from summed rows.

    A declared metric whose count is 0 over samples that exist has no mean: that is a task
    bug (a count that is not the number of items summed), said here, where the host has the
    numbers anyway.
    """
    count = total[slots["num_samples"]]
    out = {"num_samples": count}
    if count:
        out["loss"] = total[slots["loss"]] / count
    for m in metric_names:
        n = total[slots[f"{m}.count"]]
        if n:
            out[m] = total[slots[f"{m}.sum"]] / n
        elif count:
            raise TaskError(
                f"metric {m!r} has count 0 over {count:.0f} samples ({where}): its mean is undefined "
                f"(sum {total[slots[f'{m}.sum']]!r}). Fix: return ({m} sum, count) with count = the "
                "number of items the sum is over, > 0 for a batch that has any"
            )
    return out


class SumMeter:
    """Device-side sums of an evaluation: loss x size, samples, and each metric's (sum, count)."""

    def __init__(self, device: torch.device, metric_names: Iterable[str]):
        self.metric_names = tuple(metric_names)
        self.slots = Slots(["loss", "num_samples", *_metric_slots(self.metric_names)])
        # float64: exact sample counts and sums far past float32's 2**24.
        self.sums = torch.zeros(len(self.slots), dtype=torch.float64, device=device)

    def update(self, out: TaskOutput) -> None:
        """``out.loss`` is the batch mean; weighted by the batch size so means stay exact."""
        slots = self.slots
        with torch.no_grad():
            self.sums[slots["loss"]] += out.loss.detach().double() * out.size
            self.sums[slots["num_samples"]] += out.size
            for m in self.metric_names:
                s, c = out.metrics[m]
                self.sums[slots[f"{m}.sum"]] += s
                self.sums[slots[f"{m}.count"]] += c

    def reduce(self, dist: Dist, where: str = "evaluation") -> dict[str, float]:
        """Exact validation metrics from every rank's sums (one collective)."""
        rows = all_ranks_rows(self.sums, dist).tolist()  # the one host-device sync
        total = [_sum(column) for column in zip(*rows)]  # exactly rounded, as the log step's
        return {f"val/{k}": v for k, v in _means(total, self.slots, self.metric_names, where).items()}


def _sum(xs: Iterable[float]) -> float:
    """Exactly rounded (``math.fsum``: the same in any order); with inf and -inf, or past float64's range,
    what float addition gives (nan, inf), as a log step says it, never a crash."""
    xs = list(xs)
    try:
        return math.fsum(xs)
    except (ValueError, OverflowError):
        return sum(xs)


class NonFiniteLossError(FloatingPointError):
    pass


class TrainMetrics:
    """Training-side accumulation between log steps, plus host timers per rank.

    Per micro-batch the device only *stores* the mean loss and each metric's
    sum (and count, if it is a tensor) into a row of one preallocated table: a
    few tiny kernels, no sync, no collective. Once per log interval the table
    is read to the host in one copy (the interval's sync, which the collective
    needed anyway), and the sample-weighted sums, the NaN/Inf check naming the
    first bad step and the grad-norm mean are plain arithmetic there: a log
    step's small device ops cost 10-30 µs each on a CPU, and there were ~40.
    """

    # The row's layout: the sums over the micro-batches, the first bad one, the grad norm, then what the host
    # knows. The metrics' sums and counts go between num_samples and nonfinite.
    _HEAD = ["loss", "num_samples"]
    _TAIL = [
        "nonfinite",
        "nonfinite_micro",
        "grad_norm",
        "grad_norm.count",
        "step_time",
        "data_time",
        "steps",
        "wall",
        "peak_mem",
        "stop",
    ]

    def __init__(
        self,
        dist: Dist,
        metric_names: Iterable[str],
        nonfinite: str = "error",
        accum: int = 1,
        capacity: int = 64,
    ):
        self.dist = dist
        self.metric_names = tuple(metric_names)
        sums, counts = [f"{m}.sum" for m in self.metric_names], [f"{m}.count" for m in self.metric_names]
        self.slots = Slots(self._HEAD + sums + counts + self._TAIL)
        self.accum = accum
        self._cuda = dist.device.type == "cuda"
        self._raise_nonfinite = nonfinite == "error"
        self.skipped = 0  # steps skipped by nonfinite_loss=skip (host: that mode syncs anyway)
        self._alloc(capacity)
        self.reset()

    def _alloc(self, capacity: int) -> None:
        dev, m = self.dist.device, len(self.metric_names)
        # A row per micro-batch: its mean loss, each metric's sum, each metric's count (if a tensor).
        self.table = torch.zeros(capacity, 1 + 2 * m, dtype=torch.float64, device=dev)
        self.norms = torch.zeros(capacity, device=dev)  # pre-clip grad norm of each step (if clipping)
        # 0-d views made once: a step writes into them with one kernel each (no per-step indexing op).
        self._rows = [row.unbind() for row in self.table.unbind()]

    def _grow(self) -> None:
        old = (self.table, self.norms)
        self._alloc(2 * len(self.table))
        for new, o in zip((self.table, self.norms), old):
            new[: len(o)] = o

    def add_micro(self, out: TaskOutput) -> None:
        """One micro-batch's task output: stored as is, weighted by its size at reduce time."""
        i, m = len(self.sizes), len(self.metric_names)
        if i == len(self.table):
            self._grow()
        host = []
        with torch.no_grad():  # copy_ into the table: one kernel each, no sync
            row, metrics = self._rows[i], out.metrics
            row[0].copy_(out.loss)
            for j, name in enumerate(self.metric_names):
                s, c = metrics[name]
                if isinstance(s, Tensor):
                    row[1 + j].copy_(s)
                else:
                    row[1 + j].fill_(s)
                if isinstance(c, Tensor):
                    row[1 + m + j].copy_(c)
                    c = None  # the table's cell holds it
                host.append(c)  # a number is shape metadata: no kernel at all (its cell is not read)
        self.sizes.append(out.size)
        self.host_counts.append(host)

    def add_grad_norm(self, norm: Tensor) -> None:
        if self.norm_n == len(self.norms):
            self._grow()
        self.norms[self.norm_n] = norm.detach()
        self.norm_n += 1

    def last_step_losses(self) -> Tensor:
        """The current step's micro-batch losses (device tensor), for nonfinite_loss=skip."""
        return self.table[len(self.sizes) - self.accum : len(self.sizes), 0]

    def nonfinite_on_any_rank(self, step: int) -> bool:
        """nonfinite_loss=skip: whether any rank's loss in step ``step`` (any micro-batch) is NaN/Inf (a sync
        and a collective: that mode's cost); such a step is counted and said, and every rank drops it."""
        if not any_rank((~torch.isfinite(self.last_step_losses())).any(), self.dist):
            return False
        self.skipped += 1
        log.warning("non-finite loss at step %d: step skipped (nonfinite_loss=skip)", step)
        return True

    def reset(self) -> None:
        self.sizes: list[int] = []
        # per micro-batch: the metric counts given as numbers (None: given as a tensor, in the table)
        self.host_counts: list[list[float | None]] = []
        self.norm_n = 0
        self.step_time = self.data_time = 0.0
        self.steps = 0
        self.t_start = time.perf_counter()
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self.dist.device)

    def add_step(self, step_time: float, data_time: float) -> None:
        self.step_time += step_time
        self.data_time += data_time
        self.steps += 1

    def _local_values(self, stop: bool) -> list[float]:
        """This rank's row, in ``self.slots``' order, from one read of the table (the interval's sync; the
        grad norms a second, with clipping). Sums are exactly rounded (``math.fsum``); a non-finite
        micro-batch weighs 0."""
        k, m = len(self.sizes), len(self.metric_names)
        loss, weight, sums, counts = [], [], [[] for _ in range(m)], [[] for _ in range(m)]
        bad, first_bad = 0, 0
        for i, (values, size, host) in enumerate(zip(self.table[:k].tolist(), self.sizes, self.host_counts)):
            if not math.isfinite(values[0]):
                first_bad = first_bad if bad else i
                bad += 1
                continue
            loss.append(values[0] * size)  # exact: a float32/bf16 loss times a size fits float64
            weight.append(size)
            for j in range(m):
                sums[j].append(values[1 + j])
                counts[j].append(values[1 + m + j] if host[j] is None else host[j])
        # a step fp16's scaler skipped has an inf norm: no number to average (it updated nothing;
        # train/fp16_skipped_steps counts it)
        norms = [n for n in self.norms[: self.norm_n].tolist() if math.isfinite(n)] if self.norm_n else []
        mem = torch.cuda.max_memory_allocated(self.dist.device) / 2**30 if self._cuda else 0.0
        return [
            _sum(loss),
            _sum(weight),
            *(_sum(x) for x in sums),
            *(_sum(x) for x in counts),
            float(bad),
            float(first_bad),
            _sum(norms),
            float(len(norms)),
            self.step_time,
            self.data_time,
            float(self.steps),
            time.perf_counter() - self.t_start,
            mem,
            float(stop),
        ]

    def reduce(
        self, where: str = "", last_step: int = 0, stop: bool = False
    ) -> tuple[dict[str, float], bool]:
        """ONE collective: the ``train/*`` and ``vitals/*`` scalars (same on every rank), and whether any
        rank's ``stop`` was set.

        ``last_step`` is the optimizer step that ends this interval: it dates a NaN/Inf loss. ``stop``: this
        rank's flag for the StopAgreement (a preemption), carried free in the row: every rank learns every
        rank's flag from the same collective at the same step; the agreement itself is the StopAgreement's.
        The sums over ranks are exactly rounded too (``math.fsum``): the same in any order of the ranks.
        """
        lay = self.slots
        rows = all_ranks_values(self._local_values(stop), self.dist)
        self._raise_if_nonfinite(rows, last_step, where)
        total = [_sum(column) for column in zip(*rows)]
        sums = _means(total, lay, self.metric_names, f"training, {where}")
        if total[lay["grad_norm.count"]]:
            sums["grad_norm"] = total[lay["grad_norm"]] / total[lay["grad_norm.count"]]
        steps = max(rows[0][lay["steps"]], 1.0)
        out = {f"train/{k}": v for k, v in sums.items() if k != "num_samples"}
        out["vitals/samples_per_s"] = sums["num_samples"] / max(max(r[lay["wall"]] for r in rows), 1e-9)
        for name in ("step", "data"):
            ms = [r[lay[f"{name}_time"]] / steps * 1e3 for r in rows]  # per rank
            out[f"vitals/{name}_time_ms"] = _sum(ms) / len(ms)
            out[f"vitals/{name}_time_ms_max"] = max(ms)  # the straggler sets the pace
            out[f"vitals/{name}_time_ms_min"] = min(ms)
        if self._cuda:
            out["vitals/peak_mem_gb"] = max(r[lay["peak_mem"]] for r in rows)
        if self.skipped:
            out["vitals/skipped_steps"] = float(self.skipped)
        self.reset()
        return out, total[lay["stop"]] > 0

    def _raise_if_nonfinite(self, rows: list[list[float]], last_step: int, where: str) -> None:
        lay = self.slots
        bad = [r for r, row in enumerate(rows) if row[lay["nonfinite"]] > 0]
        if not (self._raise_nonfinite and bad):  # every rank sees the same rows: all stop here together
            return
        # the first non-finite micro-batch → its optimizer step (the steps of an interval are consecutive)
        step = min(
            int(last_step - rows[r][lay["steps"]] + 1 + rows[r][lay["nonfinite_micro"]] // self.accum)
            for r in bad
        )
        raise NonFiniteLossError(
            f"training loss became NaN/Inf at step {step} (rank(s) {bad}; noticed at the log step, "
            f"{where}). Fix: lower optimizer.lr, set grad_clip=1.0, use amp_dtype=bfloat16 instead of "
            "float16, check the data for NaN — or nonfinite_loss=skip to skip such steps."
        )
