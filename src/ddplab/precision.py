"""Mixed precision as one object: autocast context + the backward/step recipe.

scale → backward → unscale → clip → step → update, with a GradScaler only for
float16: bfloat16 has float32's exponent range, so its gradients do not
underflow and scaling would only cost time.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import Tensor

log = logging.getLogger(__name__)

_ALIASES = {"bf16": "bfloat16", "fp16": "float16"}


def _resolve_dtype(amp_dtype: str, device: torch.device) -> torch.dtype:
    name = _ALIASES.get(str(amp_dtype), str(amp_dtype))
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16  # pre-Ampere GPUs: fp16 tensor cores, with a GradScaler
    return torch.bfloat16  # CPU and Ampere+ GPUs


class Precision:
    def __init__(self, amp: bool, amp_dtype: str, device: torch.device):
        self.enabled = amp
        self.device = device
        self.dtype = _resolve_dtype(amp_dtype, device) if amp else torch.float32
        use_scaler = amp and self.dtype == torch.float16
        self.scaler = torch.amp.GradScaler(device.type, enabled=use_scaler) if use_scaler else None
        # fp16 steps the scaler skipped (inf/nan gradients): counted on the device, read at log steps.
        self.overflow_steps = torch.zeros((), device=device)

    def describe(self) -> str:
        if not self.enabled:
            return "fp32"
        return f"amp {str(self.dtype).removeprefix('torch.')}" + (" + GradScaler" if self.scaler else "")

    def autocast(self) -> contextlib.AbstractContextManager:
        if not self.enabled:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, params: list[Tensor], grad_clip: float) -> Tensor | None:
        """Unscale, clip, step, update; returns the pre-clip grad norm (a device tensor) if clipping."""
        norm = None
        if self.scaler:
            self.scaler.unscale_(optimizer)  # clip real gradients, not scaled ones
        if grad_clip > 0:
            # No .item(): the norm stays on the device until the next log step.
            norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
        if self.scaler:
            found = self.scaler._found_inf_per_device(optimizer)  # set by unscale_; no sync to read
            self.overflow_steps += sum(f.to(self.overflow_steps.device) for f in found.values()).clamp(max=1)
            self.scaler.step(optimizer)  # skips the step if grads hold inf/nan
            self.scaler.update()
        else:
            optimizer.step()
        return norm

    def loss_scale(self) -> float | None:
        """Current fp16 loss scale; a host-device sync, so call it on log steps only."""
        return self.scaler.get_scale() if self.scaler else None

    def pop_overflow_steps(self) -> float | None:
        """fp16 steps skipped since the last call (a host sync: log steps only)."""
        if not self.scaler:
            return None
        n = self.overflow_steps.item()
        self.overflow_steps.zero_()
        return n

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler and state:
            self.scaler.load_state_dict(state)
