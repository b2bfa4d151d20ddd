"""Model FLOPs and device peaks, for the ``vitals/tflops`` and ``vitals/mfu`` scalars.

FLOPs are counted once with ``torch.utils.flop_counter`` on one eval-mode
sample of the first batch trained on (never the dataset's ``__getitem__``: a probe
of it would draw from the user's random streams at a step that depends on
``log_every_n_steps``; every torch random state is restored around the count, and
no running stat is updated) and multiplied by 3
for forward + backward — the convention of MFU reports (backward costs about
twice the forward). MFU = achieved FLOP/s / (peak FLOP/s x devices), with the
peak of the compute dtype looked up for known GPUs (dense, no sparsity) or
given as ``perf.peak_tflops``.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode  # here, not at the count: compat.defer_dynamo covers it

from ddplab.data.batches import first_tensor

log = logging.getLogger("ddplab")

# Dense TFLOP/s per device: (bf16/fp16 tensor cores, fp32), from the vendor's data sheets. A name matches
# as whole words, the first entry that matches wins (so "H100 PCIe" before "H100", and "L4" is not "L40" nor
# "A10" an "A10G", which have peaks of their own); the plain names are the SXM parts.
_PEAKS = [
    ("H200", 989.4, 66.9),
    ("H100 PCIe", 756.0, 51.2),
    ("H100 NVL", 835.0, 60.0),
    ("H100", 989.4, 66.9),
    ("A100", 312.0, 19.5),
    ("L40S", 362.1, 91.6),
    ("L40", 181.0, 90.5),
    ("L4", 121.0, 30.3),
    ("A10", 125.0, 31.2),
    ("V100", 125.0, 15.7),
    ("RTX 4090", 165.2, 82.6),
    ("T4", 65.0, 8.1),
]


def peak_tflops(device: torch.device, dtype: torch.dtype, override: float | None) -> float | None:
    """One device's peak for ``dtype``; None where unknown (CPUs, unlisted GPUs) and not configured."""
    if override:
        return float(override)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, low, fp32 in _PEAKS:
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", name):
            return low if dtype in (torch.bfloat16, torch.float16) else fp32
    log.info("vitals/mfu off: peak TFLOP/s of %r unknown; set perf.peak_tflops to log it", name)
    return None


@torch.no_grad()
def train_flops_per_sample(module: nn.Module, sample: Tensor | None) -> float | None:
    """3 x forward FLOPs of one sample, or None if the model cannot be counted."""
    if sample is None:
        log.info("vitals/tflops off: no tensor in the batch to count the model's FLOPs on")
        return None
    was_training = module.training
    module.eval()
    cuda = [sample.device] if sample.device.type == "cuda" else []
    try:  # a model that draws even in eval mode must not shift the streams that training continues with
        with torch.random.fork_rng(devices=cuda), FlopCounterMode(display=False) as counter:
            module(sample[:1])
        flops = counter.get_total_flops()
    except Exception as e:  # exotic ops: no MFU, but never a failed run
        log.info("vitals/tflops off: FLOPs of the model could not be counted (%s)", e)
        return None
    finally:
        module.train(was_training)
    return 3.0 * flops if flops else None


class FlopRate:
    """``vitals/tflops`` (model FLOPs the job achieves) and ``vitals/mfu`` where the device peak is known.

    The FLOPs are counted on first use — the first log step, off the path from
    launch to the first training step — and never when ``enabled`` is False.
    """

    def __init__(
        self,
        enabled: bool,
        module: nn.Module,
        device: torch.device,
        dtype: torch.dtype,
        peak_override: float | None,
        world_size: int,
    ):
        self._todo = enabled
        self._module, self._sample, self._device, self._dtype = module, None, device, dtype
        self._override, self._world = peak_override, world_size
        self.per_sample: float | None = None
        self.peak: float | None = None

    def keep(self, batch: Any) -> None:
        """The first tensor of a batch trained on (as the model gets it), one sample of it, for the count."""
        x = first_tensor(batch) if self._todo and self._sample is None else None
        if x is not None and x.dim():
            self._sample = x[:1].clone()  # not a view: the batch's memory is freed

    def rates(self, samples_per_s: float) -> dict[str, float]:
        if self._todo:
            self._todo = False
            self.per_sample = train_flops_per_sample(self._module, self._sample)
            self._sample = None
            self.peak = peak_tflops(self._device, self._dtype, self._override)
        if not self.per_sample:
            return {}
        out = {"vitals/tflops": self.per_sample * samples_per_s / 1e12}
        if self.peak:
            out["vitals/mfu"] = out["vitals/tflops"] / (self.peak * self._world)
        return out
