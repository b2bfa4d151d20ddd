"""Metric accumulators, their one-collective reduction, and the rank-0 writer.

Per step, only device-side stores happen (no ``.item()``, no collective):
on a GPU these are queued kernels and never stall the host. Once per log
interval every rank's numbers are packed into one tensor and exchanged in a
single collective (:func:`ddplab.distributed.all_ranks_rows`), from which
sample-weighted means (sums / counts — not a mean of rank means) and the
max/min over ranks (stragglers) are read.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from ddplab.distributed import DistState, all_ranks_rows

# Slots of the packed per-rank row.
_LOSS, _CORRECT, _COUNT, _NORM, _NORM_N = range(5)
_STEP_T, _DATA_T, _STEPS, _WALL, _MEM = range(5, 10)


class SumMeter:
    """Device-side sums of loss, correct predictions and samples (evaluation)."""

    def __init__(self, device: torch.device):
        # float64: exact sample counts and sums far past float32's 2**24.
        self.sums = torch.zeros(5, dtype=torch.float64, device=device)

    def update(self, loss: Tensor, logits: Tensor, target: Tensor) -> None:
        """``loss`` is the batch mean; weight it by the batch size so means stay exact."""
        n = target.numel()
        with torch.no_grad():
            self.sums[_LOSS] += loss.detach().double() * n
            self.sums[_CORRECT] += (logits.argmax(-1) == target).sum()
            self.sums[_COUNT] += n

    def reset(self) -> None:
        self.sums.zero_()


def _reduce_sums(rows: Tensor) -> dict[str, float]:
    total = rows[:, :_NORM_N + 1].sum(0).tolist()  # the one host-device sync of a log step
    count = total[_COUNT]
    out = {"num_samples": count}
    if count:
        out["loss"] = total[_LOSS] / count
        out["acc"] = total[_CORRECT] / count
    if total[_NORM_N]:
        out["grad_norm"] = total[_NORM] / total[_NORM_N]
    return out


class NonFiniteLossError(FloatingPointError):
    pass


class TrainMetrics:
    """Training-side accumulation between log steps, plus host timers per rank.

    Per micro-batch the device only *stores* two numbers (the mean loss and
    the number of correct predictions) into preallocated buffers: about four
    tiny kernels, no sync, no collective. Everything else — sample-weighted
    sums, the NaN/Inf check naming the first bad step, grad-norm means — is
    computed from the buffers once per log interval, right before the one
    collective.
    """

    def __init__(self, state: DistState, nonfinite: str = "error", accum: int = 1, capacity: int = 64):
        self.state = state
        self.accum = accum
        self._cuda = state.device.type == "cuda"
        self._raise_nonfinite = nonfinite == "error"
        self.skipped = 0  # steps skipped by nonfinite_loss=skip (host: that mode syncs anyway)
        self._alloc(capacity)
        self.reset()

    def _alloc(self, capacity: int) -> None:
        dev = self.state.device
        self.losses = torch.zeros(capacity, device=dev)  # mean loss of each micro-batch
        self.correct = torch.zeros(capacity, dtype=torch.int64, device=dev)  # correct predictions of each
        self.norms = torch.zeros(capacity, device=dev)  # pre-clip grad norm of each step (if clipping)
        # 0-d views made once: a step writes into them with one kernel each (no per-step indexing op).
        self._loss_slots = self.losses.unbind()
        self._correct_slots = self.correct.unbind()

    def _grow(self) -> None:
        old = (self.losses, self.correct, self.norms)
        self._alloc(2 * len(self.losses))
        for new, o in zip((self.losses, self.correct, self.norms), old):
            new[: len(o)] = o

    def add_micro(self, loss: Tensor, logits: Tensor, target: Tensor) -> None:
        """One micro-batch: ``loss`` is its mean; stored as is, weighted by its size at reduce time."""
        i = len(self.sizes)
        if i == len(self.losses):
            self._grow()
        with torch.no_grad():
            self._loss_slots[i].copy_(loss)
            torch.sum(logits.argmax(-1) == target, dim=0, out=self._correct_slots[i])
        self.sizes.append(target.numel())  # shape metadata: no sync

    def add_grad_norm(self, norm: Tensor) -> None:
        if self.norm_n == len(self.norms):
            self._grow()
        self.norms[self.norm_n] = norm.detach()
        self.norm_n += 1

    def last_step_losses(self) -> Tensor:
        """The current step's micro-batch losses (device tensor), for nonfinite_loss=skip."""
        return self.losses[len(self.sizes) - self.accum: len(self.sizes)]

    def reset(self) -> None:
        self.sizes: list[int] = []
        self.norm_n = 0
        self.step_time = self.data_time = 0.0
        self.steps = 0
        self.t_start = time.perf_counter()
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self.state.device)

    def add_step(self, step_time: float, data_time: float) -> None:
        self.step_time += step_time
        self.data_time += data_time
        self.steps += 1

    def _local_row(self, last_step: int) -> Tensor:
        """This rank's packed sums (device ops only; the caller's collective is the sync)."""
        k, dev = len(self.sizes), self.state.device
        losses = self.losses[:k].double()
        finite = torch.isfinite(losses)
        w = torch.tensor(self.sizes, dtype=torch.float64, device=dev) * finite  # skipped (non-finite) ones weigh 0
        sums = torch.zeros(5, dtype=torch.float64, device=dev)
        sums[_LOSS] = (torch.where(finite, losses, 0.0) * w).sum()
        sums[_CORRECT] = (self.correct[:k].double() * finite).sum()
        sums[_COUNT] = w.sum()
        sums[_NORM] = self.norms[: self.norm_n].double().sum()
        sums[_NORM_N] = self.norm_n
        # First non-finite micro-batch → its optimizer step (steps of an interval are consecutive).
        bad = ~finite
        first_micro = torch.where(bad, torch.arange(k, device=dev, dtype=torch.float64), float(k)).min() \
            if k else torch.zeros((), dtype=torch.float64, device=dev)
        first_step = (last_step - self.steps + 1) + torch.div(first_micro, self.accum, rounding_mode="floor")
        nonfinite = torch.stack([bad.sum().double(), torch.where(bad.any(), first_step, 0.0)])
        mem = torch.cuda.max_memory_allocated(dev) / 2**30 if self._cuda else 0.0
        wall = time.perf_counter() - self.t_start
        host = torch.tensor([self.step_time, self.data_time, self.steps, wall, mem], dtype=torch.float64)
        return torch.cat([sums, host.to(dev), nonfinite])

    def reduce(self, where: str = "", last_step: int = 0) -> dict[str, float]:
        """ONE collective; returns ``train/*`` and ``perf/*`` scalars (same on every rank).

        ``last_step`` is the optimizer step that ends this interval: it dates a NaN/Inf loss.
        """
        rows = all_ranks_rows(self._local_row(last_step), self.state).cpu()
        bad, first = rows[:, _MEM + 1], rows[:, _MEM + 2]
        if self._raise_nonfinite and bad.sum() > 0:  # every rank sees the same rows: all stop here together
            step = int(first[first > 0].min().item())
            ranks = [r for r in range(len(bad)) if bad[r] > 0]
            raise NonFiniteLossError(
                f"training loss became NaN/Inf at step {step} (rank(s) {ranks}; noticed at the log step, "
                f"{where}). Fix: lower optimizer.lr, set grad_clip=1.0, use amp_dtype=bfloat16 instead of "
                "float16, check the data for NaN — or nonfinite_loss=skip to skip such steps.")
        sums = _reduce_sums(rows)
        steps = max(rows[0, _STEPS].item(), 1.0)
        step_ms = rows[:, _STEP_T] / steps * 1e3  # per rank
        data_ms = rows[:, _DATA_T] / steps * 1e3
        out = {f"train/{k}": v for k, v in sums.items() if k != "num_samples"}
        out.update({
            "perf/samples_per_s": sums["num_samples"] / max(rows[:, _WALL].max().item(), 1e-9),
            "perf/step_time_ms": step_ms.mean().item(),
            "perf/step_time_ms_max": step_ms.max().item(),  # the straggler sets the pace
            "perf/step_time_ms_min": step_ms.min().item(),
            "perf/data_time_ms": data_ms.mean().item(),
            "perf/data_time_ms_max": data_ms.max().item(),
            "perf/data_time_ms_min": data_ms.min().item(),
        })
        if self._cuda:
            out["perf/peak_mem_gb"] = rows[:, _MEM].max().item()
        if self.skipped:
            out["train/skipped_steps"] = float(self.skipped)
        self.reset()
        return out


def reduce_eval(meter: SumMeter, state: DistState) -> dict[str, float]:
    """Exact validation metrics from every rank's sums (one collective)."""
    sums = _reduce_sums(all_ranks_rows(meter.sums, state).cpu())
    return {f"val/{k}": v for k, v in sums.items()}


# -------------------------------------------------------------------- writers
class NullWriter:
    """What non-zero ranks get: the loop calls the same methods, nothing happens."""

    def scalars(self, values: dict[str, float], step: int) -> None:
        pass

    def text(self, tag: str, value: str) -> None:
        pass

    def hparams(self, hparams: dict[str, Any], metric_tags: list[str]) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardWriter(NullWriter):
    """Rank 0's SummaryWriter, opened at the first scalar (or at close).

    Importing TensorBoard and opening the event file takes a few hundred ms;
    nothing needs them before the first log step, so they stay off the path
    from launch to the first training step. Text and HParams written earlier
    are queued and land first in the file.
    """

    def __init__(self, log_dir: str, purge_step: int | None = None):
        self.log_dir, self.purge_step = log_dir, purge_step
        self._w: Any = None
        self._queued: list[tuple[str, tuple]] = []

    def _writer(self) -> Any:
        if self._w is None:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events a crashed run logged past its last checkpoint,
            # so a resumed run's curves have each step once.
            self._w = SummaryWriter(log_dir=self.log_dir, purge_step=self.purge_step)
            for method, args in self._queued:
                getattr(self, method)(*args)
            self._queued.clear()
        return self._w

    def scalars(self, values: dict[str, float], step: int) -> None:
        w = self._writer()
        for k, v in values.items():
            w.add_scalar(k, v, step)

    def text(self, tag: str, value: str) -> None:
        if self._w is None:
            self._queued.append(("text", (tag, value)))
            return
        # Markdown: indent four spaces so yaml keeps its layout in TensorBoard's Text tab.
        self._w.add_text(tag, "    " + value.replace("\n", "\n    "), 0)

    def hparams(self, hparams: dict[str, Any], metric_tags: list[str]) -> None:
        """HParams-tab entry for this run, in this run's own event file (add_hparams would
        make a second run dir). The metric values are the scalars logged under those tags."""
        if self._w is None:
            self._queued.append(("hparams", (hparams, metric_tags)))
            return
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        clean = {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in hparams.items()}
        for summary in hparams_summary(clean, {t: 0.0 for t in metric_tags}):
            self._w.file_writer.add_summary(summary)

    def close(self) -> None:
        self._writer().close()


def make_writer(state: DistState, log_dir: str, purge_step: int | None = None) -> Any:
    return TensorBoardWriter(log_dir, purge_step) if state.is_main else NullWriter()
