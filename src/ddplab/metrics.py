"""Metric accumulators, their one-collective reduction, and the rank-0 writer.

Per step, only device-side additions happen (no ``.item()``, no collective):
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
    """Device-side sums of loss, correct predictions and samples (+ grad norms)."""

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

    def add_grad_norm(self, norm: Tensor) -> None:
        self.sums[_NORM] += norm.detach().double()
        self.sums[_NORM_N] += 1

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
    """Training-side accumulation between log steps, plus host timers per rank."""

    def __init__(self, state: DistState, nonfinite: str = "error"):
        self.state = state
        self.meter = SumMeter(state.device)
        self._cuda = state.device.type == "cuda"
        self._check_nonfinite = nonfinite == "error"
        # [count of non-finite losses, first step that had one]: device-side, read at log steps.
        self.nonfinite = torch.zeros(2, dtype=torch.float64, device=state.device)
        self.skipped = 0  # steps skipped by nonfinite_loss=skip (host: that mode syncs anyway)
        self.reset()

    def track_nonfinite(self, loss: Tensor, step: int) -> None:
        """Note a NaN/Inf loss without a host sync; :meth:`reduce` raises, naming the first step."""
        if not self._check_nonfinite:
            return
        bad = (~torch.isfinite(loss.detach())).double().sum()
        first_unset = (self.nonfinite[1] == 0).double()
        self.nonfinite[1] += first_unset * (bad > 0).double() * step
        self.nonfinite[0] += bad

    def reset(self) -> None:
        self.meter.reset()
        self.step_time = self.data_time = 0.0
        self.steps = 0
        self.t_start = time.perf_counter()
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self.state.device)

    def add_step(self, step_time: float, data_time: float) -> None:
        self.step_time += step_time
        self.data_time += data_time
        self.steps += 1

    def reduce(self, where: str = "") -> dict[str, float]:
        """ONE collective; returns ``train/*`` and ``perf/*`` scalars (same on every rank)."""
        wall = time.perf_counter() - self.t_start
        mem = torch.cuda.max_memory_allocated(self.state.device) / 2**30 if self._cuda else 0.0
        host = torch.tensor([self.step_time, self.data_time, self.steps, wall, mem], dtype=torch.float64)
        row = torch.cat([self.meter.sums, host.to(self.meter.sums.device), self.nonfinite])
        rows = all_ranks_rows(row, self.state).cpu()
        bad, first = rows[:, _MEM + 1], rows[:, _MEM + 2]
        if bad.sum() > 0:  # every rank sees the same rows, so every rank stops here together
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
    def __init__(self, log_dir: str, purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter  # rank 0 only pays the import

        # purge_step drops events a crashed run logged past its last checkpoint,
        # so a resumed run's curves have each step once.
        self._w = SummaryWriter(log_dir=log_dir, purge_step=purge_step)

    def scalars(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self._w.add_scalar(k, v, step)

    def text(self, tag: str, value: str) -> None:
        # Markdown: indent four spaces so yaml keeps its layout in TensorBoard's Text tab.
        self._w.add_text(tag, "    " + value.replace("\n", "\n    "), 0)

    def hparams(self, hparams: dict[str, Any], metric_tags: list[str]) -> None:
        """HParams-tab entry for this run, in this run's own event file (add_hparams would
        make a second run dir). The metric values are the scalars logged under those tags."""
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        clean = {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in hparams.items()}
        for summary in hparams_summary(clean, {t: 0.0 for t in metric_tags}):
            self._w.file_writer.add_summary(summary)

    def close(self) -> None:
        self._w.close()


def make_writer(state: DistState, log_dir: str, purge_step: int | None = None) -> Any:
    return TensorBoardWriter(log_dir, purge_step) if state.is_main else NullWriter()
